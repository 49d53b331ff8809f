"""BERT's masked-LM corruption, applied in the data pipeline (numpy, no model code)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def mlm_mask(
  rng: np.random.Generator,
  tokens: np.ndarray,
  *,
  mask_id: int,
  vocab_size: int,
  special_ids: Sequence[int],
  mask_prob: float = 0.15,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """BERT masking in NumPy, for the data pipeline.

  In each row, mask_prob of the real tokens (not padding 0, not special ids) are chosen, at least
  one in a row with any real token; the count is rounded stochastically so the expected fraction
  is exactly mask_prob. Of the chosen, 80% become mask_id, 10% a random non-special token and 10%
  stay unchanged.

  Args:
    rng: NumPy generator; the same state gives the same masking.
    tokens: `[B, T]` integer token ids, 0 = padding.
    mask_id: the [MASK] id.
    vocab_size: number of token ids.
    special_ids: ids never chosen and never inserted as random tokens (mask_id is excluded too).
    mask_prob: fraction of real tokens to predict.

  Returns:
    (inputs `[B, T]` as tokens.dtype, targets `[B, T]` = the original tokens,
    weights `[B, T]` float32, 1 at chosen positions).
  """
  tokens = np.asarray(tokens)
  if tokens.ndim != 2:
    raise ValueError(f'tokens must be [B, T], got shape {tokens.shape}')
  if not 0.0 < mask_prob <= 1.0:
    raise ValueError(f'mask_prob={mask_prob} must be in (0, 1]')
  if not 0 <= mask_id < vocab_size:
    raise ValueError(f'mask_id={mask_id} must be in [0, vocab_size={vocab_size})')
  if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
    raise ValueError(f'token ids must be in [0, vocab_size={vocab_size})')
  excluded = np.array(sorted({0, mask_id, *special_ids}), dtype=np.int64)
  replacements = np.setdiff1d(np.arange(vocab_size), excluded)  # ids allowed as random tokens
  if replacements.size == 0:
    raise ValueError(f'no non-special token ids in vocab_size={vocab_size} to sample from')

  eligible = ~np.isin(tokens, excluded)  # [B, T] real tokens: not padding, mask or special
  num_eligible = eligible.sum(axis=1)  # [B]
  num_chosen = np.floor(mask_prob * num_eligible + rng.random(num_eligible.shape)).astype(int)
  num_chosen = np.where(num_eligible > 0, np.clip(num_chosen, 1, num_eligible), 0)  # [B]
  # A random ranking of each row's eligible positions; the first num_chosen are chosen.
  keys = np.where(eligible, rng.random(tokens.shape), np.inf)  # [B, T]
  ranks = np.argsort(np.argsort(keys, axis=1), axis=1)  # [B, T]
  chosen = eligible & (ranks < num_chosen[:, None])

  action = rng.random(tokens.shape)  # < 0.8: mask, < 0.9: random token, else unchanged
  random_tokens = rng.choice(replacements, size=tokens.shape)
  inputs = tokens.copy()
  inputs = np.where(chosen & (action < 0.8), mask_id, inputs)
  inputs = np.where(chosen & (action >= 0.8) & (action < 0.9), random_tokens, inputs)
  return inputs.astype(tokens.dtype), tokens.copy(), chosen.astype(np.float32)
