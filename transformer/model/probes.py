"""Fixed probes of a causal LM's heads: repeated random tokens, the previous-token,
duplicate-token and induction scores of every head on them, and the in-context loss of a batch.

The training loop logs them as telemetry (`train.induction_every`); the research tools
(`research.interventions.head_detectors`) report them for a trained or imported model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer.config import ModelConfig
from transformer.data import BOS_ID, NUM_SPECIAL
from transformer.model import hooks


def repeated_tokens(
  vocab_size: int,
  length: int,
  batch: int,
  seed: int = 0,
  low: int = NUM_SPECIAL,
  pool=None,
  prefix: Sequence[int] = (BOS_ID,),
) -> np.ndarray:
  """[B, P + 2 * length] int32: the `prefix` (P ids: sparrow's bos by default; a model's own
  `prompt_prefix`, which may be empty), then `length` random tokens twice. The tokens are ids in
  [low, vocab_size) (above the special ids), or drawn from `pool` (e.g. the ids a training batch
  holds)."""
  rng = np.random.default_rng(seed)
  if pool is None:
    half = rng.integers(low, vocab_size, (batch, length))
  else:
    half = rng.choice(np.asarray(pool), (batch, length))
  start = np.broadcast_to(np.asarray(prefix, np.int64).reshape(1, -1), (batch, len(prefix)))
  return np.concatenate([start, half, half], axis=1).astype(np.int32)


def detector_scores(patterns: np.ndarray, length: int) -> dict[str, np.ndarray]:
  """Previous-token, duplicate-token and induction scores of every head from its patterns
  [B, N, T, T] on `repeated_tokens` rows (T = P + 2 * length, P the prefix): the mean attention,
  over the second copy's queries, to the previous token, to the same token's first occurrence,
  and to the token after that occurrence. Each is in [0, 1]."""
  p = np.asarray(patterns, np.float64)
  T = p.shape[-1]
  queries = np.arange(T - length, T)  # the second copy
  at = lambda offset: p[:, :, queries, queries - offset].mean((0, 2))  # [N]
  return {
    'previous_token': at(1),
    'duplicate_token': at(length),
    'induction': at(length - 1),
  }


def induction_probe(cfg: ModelConfig, params: Any, tokens: np.ndarray) -> dict[str, Any]:
  """`detector_scores` of every layer ({kind: [L, N]}) on `repeated_tokens` rows, and the mean
  loss on the second copy ('induction_loss', low when the model copies from its context) and on
  the first ('first_copy_loss')."""
  length = tokens.shape[1] // 2
  start = tokens.shape[1] - 2 * length  # the prefix's length: 1 after a bos, 0 without one
  names = [f'blocks.{layer}.attn.hook_pattern' for layer in range(cfg.num_layers)]
  logits, cache = hooks.run_jit(cfg, params, {'inputs': jnp.asarray(tokens)}, names=names)
  scores = [detector_scores(cache[n], length) for n in names]
  out: dict[str, Any] = {k: np.stack([s[k] for s in scores]) for k in scores[0]}
  nll = token_losses(logits[:, :-1], tokens[:, 1:])  # nll[:, j] predicts token j + 1
  out['induction_loss'] = float(nll[:, start + length - 1 :].mean())  # the second copy
  # The first copy's tokens after its first (which nothing predicts).
  out['first_copy_loss'] = float(nll[:, start : start + length - 1].mean())
  return out


def token_losses(logits: jax.Array, targets: np.ndarray) -> np.ndarray:
  """[B, T]: the loss of each target [B, T] under logits [B, T, V], in float32."""
  logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32))
  picked = jnp.take_along_axis(logp, jnp.asarray(targets)[..., None], -1)
  return -np.asarray(picked, np.float64)[..., 0]


def in_context_loss(
  cfg: ModelConfig, params: Any, inputs: dict, targets: np.ndarray, weights: np.ndarray
) -> dict[str, float]:
  """How much later tokens of a document gain from the context before them: the mean loss on
  the last quarter of each document's scored targets minus that on its first quarter (negative
  when the context helps; Olsson et al. 2022 take token 500 against token 50). Documents are the
  packed segments of `inputs` (or whole rows). {'in_context_loss', 'early_loss', 'late_loss'}."""
  nll = token_losses(hooks.run_jit(cfg, params, inputs)[0], targets)  # [B, T]
  positions = np.asarray(inputs.get('positions'))
  if inputs.get('positions') is None:
    positions = np.broadcast_to(np.arange(targets.shape[1]), targets.shape)
  segments = inputs.get('segments')
  segments = np.ones(targets.shape, int) if segments is None else np.asarray(segments)
  scored = np.asarray(weights) > 0
  early, late = [], []
  for row in range(targets.shape[0]):
    for segment in np.unique(segments[row][scored[row]]):
      at = np.flatnonzero(scored[row] & (segments[row] == segment))
      if len(at) < 4:
        continue  # too short to have a first and a last quarter
      quarter = len(at) // 4
      order = at[np.argsort(positions[row, at], kind='stable')]
      early.append(nll[row, order[:quarter]])
      late.append(nll[row, order[-quarter:]])
  if not early:
    return {'in_context_loss': float('nan'), 'early_loss': float('nan'), 'late_loss': float('nan')}
  e, lt = float(np.concatenate(early).mean()), float(np.concatenate(late).mean())
  return {'in_context_loss': lt - e, 'early_loss': e, 'late_loss': lt}
