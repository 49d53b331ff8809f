"""The short causal convolution before self attention (H3, Zoology's MQAR models, Based)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.kernels.masks import MaskSpec

Array = jax.Array


class ShortConv(nn.Module):
  """A causal depthwise convolution over the last `taps` positions: [B, T, D] -> [B, T, D].

  y[t] = sum_i w[i] * x[t - i] per channel, over positions of the same example (segment) only.
  Before self attention it hands each token its predecessors, the short convolution that H3,
  Zoology's MQAR models and Based put before their sequence mixers: an attention layer above it
  can match a key against the token before each value without first learning a previous-token
  head. Initialised to the identity (w[0] = 1). While decoding, the block's inputs are cached by
  position like the KV cache, so a step reads the `taps - 1` before it.
  """

  taps: int
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array, mask: MaskSpec | None, positions, cache_mode=None) -> Array:
    B, T, D = x.shape
    identity = lambda key, shape, dtype: jnp.zeros(shape, dtype).at[0].set(1.0)
    init = nn.with_logical_partitioning(identity, (None, 'embed'))
    w = self.param('kernel', init, (self.taps, D), self.param_dtype).astype(x.dtype)  # [K, D]
    if cache_mode is not None and cache_mode.phase == 'step':
      if not self.has_variable('cache', 'conv_inputs'):
        raise ValueError("CacheMode 'step' needs the cache that a 'prefill' call filled")
      if T != 1:
        raise ValueError(f'CacheMode step takes one token per row; got {T}')
      cache = self.variable('cache', 'conv_inputs')
      rows, slots = jnp.arange(B), jnp.broadcast_to(positions, (B, 1))[:, 0]  # [B], [B]
      cache.value = cache.value.at[rows, slots].set(x[:, 0])  # [B, L, D]
      back = slots[:, None] - jnp.arange(self.taps)[None]  # [B, K]: the slots read
      taps = cache.value[rows[:, None], jnp.maximum(back, 0)]  # [B, K, D]
      taps = jnp.where((back >= 0)[..., None], taps, 0)
      return jnp.einsum('bkd,kd->bd', taps, w)[:, None]  # [B, 1, D]
    if cache_mode is not None:  # prefill: the prompt's inputs in slots 0..T-1 of L
      if T > cache_mode.length:
        raise ValueError(
          f'a prompt of {T} tokens does not fit a cache of length={cache_mode.length}'
        )
      pad = [(0, 0), (0, cache_mode.length - T), (0, 0)]
      self.variable(
        'cache', 'conv_inputs', jnp.zeros, (B, cache_mode.length, D), x.dtype
      ).value = jnp.pad(x, pad)
    segments = None if mask is None else mask.q_segment_ids  # [B, T]; 0 = padding
    out = x * w[0]
    for i in range(1, self.taps):
      shifted = jnp.pad(x, [(0, 0), (i, 0), (0, 0)])[:, :T]  # x[t - i], 0 before the row
      if segments is not None:  # no tap reaches into the previous packed example
        same = segments == jnp.pad(segments, [(0, 0), (i, 0)])[:, :T]  # [B, T]
        shifted = jnp.where(same[..., None], shifted, 0)
      out = out + shifted * w[i]
    return out  # [B, T, D]
