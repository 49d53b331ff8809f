"""Training objectives: label-smoothed cross-entropy, summed metrics, and BERT-style MLM masking.

Losses and metrics are returned as sums with their weight sum, so they add up across batches.
"""

from __future__ import annotations

import functools
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
  _check_smoothing(label_smoothing, logits.shape[-1])
  return _xent(logits, targets, float(label_smoothing))


# The smoothed target q puts `confidence` on the target and `low` on every other token; expanding
# -sum_v q_v log p_v = -(confidence - low) log p_y - low sum_v log p_v needs only the logsumexp,
# the target logit and the sum of the logits. A custom VJP keeps the backward to one fused pass
# over [B, T, V] (softmax minus a one-hot built from an iota compare) instead of the log-softmax
# buffer, a gather and its scatter-add transpose: the head's loss is most of a small LM's step.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _xent(logits: Array, targets: Array, label_smoothing: float) -> tuple[Array, Array]:
  return _xent_fwd(logits, targets, label_smoothing)[0]


def _xent_fwd(logits, targets, label_smoothing):
  vocab_size = logits.shape[-1]
  x = logits.astype(jnp.float32)
  lse = _logsumexp(x)  # [B, T]
  target_logit = jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0]  # [B, T]
  nll = lse - target_logit
  if label_smoothing == 0:
    return (nll, nll), (logits, targets, lse)
  confidence, low = 1.0 - label_smoothing, label_smoothing / (vocab_size - 1)
  sum_log_probs = jnp.sum(x, axis=-1) - vocab_size * lse  # [B, T]
  smoothed = (confidence - low) * nll - low * sum_log_probs
  return (smoothed, nll), (logits, targets, lse)


def _logsumexp(x: Array) -> Array:
  """logsumexp over the last axis. The sum of exponentials is a matrix-vector product: XLA:CPU
  runs a reduction fused with `exp` on one core without vectorising it (about 2x slower)."""
  m = jax.lax.stop_gradient(jnp.max(x, axis=-1))
  ones = jnp.ones((x.shape[-1],), x.dtype)
  total = jnp.einsum('...v,v->...', jnp.exp(x - m[..., None]), ones, precision='highest')
  return m + jnp.log(total)


def _xent_bwd(label_smoothing, residuals, cotangents):
  logits, targets, lse = residuals
  g_smoothed, g_nll = cotangents  # [B, T] each
  vocab_size = logits.shape[-1]
  confidence, low = 1.0 - label_smoothing, label_smoothing / max(vocab_size - 1, 1)
  if label_smoothing == 0:
    g_smoothed, confidence, low = g_smoothed, 1.0, 0.0
  # d smoothed = (confidence - low) (p - onehot) + low (V p - 1); d nll = p - onehot.
  p_coef = g_nll + g_smoothed * (confidence - low + low * vocab_size)  # [B, T]
  onehot_coef = g_nll + g_smoothed * (confidence - low)
  probs = jnp.exp(logits.astype(jnp.float32) - lse[..., None])  # [B, T, V]
  onehot = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == targets[..., None]
  grad = (
    probs * p_coef[..., None]
    - jnp.where(onehot, onehot_coef[..., None], 0.0)
    - (g_smoothed * low)[..., None]
  )
  return grad.astype(logits.dtype), None


_xent.defvjp(_xent_fwd, _xent_bwd)


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
  logits: Array,
  targets: Array,
  weights: Array,
  label_smoothing: float = 0.0,
  accuracy: bool = True,
) -> dict[str, Array]:
  """Summed metrics for one batch.

  Args:
    logits: `[B, T, V]`.
    targets: `[B, T]` integer token ids.
    weights: `[B, T]` float, 0 at padding.
    label_smoothing: smoothing of the `loss` entry.
    accuracy: count argmax hits (one more pass over the logits; training steps skip it).

  Returns:
    float32 scalars: `loss` (smoothed cross-entropy sum), `nll` (plain cross-entropy sum, for
    perplexity), `correct` (weighted count of argmax hits), `denominator` (weight sum).
  """
  smoothed, nll = _token_losses(logits, targets, label_smoothing)
  weights = weights.astype(jnp.float32)
  sums = {
    'loss': jnp.sum(smoothed * weights),
    'nll': jnp.sum(nll * weights),
    'denominator': jnp.sum(weights),
  }
  if accuracy:
    hits = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)  # [B, T]
    sums['correct'] = jnp.sum(hits * weights)
  return sums


def summarize(metrics_sums: Mapping[str, float | Array]) -> dict[str, float]:
  """Turns summed metrics into per-token means: loss, nll, accuracy and perplexity = exp(nll).

  With a zero denominator (nothing counted) the means are 0 and the perplexity 1.
  """
  denominator = float(metrics_sums['denominator'])
  scale = 1.0 / denominator if denominator > 0 else 0.0
  nll = float(metrics_sums['nll']) * scale
  out = {'loss': float(metrics_sums['loss']) * scale, 'nll': nll}
  if 'correct' in metrics_sums:
    out['accuracy'] = float(metrics_sums['correct']) * scale
  out['perplexity'] = math.exp(nll) if nll < 700 else math.inf  # math.exp overflows past ~709
  return out


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
