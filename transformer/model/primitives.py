"""The primitives every layer is built from: `HookPoint` (an identity where an activation is made,
which `hooks.run` reads or replaces), the weight matmul of every Dense layer, and the norms
(LayerNorm, RMSNorm, BatchNorm) with float32 statistics."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array


# Hook points -------------------------------------------------------------------------------------
class HookPoint(nn.Module):
  """Returns its input. The module's path names the activation in TransformerLens's scheme
  (`hooks.hook_name`: .../layer_3/self_attention/hook_z -> blocks.3.attn.hook_z), and
  `hooks.run` intercepts the call to cache the value or replace it. It has no parameters, so
  declaring one changes no checkpoint."""

  @nn.compact
  def __call__(self, x: Array) -> Array:
    return x


# The weight matmul ---------------------------------------------------------------------------
# `dot_general` for the weight matmuls of Dense/DenseGeneral, as one 2-D matmul with its own VJP.
#
# XLA:CPU runs the autodiff transpose of a [B, T, D] x [D, ...] dot_general (a weight gradient that
# contracts B and T together) as transposed copies plus an unfused dot; flattened to
# [B*T, D] @ [D, F], with the weight gradient written as x.T @ g, the same sums run as plain matmuls
# (a char_lm step 1.4x as fast). Only on CPU: elsewhere it is `lax.dot_general`.
@jax.custom_vjp
def _mm(x, w):  # [M, K] @ [K, N] -> [M, N]
  return x @ w


def _mm_fwd(x, w):
  return x @ w, (x, w)


def _mm_bwd(res, g):
  x, w = res
  return g @ w.T, x.T @ g  # d x [M, K], d w [K, N]


_mm.defvjp(_mm_fwd, _mm_bwd)


def dot_general(
  lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **options
):
  """`lax.dot_general` for lhs [..., *C] and rhs [*C, ...] contracting the C axes, no batch axes;
  anything else goes to `lax.dot_general` unchanged."""
  (lc, rc), (lb, rb) = dimension_numbers
  n = len(lc)
  plain = (
    not lb
    and not rb
    and tuple(lc) == tuple(range(lhs.ndim - n, lhs.ndim))
    and tuple(rc) == tuple(range(n))
    and precision is None
    and preferred_element_type is None
    and lhs.dtype == rhs.dtype
    and not any(v is not None for v in options.values())  # e.g. a newer flax's out_sharding
  )
  if not plain or jax.default_backend() != 'cpu':  # GPU and TPU transpose dot_general well
    return lax.dot_general(
      lhs, rhs, dimension_numbers, precision, preferred_element_type, **options
    )
  k = math.prod(rhs.shape[:n])
  out = _mm(lhs.reshape(-1, k), rhs.reshape(k, -1))
  return out.reshape(lhs.shape[: lhs.ndim - n] + rhs.shape[n:])


# Norms -------------------------------------------------------------------------------------------
class Norm(nn.Module):
  """LayerNorm or RMSNorm with statistics in float32 whatever the compute dtype."""

  kind: str = 'layernorm'
  eps: float = 1e-6
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  axis_name: str = 'embed'  # logical axis of the normalised features ('kv' for q/k head norms)
  use_bias: bool = True  # LayerNorm's bias (RMSNorm never has one)

  @nn.compact
  def __call__(self, x: Array, segments: Array | None = None, deterministic: bool = True) -> Array:
    """x [..., D] -> x's shape; the norm of each token alone (the other arguments are BatchNorm's,
    so that every norm has one call signature)."""
    del segments, deterministic
    features = x.shape[-1]
    # float32 statistics: a bfloat16 mean of squares over D features loses too many digits.
    x32 = x.astype(jnp.float32)  # [..., D]
    if self.kind == 'layernorm':
      x32 = x32 - x32.mean(-1, keepdims=True)  # LayerNorm centres; RMSNorm does not
    # Centred, the mean of squares is the variance, so one line serves both kinds.
    var = (x32 * x32).mean(-1, keepdims=True) + self.eps  # [..., 1]
    # hook_scale holds the divisor sqrt(var + eps), as in TransformerLens. The forward multiplies
    # by rsqrt (the sqrt is dead code unless a hook reads it); a hook that returns a new divisor
    # (e.g. the clean run's, to freeze the norm) hands back another array, which it divides by.
    scale = jnp.sqrt(var)
    hooked = HookPoint(name='hook_scale')(scale)
    y = x32 * jax.lax.rsqrt(var) if hooked is scale else x32 / hooked
    # hook_normalized: before the weight and bias, float32, as in TransformerLens.
    y = HookPoint(name='hook_normalized')(y)
    ones = nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,))
    y = y * self.param('scale', ones, (features,), self.param_dtype)
    if self.kind == 'layernorm' and self.use_bias:
      zeros = nn.with_logical_partitioning(nn.initializers.zeros, (self.axis_name,))
      y = y + self.param('bias', zeros, (features,), self.param_dtype)
    return HookPoint(name='hook_out')(y.astype(self.dtype))  # x's shape, compute dtype


# The norms again, in NumPy, for the analyses that reapply one outside the model (the cache's
# apply_ln_to_stack, the logit lens, direct logit attribution, the OV readout): the arithmetic of
# `Norm`, written once per kind. BatchNorm divides by running statistics, not by the token's own,
# so an analysis cannot reapply it; `reapplied` refuses it in one line.
CENTRES = {'layernorm': True, 'rmsnorm': False}  # kind -> whether it subtracts the mean


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
  y = centred(kind, x, what) / divisor(kind, x, eps, what) * scale
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
