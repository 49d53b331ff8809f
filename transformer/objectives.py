"""Training objectives: label-smoothed cross-entropy, summed metrics, and BERT-style MLM masking.

Losses and metrics are returned as sums with their weight sum, so they add up across batches.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def _check_smoothing(label_smoothing: float, vocab_size: int) -> None:
  if not 0.0 <= label_smoothing < 1.0:
    raise ValueError(f'label_smoothing={label_smoothing} must be in [0, 1)')
  if label_smoothing > 0 and vocab_size < 2:
    raise ValueError(f'label smoothing needs vocab_size >= 2, got vocab_size={vocab_size}')


def _token_losses(logits: Array, targets: Array, label_smoothing: float) -> tuple[Array, Array]:
  """Per-token smoothed and plain cross-entropy, both `[B, T]` float32, from `[B, T, V]` logits."""
  vocab_size = logits.shape[-1]
  _check_smoothing(label_smoothing, vocab_size)
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, T, V]
  target_log_prob = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]  # [B, T]
  nll = -target_log_prob
  if label_smoothing == 0:
    return nll, nll
  # Smoothed target q: confidence on the target, `low` on every other token. Expanding
  # -sum_v q_v log p_v avoids building a [B, T, V] one-hot.
  confidence = 1.0 - label_smoothing
  low = label_smoothing / (vocab_size - 1)
  smoothed = -(confidence - low) * target_log_prob - low * jnp.sum(log_probs, axis=-1)  # [B, T]
  return smoothed, nll


def cross_entropy(
  logits: Array,
  targets: Array,
  weights: Array | None = None,
  label_smoothing: float = 0.0,
) -> tuple[Array, Array]:
  """Summed label-smoothed cross-entropy, computed in float32 whatever the logits dtype.

  The smoothed target puts 1 - label_smoothing on the target and label_smoothing / (V - 1) on
  every other token (paper; flax wmt). The loss is the raw cross-entropy against it, so even a
  perfect model pays its entropy: subtract `smoothing_constant(V, label_smoothing)` per token
  (times weight_sum) to get a loss whose minimum is 0.

  Args:
    logits: `[B, T, V]`.
    targets: `[B, T]` integer token ids.
    weights: `[B, T]` float, 0 at padding; None = all ones.
    label_smoothing: in [0, 1).

  Returns:
    (loss_sum, weight_sum), float32 scalars.
  """
  smoothed, _ = _token_losses(logits, targets, label_smoothing)
  if weights is None:
    weights = jnp.ones(targets.shape, jnp.float32)
  weights = weights.astype(jnp.float32)
  return jnp.sum(smoothed * weights), jnp.sum(weights)


def smoothing_constant(vocab_size: int, label_smoothing: float) -> float:
  """Entropy of the smoothed target distribution: the lowest per-token `cross_entropy` loss."""
  _check_smoothing(label_smoothing, vocab_size)
  if label_smoothing == 0:
    return 0.0
  confidence = 1.0 - label_smoothing
  low = label_smoothing / (vocab_size - 1)
  return -(confidence * math.log(confidence) + (vocab_size - 1) * low * math.log(low))


def compute_metrics(
  logits: Array, targets: Array, weights: Array, label_smoothing: float = 0.0
) -> dict[str, Array]:
  """Summed metrics for one batch.

  Args:
    logits: `[B, T, V]`.
    targets: `[B, T]` integer token ids.
    weights: `[B, T]` float, 0 at padding.
    label_smoothing: smoothing of the `loss` entry.

  Returns:
    float32 scalars: `loss` (smoothed cross-entropy sum), `nll` (plain cross-entropy sum, for
    perplexity), `correct` (weighted count of argmax hits), `denominator` (weight sum).
  """
  smoothed, nll = _token_losses(logits, targets, label_smoothing)
  weights = weights.astype(jnp.float32)
  hits = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)  # [B, T]
  return {
    'loss': jnp.sum(smoothed * weights),
    'nll': jnp.sum(nll * weights),
    'correct': jnp.sum(hits * weights),
    'denominator': jnp.sum(weights),
  }


def summarize(metrics_sums: Mapping[str, float | Array]) -> dict[str, float]:
  """Turns summed metrics into per-token means: loss, nll, accuracy and perplexity = exp(nll).

  With a zero denominator (nothing counted) the means are 0 and the perplexity 1.
  """
  denominator = float(metrics_sums['denominator'])
  scale = 1.0 / denominator if denominator > 0 else 0.0
  nll = float(metrics_sums['nll']) * scale
  return {
    'loss': float(metrics_sums['loss']) * scale,
    'nll': nll,
    'accuracy': float(metrics_sums['correct']) * scale,
    'perplexity': math.exp(nll) if nll < 700 else math.inf,  # math.exp overflows past ~709
  }


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
