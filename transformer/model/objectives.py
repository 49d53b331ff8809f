"""Training objectives: label-smoothed cross-entropy (also fused with the output head, chunked over
the vocabulary) and summed metrics. BERT's MLM masking is data, in `transformer.data.masking`.

Losses and metrics are returned as sums with their weight sum, so they add up across batches.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp

Array = jax.Array


def _check_smoothing(label_smoothing: float, vocab_size: int) -> None:
  if not 0.0 <= label_smoothing < 1.0:
    raise ValueError(f'label_smoothing={label_smoothing} must be in [0, 1)')
  if label_smoothing > 0 and vocab_size < 2:
    raise ValueError(f'label smoothing needs vocab_size >= 2, got vocab_size={vocab_size}')


def _target_mass(label_smoothing: float, vocab_size: int) -> tuple[float, float]:
  """(confidence, low): the smoothed target's mass on the target and on each other token."""
  if label_smoothing == 0:
    return 1.0, 0.0
  return 1.0 - label_smoothing, label_smoothing / (vocab_size - 1)


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
  confidence, low = _target_mass(label_smoothing, vocab_size)
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
  confidence, low = _target_mass(label_smoothing, vocab_size)
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


def head_cross_entropy(
  hidden: Array,
  table: Array,
  bias: Array | None,
  targets: Array,
  weights: Array,
  label_smoothing: float = 0.0,
  chunk_size: int = 4096,
) -> dict[str, Array]:
  """`compute_metrics(hidden @ table.T + bias, ...)` without `[B, T, V]` logits or their gradient.

  The output head and the loss in one: the vocabulary is cut into chunks of `chunk_size` rows of
  `table`, and each chunk's logits live only as long as their matmul and softmax statistics. The
  backward pass reuses the chunk's softmax numerators, so it runs two matmuls per chunk and no
  pass over `[B, T, V]` of its own; the one-hot and smoothing terms are a gather and a scatter.

  Args:
    hidden: `[B, T, D]` final hidden states, in the compute dtype.
    table: `[V, D]` output embedding (the tied token embedding), in the compute dtype.
    bias: `[V]` output bias (BERT's MLM head) or None.
    targets: `[B, T]` integer token ids.
    weights: `[B, T]` float, 0 at padding.
    label_smoothing: in [0, 1).
    chunk_size: vocabulary rows per chunk (the last chunk may be shorter).

  Returns:
    float32 scalars `loss` (smoothed sum), `nll` (plain sum) and `denominator` (weight sum), as
    `compute_metrics(..., accuracy=False)` returns them. `loss` and `nll` are differentiable in
    `hidden`, `table` and `bias`.
  """
  vocab_size = table.shape[0]
  _check_smoothing(label_smoothing, vocab_size)
  if chunk_size < 1:
    raise ValueError(f'chunk_size={chunk_size} must be a positive number of vocabulary rows')
  if hidden.shape[:-1] != targets.shape or hidden.shape[-1] != table.shape[1]:
    raise ValueError(
      f'hidden {hidden.shape} must be [B, T, D] for targets {targets.shape} and table '
      f'{table.shape} [V, D]'
    )
  weights = weights.astype(jnp.float32)
  loss, nll = _head_xent(
    hidden, table, bias, targets, weights, float(label_smoothing), int(chunk_size)
  )
  return {'loss': loss, 'nll': nll, 'denominator': jnp.sum(weights)}


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _head_xent(hidden, table, bias, targets, weights, label_smoothing, chunk_size):
  return _head_xent_fwd(hidden, table, bias, targets, weights, label_smoothing, chunk_size)[0]


def _chunks(vocab_size: int, chunk_size: int) -> list[tuple[int, int]]:
  return [(s, min(s + chunk_size, vocab_size)) for s in range(0, vocab_size, chunk_size)]


