"""Each attention head's entropy, read from a cache of patterns and scores: how sharp or spread
its attention is (`hooks.run_xla` with `patterns_and_scores` gives the cache). NumPy only.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def patterns_and_scores(name: str) -> bool:
  """Picks every attention's pattern and scores: what `attention_entropy` reads."""
  return name.endswith(('.hook_pattern', '.hook_attn_scores'))


def head_entropy(probs: np.ndarray, visible: np.ndarray | None = None) -> dict[str, np.ndarray]:
  """Mean attention entropy of each head over the query rows that see at least one key.

  Args:
    probs: [B, N, T, S] attention probabilities (a hook_pattern).
    visible: bool [B or 1, N or 1, T, S]: the keys each query may see; None = every key.

  Returns:
    {'entropy': [N] mean entropy in nats (0 <= H <= log S), 'normalized': [N] mean of H divided
    by the log of the number of visible keys, over rows that see at least two (0 = one key,
    1 = uniform), 'max': [N] the largest row entropy}.
  """
  probs = np.asarray(probs, np.float64)
  B, N, T, S = probs.shape
  if visible is None:
    visible = np.ones((1, 1, T, S), bool)
  counts = np.broadcast_to(np.asarray(visible).sum(-1), (B, N, T))  # visible keys per row
  # A row sums to 1 if it sees a key and to exactly 0 if fully masked; 0.5 splits the two.
  rows = probs.sum(-1) > 0.5  # [B, N, T]: queries that attend (not padding)
  logs = np.log(np.where(probs > 0, probs, 1.0))  # log 1 = 0 where p = 0: 0 log 0 counts as 0
  h = -np.sum(probs * logs, axis=-1)  # [B, N, T]: each row's entropy in nats
  mean = lambda x, w: (x * w).sum((0, 2)) / np.maximum(w.sum((0, 2)), 1.0)  # over B and T
  several = rows & (counts >= 2)  # with one key, log(count) = 0 and H = 0: nothing to normalise
  normalized = h / np.log(np.maximum(counts, 2))  # [B, N, T]
  return {
    'entropy': mean(h, rows),
    'normalized': mean(normalized, several),
    'max': np.where(rows, h, 0.0).max((0, 2)),
  }


def attention_entropy(cache: Mapping[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
  """`head_entropy` of every attention whose pattern and scores `cache` holds (`run_xla` with
  `patterns_and_scores`), by attention name: 'blocks.0.attn', 'decoder.blocks.0.cross_attn'.
  A query may see the keys whose score is not -inf."""
  out = {}
  for name, pattern in cache.items():
    if name.endswith('.hook_pattern'):
      attn = name.removesuffix('.hook_pattern')
      out[attn] = head_entropy(pattern, np.asarray(cache[f'{attn}.hook_attn_scores']) != -np.inf)
  return out
