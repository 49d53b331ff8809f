"""The norms beside `layers.RMSNorm` and `layers.LayerNorm`: `BatchNorm`, and each norm's
arithmetic in NumPy for the analyses that reapply it outside the model."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer.model.layers import HookPoint

Array = jax.Array


# The norms again, in NumPy, for the analyses that reapply one outside the model (the cache's
# apply_ln_to_stack, the logit lens, direct logit attribution, the OV readout): the arithmetic of
# `layers.RMSNorm` and its subclasses, written once per kind. BatchNorm divides by running
# statistics, not by the token's own, so an analysis cannot reapply it; `reapplied` refuses it in
# one line.
CENTRES = {
  'layernorm': True,
  'rmsnorm': False,
  'rmsnorm_offset': False,
}  # kind -> subtracts the mean?
OFFSETS = {'rmsnorm_offset': 1.0}  # kind -> what its weight adds to the parameter 'scale' (Gemma)


def gain(kind: str, scale):
  """The weight norm `kind` multiplies by, from its parameter 'scale' (Gemma's: 1 + scale)."""
  return scale + OFFSETS[kind] if kind in OFFSETS else scale


def reapplied(kind: str, what: str) -> bool:
  """Whether norm `kind` centres its input; an error that names `what` for a norm that cannot
  be reapplied."""
  if kind not in CENTRES:
    raise ValueError(
      f"{what} reapplies the model's norm to parts of the residual stream, which needs "
      f"norm='layernorm' or 'rmsnorm' (each token normalised by its own statistics); this model "
      f'has norm={kind!r}'
    )
  return CENTRES[kind]


def centred(kind: str, x, what: str = 'this analysis'):
  """x [..., D] minus its mean over D (LayerNorm), or x itself (RMSNorm)."""
  return x - x.mean(-1, keepdims=True) if reapplied(kind, what) else x


def divisor(kind: str, x, eps: float, what: str = 'this analysis'):
  """The norm's divisor sqrt(var + eps) [..., 1] of x [..., D] (RMSNorm: of the mean square)."""
  x = centred(kind, x, what)
  return np.sqrt((x * x).mean(-1, keepdims=True) + np.asarray(eps, x.dtype))


def normalized(kind: str, x, eps: float, scale, bias=None, what: str = 'this analysis'):
  """The whole norm on x [..., D], in x's NumPy dtype: centred, divided, times scale, + bias."""
  y = centred(kind, x, what) / divisor(kind, x, eps, what) * gain(kind, scale)
  return y if bias is None else y + bias


# Running statistics: new = MOMENTUM * old + (1 - MOMENTUM) * the batch's. PyTorch's default
# (its momentum=0.1): flax's 0.99 keeps 0.99^250 = 8% of the initial variance of 1 after 250
# steps, which outweighs a Transformer's real variances (about 0.01 at the first norm of a small
# GPT), so a short run evaluated with stale statistics.
BATCHNORM_MOMENTUM = 0.9


class BatchNorm(nn.Module):
  """BatchNorm over the real tokens of a batch: per-feature statistics over batch and time.

  Training (`deterministic=False`): each feature's mean and biased variance over every
  token whose segment id is > 0 (padding, id 0, never enters them; `segments=None`: every token
  is real), then the learned scale and bias. Where the 'batch_stats' collection is mutable (the
  train step), the running mean and variance move toward the batch's by BATCHNORM_MOMENTUM;
  where it is not (a diagnostic forward), they are neither read nor written. Evaluation,
  decoding and inference (`deterministic=True`) normalise by the running statistics
  alone, so a token's output depends on no other token. Statistics are float32.
  """

  eps: float = 1e-6
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  axis_name: str = 'embed'  # logical axis of the normalised features
  use_bias: bool = True
  momentum: float = BATCHNORM_MOMENTUM

  @nn.compact
  def __call__(self, x: Array, segments: Array | None = None, deterministic: bool = True) -> Array:
    """x [..., D] (e.g. [B, T, D]); segments [...] (e.g. [B, T]) int, 0 = padding. Returns x's
    shape in the compute dtype. `deterministic`: normalise by the running statistics."""
    use_running_average = deterministic
    features = x.shape[-1]
    x32 = x.astype(jnp.float32)  # [B, T, D]
    initializing = self.is_initializing()
    mutable = self.is_mutable_collection('batch_stats')
    stats = None
    if initializing or mutable or self.has_variable('batch_stats', 'mean'):
      stat = lambda fill: nn.with_logical_partitioning(fill, (self.axis_name,))
      stats = (
        self.variable('batch_stats', 'mean', stat(jnp.zeros), (features,), jnp.float32),  # [D]
        self.variable('batch_stats', 'var', stat(jnp.ones), (features,), jnp.float32),  # [D]
      )
    if use_running_average:
      if stats is None:
        raise ValueError(
          f"norm='batchnorm' module {'/'.join(self.path)!r} normalises by its running statistics "
          "outside training: apply the model with variables {'params': ..., 'batch_stats': ...} "
          '(training.state.weights(state)), not the parameters alone'
        )
      mean, var = stats[0].value, stats[1].value  # [D], [D]
    else:
      real = jnp.ones(x.shape[:-1], bool) if segments is None else segments > 0  # [B, T]
      real = jnp.broadcast_to(real, x.shape[:-1])[..., None]  # [B, T, 1]
      axes = tuple(range(x.ndim - 1))  # every axis but the features: batch and time
      count = jnp.maximum(real.sum(dtype=jnp.float32), 1.0)  # real tokens in the batch
      # `where`, not a product: whatever padding holds (even inf or NaN) stays out.
      mean = jnp.where(real, x32, 0.0).sum(axes) / count  # [D]
      var = jnp.where(real, jnp.square(x32 - mean), 0.0).sum(axes) / count  # [D], biased
      if mutable and not initializing:
        m = self.momentum
        stats[0].value = m * stats[0].value + (1 - m) * jax.lax.stop_gradient(mean)
        stats[1].value = m * stats[1].value + (1 - m) * jax.lax.stop_gradient(var)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)  # [B, T, D]
    y = HookPoint(name='hook_normalized')(y)  # before the weight and bias, as Norm's
    ones = nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,))
    y = y * self.param('scale', ones, (features,), self.param_dtype)
    if self.use_bias:
      zeros = nn.with_logical_partitioning(nn.initializers.zeros, (self.axis_name,))
      y = y + self.param('bias', zeros, (features,), self.param_dtype)
    return HookPoint(name='hook_out')(y.astype(self.dtype))  # x's shape, compute dtype
