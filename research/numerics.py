"""Numerics of float16 attention (seed §4.3): a softmax computed in float16 without subtracting
the max overflows once a logit passes ln(65504) = 11.09; sparrow's float32 softmax does not.

`softmax_overflow` measures it on unscaled logits of head_dim 64, against float64 NumPy.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from transformer.model.attention import dot_product_attention

FP16_MAX = float(jnp.finfo(jnp.float16).max)  # 65504: exp(x) overflows float16 for x > 11.09


def naive_fp16_attention(q, k, v):
  """softmax(q k^T) v entirely in float16 with exp(s) / sum exp(s) (no max subtracted, no
  float32): what a hand-written attention does. q [B, T, N, H], k/v [B, S, N, H] float16."""
  f16 = jnp.float16
  logits = jnp.einsum('btnh,bsnh->bnts', q, k, preferred_element_type=f16)  # [B, N, T, S]
  e = jnp.exp(logits)  # float16: inf once a logit passes 11.09
  p = e / e.sum(-1, keepdims=True)  # inf / inf = NaN
  return jnp.einsum('bnts,bsnh->btnh', p, v, preferred_element_type=f16)


def stable_fp16_attention(q, k, v):
  """The same in float16, but with the max subtracted first (jax.nn.softmax): finite, no upcast."""
  logits = jnp.einsum('btnh,bsnh->bnts', q, k, preferred_element_type=jnp.float16)
  p = jax.nn.softmax(logits, axis=-1)  # float16 throughout
  return jnp.einsum('bnts,bsnh->btnh', p, v, preferred_element_type=jnp.float16)


def _inputs(max_logit: float, B: int, T: int, N: int, H: int, seed: int):
  """float16 q, k, v whose unscaled logits peak at `max_logit` in every row (v ~ N(0, 1))."""
  rng = np.random.default_rng(seed)
  q, k, v = (rng.standard_normal((B, T, N, H)) for _ in range(3))
  logits = np.einsum('btnh,bsnh->btns', q, k)  # [B, T, N, S]
  q = q * (max_logit / logits.max(-1))[..., None]  # row max = max_logit (rows have a positive max)
  f16 = lambda x: jnp.asarray(x, jnp.float16)
  q, k, v = f16(q), f16(k), f16(v)
  return q, k, v


def _reference(q, k, v) -> np.ndarray:
  """float64 softmax attention of the float16 inputs, unscaled: [B, T, N, H]."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  logits = np.einsum('btnh,bsnh->bnts', q, k)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum('bnts,bsnh->btnh', p, v)


def softmax_overflow(
  max_logits=(8.0, 10.0, 11.0, 11.5, 12.0, 16.0),
  *,
  batch: int = 2,
  length: int = 128,
  heads: int = 4,
  head_dim: int = 64,
  seed: int = 0,
) -> dict[str, float]:
  """For each peak logit m (unscaled, head_dim 64): the share of output rows that are inf/NaN
  and the max |error| against float64 of the naive float16 softmax, the stable float16 one, and
  `dot_product_attention` ('xla' and 'chunked', float16 inputs, float32 softmax inside).

  Keys: '<path>.nonfinite@m' (share of [B, T, N] rows with an inf/NaN) and '<path>.max_err@m'
  (over finite entries; NaN when none is finite) and '<path>.zero_rows@m' (rows that came out all
  0: an overflowed row sum makes p = e / inf = 0), path in naive_fp16, stable_fp16, xla, chunked;
  'rounding.max_err@m' is the floor: the error of the float64 answer merely stored in float16.
  """
  paths = {
    'naive_fp16': naive_fp16_attention,
    'stable_fp16': stable_fp16_attention,
    'xla': lambda q, k, v: dot_product_attention(q, k, v, scale=1.0, implementation='xla'),
    'chunked': lambda q, k, v: dot_product_attention(
      q, k, v, scale=1.0, implementation='chunked', chunk_size=32
    ),
  }
  out = {}
  for m in max_logits:
    q, k, v = _inputs(m, batch, length, heads, head_dim, seed)
    want = _reference(q, k, v)
    rounded = np.asarray(jnp.asarray(want, jnp.float16), np.float64)
    out[f'rounding.max_err@{m:g}'] = float(np.abs(rounded - want).max())
    for name, fn in paths.items():
      got = np.asarray(jax.jit(fn)(q, k, v), np.float64)  # float16 -> float64
      finite = np.isfinite(got)
      out[f'{name}.nonfinite@{m:g}'] = float(np.mean(~finite.all(-1)))
      out[f'{name}.zero_rows@{m:g}'] = float(np.mean((got == 0).all(-1)))  # silently lost
      err = np.abs(got - want)[finite]
      out[f'{name}.max_err@{m:g}'] = float(err.max()) if err.size else math.nan
  return out