def _head_xent_fwd(hidden, table, bias, targets, weights, label_smoothing, chunk_size):
  vocab_size, width = table.shape
  x = hidden.reshape(-1, width)  # [N, D], N = B * T
  y, w = targets.reshape(-1), weights.reshape(-1)  # [N]
  maxes, sums, numerators = [], [], []
  for start, stop in _chunks(vocab_size, chunk_size):
    logits = jnp.einsum('nd,cd->nc', x, table[start:stop])  # [N, C], as Embed.attend computes it
    if bias is not None:
      logits = logits + bias[start:stop].astype(logits.dtype)
    logits = logits.astype(jnp.float32)
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1))  # [N]
    e = jnp.exp(logits - m[:, None])  # [N, C] softmax numerators against the chunk's max
    maxes.append(m)
    sums.append(jnp.sum(e, axis=-1))
    numerators.append(e.astype(hidden.dtype))
  maxes, sums = jnp.stack(maxes), jnp.stack(sums)  # [K, N]
  top = jnp.max(maxes, axis=0)
  lse = top + jnp.log(jnp.sum(sums * jnp.exp(maxes - top), axis=0))  # [N]
  target_logit = jnp.einsum('nd,nd->n', x, table[y]).astype(jnp.float32)  # [N]
  if bias is not None:
    target_logit = target_logit + bias[y].astype(hidden.dtype).astype(jnp.float32)
  nll = lse - target_logit
  smoothed = nll
  if label_smoothing > 0:
    confidence, low = _target_mass(label_smoothing, vocab_size)
    logit_sum = jnp.einsum('nd,d->n', x, jnp.sum(table, axis=0)).astype(jnp.float32)  # sum_v
    if bias is not None:
      logit_sum = logit_sum + jnp.sum(bias.astype(jnp.float32))
    smoothed = (confidence - low) * nll - low * (logit_sum - vocab_size * lse)
  out = (jnp.sum(smoothed * w), jnp.sum(nll * w))
  scales = jnp.exp(maxes - lse)  # [K, N]: numerator e of chunk k times scales[k] = softmax
  return out, (x, table, bias, targets, w, numerators, scales)


def _head_xent_bwd(label_smoothing, chunk_size, residuals, cotangents):
  x, table, bias, targets, w, numerators, scales = residuals
  y = targets.reshape(-1)  # [N]
  g_loss, g_nll = cotangents  # scalars
  vocab_size = table.shape[0]
  confidence, low = _target_mass(label_smoothing, vocab_size)
  # d logits = p_coef p - onehot_coef onehot - const (see _xent_bwd), per token [N].
  p_coef = w * (g_nll + g_loss * (confidence - low + low * vocab_size))
  onehot_coef = w * (g_nll + g_loss * (confidence - low))
  const = w * g_loss * low
  dtype = x.dtype
  x32 = x.astype(jnp.float32)
  d_x = jnp.zeros(x.shape, jnp.float32)
  d_table, d_bias = [], []
  for k, (start, stop) in enumerate(_chunks(vocab_size, chunk_size)):
    coef = p_coef * scales[k]  # [N]: d logits of the chunk = coef * e (plus the terms below)
    e = numerators[k]  # [N, C]
    d_x = d_x + coef[:, None] * jnp.einsum('nc,cd->nd', e, table[start:stop]).astype(jnp.float32)
    d_table.append(jnp.einsum('nc,nd->cd', e, (coef[:, None] * x32).astype(dtype)))  # [C, D]
    if bias is not None:
      d_bias.append(jnp.einsum('nc,n->c', e.astype(jnp.float32), coef))
  d_table = jnp.concatenate(d_table).astype(jnp.float32)  # [V, D]
  # The one-hot term: a gather for the hidden states, a scatter-add for the table.
  d_x = d_x - onehot_coef[:, None] * table[y].astype(jnp.float32)
  d_table = d_table.at[y].add(-onehot_coef[:, None] * x32)
  if label_smoothing > 0:  # the uniform term: every vocabulary row alike
    d_x = d_x - const[:, None] * jnp.sum(table.astype(jnp.float32), axis=0)
    d_table = d_table - jnp.einsum('n,nd->d', const, x32)[None]
  if bias is not None:
    d_bias = jnp.concatenate(d_bias).at[y].add(-onehot_coef) - jnp.sum(const)
    d_bias = d_bias.astype(bias.dtype)
  return (
    d_x.reshape(targets.shape + x.shape[-1:]).astype(dtype),
    d_table.astype(table.dtype),
    d_bias if bias is not None else None,
    None,
    None,
  )


_head_xent.defvjp(_head_xent_fwd, _head_xent_bwd)


def compute_metrics(
  logits: Array,
  targets: Array,
  weights: Array,
  label_smoothing: float = 0.0,
  accuracy: bool = True,
) -> dict[str, Array]:
  """Summed metrics for one batch, computed in float32 whatever the logits dtype.

  The smoothed target puts 1 - label_smoothing on the target and label_smoothing / (V - 1) on
  every other token (paper; flax wmt). `loss` is the raw cross-entropy against it, so even a
  perfect model pays that distribution's entropy per token.

  Args:
    logits: `[B, T, V]`.
    targets: `[B, T]` integer token ids.
    weights: `[B, T]` float, 0 at padding.
    label_smoothing: smoothing of the `loss` entry, in [0, 1).
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
