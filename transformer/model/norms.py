"""LayerNorm and RMSNorm with float32 statistics: the blocks' norms and Qwen3's per-head q/k."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array


class Norm(nn.Module):
  """LayerNorm or RMSNorm with statistics in float32 whatever the compute dtype."""

  kind: str = 'layernorm'
  eps: float = 1e-6
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  axis_name: str = 'embed'  # logical axis of the normalised features ('kv' for q/k head norms)
  use_bias: bool = True  # LayerNorm's bias (RMSNorm never has one)

  @nn.compact
  def __call__(self, x: Array) -> Array:
    features = x.shape[-1]
    # float32 statistics: a bfloat16 mean of squares over D features loses too many digits.
    x32 = x.astype(jnp.float32)  # [..., D]
    if self.kind == 'layernorm':
      x32 = x32 - x32.mean(-1, keepdims=True)  # LayerNorm centres; RMSNorm does not
    # Centred, the mean of squares is the variance, so one line serves both kinds.
    y = x32 * jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + self.eps)
    ones = nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,))
    y = y * self.param('scale', ones, (features,), self.param_dtype)
    if self.kind == 'layernorm' and self.use_bias:
      zeros = nn.with_logical_partitioning(nn.initializers.zeros, (self.axis_name,))
      y = y + self.param('bias', zeros, (features,), self.param_dtype)
    return y.astype(self.dtype)  # same shape as x, in the compute dtype
