"""Attention core: `MaskSpec` and `dot_product_attention` with interchangeable implementations.

Every attention in sparrow calls `dot_product_attention` with tensors laid out `[B, T, N, H]`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import Array

from transformer import positions as positions_lib
from transformer import sharding

_NEG = -1e30  # logit of a masked entry: finite, so fully masked rows never produce NaN
_DENSE_MAX_ELEMENTS = 1024 * 1024  # auto-select 'xla' while one head's T * S logits fit this


def _visible(causal, window, q_pos, k_pos, q_seg, kv_seg, kv_len=None) -> Array:
  """bool[B or 1, 1, T, C]: may query at q_pos[t] see key at k_pos[c]?"""
  i, j = q_pos[:, None], k_pos[None, :]  # [T, 1], [1, C]
  ok = jnp.ones((q_pos.shape[0], k_pos.shape[0]), bool)  # [T, C]
  if causal:
    ok &= j <= i
  if window is not None:
    ok &= (j >= i - window[0]) & (j <= i + window[1])
  if kv_len is not None:  # keys past kv_len are padding added by the chunked path
    ok &= j < kv_len
  ok = ok[None, None]  # [1, 1, T, C]
  if q_seg is not None:
    same = (q_seg[:, :, None] == kv_seg[:, None, :]) & (q_seg[:, :, None] != 0)  # [B, T, C]
    ok = ok & same[:, None]  # [B, 1, T, C]
  return ok


@flax.struct.dataclass
class MaskSpec:
  """Which keys each query may see; a pytree (segment ids are leaves, causal/window static).

  Query i sits at position i and key j at position j (top-left alignment). Query i sees key j
  iff every given condition holds: causal (j <= i), same non-zero segment id (0 = padding), and
  window=(left, right) (i - left <= j <= i + right).
  """

  causal: bool = flax.struct.field(pytree_node=False, default=False)
  q_segment_ids: Array | None = None  # [B, T] int; 0 = padding
  kv_segment_ids: Array | None = None  # [B, S] int; 0 = padding
  window: tuple[int, int] | None = flax.struct.field(pytree_node=False, default=None)

  def __post_init__(self):
    w = self.window
    if w is not None:
      ok = isinstance(w, tuple | list) and len(w) == 2
      if not (ok and all(isinstance(x, int) and not isinstance(x, bool) for x in w)):
        raise ValueError(f'window={w!r} must be a pair of ints (left, right)')
      if min(w) < 0:
        raise ValueError(f'window={w!r} must have non-negative entries (left, right)')
      object.__setattr__(self, 'window', tuple(w))  # a list would not be hashable

  def dense(self, T: int, S: int) -> Array:
    """Materialises the mask as bool[B or 1, 1, T, S] (True = visible)."""
    pos_q, pos_k = jnp.arange(T), jnp.arange(S)
    return _visible(self.causal, self.window, pos_q, pos_k, self.q_segment_ids, self.kv_segment_ids)


def _alibi_bias(slopes: Array, K: int, q_pos: Array, k_pos: Array) -> Array:
  """float32[K, G, T, C]: the ALiBi bias -slope[n] * |i - j|, heads split as n = k * G + g."""
  dist = jnp.abs(q_pos[:, None] - k_pos[None, :]).astype(jnp.float32)  # [T, C]
  return -slopes.astype(jnp.float32).reshape(K, -1)[:, :, None, None] * dist  # [K, G, T, C]


def _xla_attention(
  q, k, v, *, mask, scale, alibi_slopes, chunk_size=None, return_probs=False, dropout=None
):
  """Reference: dense logits and mask. Returns out, or (out, probs) if return_probs.

  `dropout=(rate, rng)` drops attention probabilities (the returned probs are before dropout).
  """
  del chunk_size  # unused: everything is materialised
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  qg = q.reshape(B, T, K, N // K, H)  # [B, T, K, G, H]
  f32 = jnp.float32
  logits = jnp.einsum('btkgh,bskh->bkgts', qg, k, preferred_element_type=f32) * scale
  if alibi_slopes is not None:
    logits = logits + _alibi_bias(alibi_slopes, K, jnp.arange(T), jnp.arange(S))
  visible = mask.dense(T, S)[:, :, None]  # [B or 1, 1, 1, T, S]
  logits = jnp.where(visible, logits, _NEG)  # [B, K, G, T, S]
  probs = jnp.where(visible, jax.nn.softmax(logits, axis=-1), 0.0)  # fully masked rows -> 0
  weights = probs
  if dropout is not None:
    rate, rng = dropout
    keep = jax.random.bernoulli(rng, 1.0 - rate, probs.shape)
    weights = jnp.where(keep, probs / (1.0 - rate), 0.0)
  out = jnp.einsum('bkgts,bskh->btkgh', weights.astype(v.dtype), v, preferred_element_type=f32)
  out = out.reshape(B, T, N, H).astype(q.dtype)  # [B, T, N, H]
  return (out, probs.reshape(B, N, T, S)) if return_probs else out


class _ChunkConfig(NamedTuple):
  causal: bool
  window: tuple[int, int] | None
  scale: float
  chunk: int  # C, keys per block
  kv_len: int  # S before padding to a multiple of C


def _key_blocks(k, v, kv_seg, C):
  """Scan inputs: ((k, v, kv_seg) as [nC, B, C, ...], zero-padded to nC * C keys; starts [nC])."""

  def split(x):  # [B, S, ...] -> [nC, B, C, ...]
    x = jnp.pad(x, [(0, 0), (0, -x.shape[1] % C)] + [(0, 0)] * (x.ndim - 2))  # [B, nC * C, ...]
    return jnp.moveaxis(x.reshape(x.shape[0], -1, C, *x.shape[2:]), 1, 0)

  blocks = jax.tree.map(split, (k, v, kv_seg))  # kv_seg may be None
  return blocks, jnp.arange(blocks[0].shape[0]) * C


def _chunk_logits(cfg, qg, k_c, start, q_seg, kv_seg_c, slopes):
  """Scaled, biased, masked logits of one key block: (float32[B, K, G, T, C], visible)."""
  T, K, C = qg.shape[1], qg.shape[2], k_c.shape[1]
  q_pos, k_pos = jnp.arange(T), start + jnp.arange(C)
  s = jnp.einsum('btkgh,bckh->bkgtc', qg, k_c, preferred_element_type=jnp.float32) * cfg.scale
  if slopes is not None:
    s = s + _alibi_bias(slopes, K, q_pos, k_pos)
  visible = _visible(cfg.causal, cfg.window, q_pos, k_pos, q_seg, kv_seg_c, cfg.kv_len)
  visible = visible[:, :, None]  # [B or 1, 1, 1, T, C]
  return jnp.where(visible, s, _NEG), visible


def _flash_forward(q, k, v, q_seg, kv_seg, slopes, cfg):
  """Online softmax over key blocks. Returns out [B, T, N, H] and lse float32[B, K, G, T]."""
  B, T, N, H = q.shape
  K = k.shape[2]
  qg = q.reshape(B, T, K, N // K, H)  # [B, T, K, G, H]

  def step(carry, x):
    m, denom, acc = carry  # running max, softmax denominator, unnormalised output
    (k_c, v_c, seg_c), start = x
    s, visible = _chunk_logits(cfg, qg, k_c, start, q_seg, seg_c, slopes)  # [B, K, G, T, C]
    m_new = jnp.maximum(m, s.max(-1))  # [B, K, G, T]
    p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)  # [B, K, G, T, C]
    corr = jnp.exp(m - m_new)
    pv = jnp.einsum('bkgtc,bckh->bkgth', p.astype(v.dtype), v_c, preferred_element_type=jnp.float32)
    return (m_new, denom * corr + p.sum(-1), acc * corr[..., None] + pv), None

  zeros = jnp.zeros((B, K, N // K, T), jnp.float32)  # [B, K, G, T]
  init = (jnp.full_like(zeros, _NEG), zeros, jnp.zeros((*zeros.shape, H), jnp.float32))
  (m, denom, acc), _ = jax.lax.scan(step, init, _key_blocks(k, v, kv_seg, cfg.chunk))
  seen = denom > 0  # False on fully masked rows, whose output is exactly 0
  l_safe = jnp.where(seen, denom, 1.0)
  out = jnp.where(seen[..., None], acc / l_safe[..., None], 0.0)  # [B, K, G, T, H]
  out = out.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H).astype(q.dtype)  # [B, T, N, H]
  lse = jnp.where(seen, m + jnp.log(l_safe), 0.0)  # [B, K, G, T]
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, q_seg, kv_seg, slopes, cfg):
  return _flash_forward(q, k, v, q_seg, kv_seg, slopes, cfg)[0]


def _flash_fwd(q, k, v, q_seg, kv_seg, slopes, cfg):
  out, lse = _flash_forward(q, k, v, q_seg, kv_seg, slopes, cfg)
  return out, (q, k, v, q_seg, kv_seg, slopes, out, lse)


def _flash_bwd(cfg, res, dout):
  """Recomputes each key block's probabilities from lse; dq accumulates, dk/dv per block."""
  q, k, v, q_seg, kv_seg, slopes, out, lse = res
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  qg = q.reshape(B, T, K, N // K, H)  # [B, T, K, G, H]
  dog = dout.reshape(qg.shape)  # [B, T, K, G, H]
  f32 = jnp.float32
  D = jnp.einsum('btkgh,btkgh->bkgt', dog.astype(f32), out.reshape(qg.shape).astype(f32))

  def step(carry, x):
    dq, dslopes = carry
    (k_c, v_c, seg_c), start = x
    s, visible = _chunk_logits(cfg, qg, k_c, start, q_seg, seg_c, slopes)  # [B, K, G, T, C]
    p = jnp.where(visible, jnp.exp(s - lse[..., None]), 0.0)  # softmax probs of this block
    dv_c = jnp.einsum('bkgtc,btkgh->bckh', p.astype(v.dtype), dog, preferred_element_type=f32)
    dp = jnp.einsum('btkgh,bckh->bkgtc', dog, v_c, preferred_element_type=f32)
    ds = p * (dp - D[..., None])  # d logits, [B, K, G, T, C]
    ds_in = ds.astype(q.dtype)
    dq = dq + jnp.einsum('bkgtc,bckh->btkgh', ds_in, k_c, preferred_element_type=f32)
    dk_c = jnp.einsum('bkgtc,btkgh->bckh', ds_in, qg, preferred_element_type=f32)
    if slopes is not None:  # d bias / d slope = -|i - j|
      k_pos = start + jnp.arange(k_c.shape[1])
      dist = jnp.abs(jnp.arange(T)[:, None] - k_pos[None, :]).astype(f32)  # [T, C]
      dslopes = dslopes - jnp.einsum('bkgtc,tc->kg', ds, dist)
    return (dq, dslopes), (dk_c * cfg.scale, dv_c)

  init = (jnp.zeros(qg.shape, f32), None if slopes is None else jnp.zeros((K, N // K), f32))
  (dq, dslopes), (dk, dv) = jax.lax.scan(step, init, _key_blocks(k, v, kv_seg, cfg.chunk))
  dq = (dq * cfg.scale).reshape(B, T, N, H).astype(q.dtype)
  dk = jnp.moveaxis(dk, 0, 1).reshape(B, -1, K, H)[:, :S].astype(k.dtype)  # [B, S, K, H]
  dv = jnp.moveaxis(dv, 0, 1).reshape(B, -1, K, H)[:, :S].astype(v.dtype)  # [B, S, K, H]
  dslopes = None if slopes is None else dslopes.reshape(N).astype(slopes.dtype)
  return dq, dk, dv, None, None, dslopes


_flash.defvjp(_flash_fwd, _flash_bwd)


def _chunked_attention(q, k, v, *, mask, scale, alibi_slopes, chunk_size=128):
  """Flash-attention style in pure JAX: memory O(T * chunk_size), exact custom gradient."""
  S = k.shape[1]
  cfg = _ChunkConfig(mask.causal, mask.window, float(scale), min(chunk_size, S), S)
  return _flash(q, k, v, mask.q_segment_ids, mask.kv_segment_ids, alibi_slopes, cfg)


def _cudnn_attention(q, k, v, *, mask, scale, alibi_slopes, chunk_size=None):
  """cuDNN fused attention through `jax.nn.dot_product_attention` (NVIDIA GPUs only)."""
  del chunk_size
  if jax.default_backend() != 'gpu':
    raise ValueError(
      f"implementation='cudnn' needs an NVIDIA GPU, but the backend is "
      f"'{jax.default_backend()}'; use 'xla' or 'chunked' (or None to choose)"
    )
  T, S = q.shape[1], k.shape[1]
  window = None if mask.window is None else (mask.window[0], 0 if mask.causal else mask.window[1])
  segments = None  # the dense segment mask [B, 1, T, S], which cuDNN folds into its bias
  if mask.q_segment_ids is not None:
    segments = MaskSpec(q_segment_ids=mask.q_segment_ids, kv_segment_ids=mask.kv_segment_ids)
    segments = segments.dense(T, S)
  bias = None
  if alibi_slopes is not None:
    bias = _alibi_bias(alibi_slopes, q.shape[2], jnp.arange(T), jnp.arange(S))  # [N, 1, T, S]
    bias = bias.reshape(1, -1, T, S).astype(q.dtype)  # [1, N, T, S]
  cudnn = functools.partial(jax.nn.dot_product_attention, implementation='cudnn')
  out = cudnn(q, k, v, bias, segments, scale=scale, is_causal=mask.causal, local_window_size=window)
  any_visible = mask.dense(T, S).any(-1)[:, 0, :, None, None]  # [B or 1, T, 1, 1]
  return jnp.where(any_visible, out, 0).astype(q.dtype)  # fully masked rows -> exactly 0


def _pallas_attention(q, k, v, *, mask, scale, alibi_slopes, chunk_size=None):
  """Our Pallas flash-attention kernel (kernels/): Triton on GPU, Mosaic on TPU.

  On any other backend it runs in the Pallas interpreter: exact but slow, for tests only.
  """
  from kernels import flash_attention

  del chunk_size  # the kernel picks its own tiles (kernels.BlockSizes)
  if alibi_slopes is not None:
    raise ValueError(
      "alibi_slopes are not supported by implementation='pallas'; use 'xla' or 'chunked'"
    )
  return flash_attention(
    q,
    k,
    v,
    causal=mask.causal,
    q_segment_ids=mask.q_segment_ids,
    kv_segment_ids=mask.kv_segment_ids,
    window=mask.window,
    scale=float(scale),
    interpret=jax.default_backend() not in ('gpu', 'tpu'),
  )


# name -> fn(q, k, v, *, mask, scale, alibi_slopes, chunk_size) returning out [B, T, N, H].
_IMPLEMENTATIONS: dict[str, Callable[..., Array]] = {
  'xla': _xla_attention,
  'chunked': _chunked_attention,
  'pallas': _pallas_attention,
  'cudnn': _cudnn_attention,
}


def register_implementation(name: str, fn: Callable[..., Array]) -> None:
  """Registers (or replaces) an implementation selectable by `implementation=name`.

  `fn(q, k, v, *, mask, scale, alibi_slopes, chunk_size)` must return out `[B, T, N, H]`
  in q.dtype, with exactly 0 on fully masked query rows; see `dot_product_attention`.
  """
  _IMPLEMENTATIONS[name] = fn


def select_implementation(T: int, S: int, *, return_probs: bool = False) -> str:
  """Automatic choice: 'xla' when return_probs or T * S <= 1024 * 1024, else 'chunked'.

  Dense logits are fastest while one head's [T, S] float32 block stays at most 4 MiB; longer
  sequences use the memory-efficient 'chunked' path. Never picks 'pallas' or 'cudnn'.
  """
  return 'xla' if return_probs or T * S <= _DENSE_MAX_ELEMENTS else 'chunked'


def _check_inputs(q, k, v, mask, alibi_slopes, chunk_size):
  for name, x in (('q', q), ('k', k), ('v', v)):
    if x.ndim != 4:
      raise ValueError(f'{name} must have rank 4 [B, length, heads, head_dim]; got {x.shape}')
  B, T, N, H = q.shape
  if k.shape != v.shape:
    raise ValueError(f'k and v must have the same shape [B, S, K, H]; got {k.shape} and {v.shape}')
  if k.shape[0] != B or k.shape[3] != H:
    raise ValueError(f'q {q.shape} and k/v {k.shape} must agree in batch (0) and head_dim (3)')
  S, K = k.shape[1], k.shape[2]
  if N % K:
    raise ValueError(f'num_kv_heads={K} does not divide num_heads={N}; choose a divisor of {N}')
  if not isinstance(mask, MaskSpec):
    raise ValueError(f'mask must be a MaskSpec or None; got {type(mask).__name__}')
  if (mask.q_segment_ids is None) != (mask.kv_segment_ids is None):
    raise ValueError(
      'MaskSpec needs both q_segment_ids and kv_segment_ids, or neither; '
      'for self-attention pass the same ids twice'
    )
  if mask.q_segment_ids is not None:
    for name, ids, want in (('q', mask.q_segment_ids, (B, T)), ('kv', mask.kv_segment_ids, (B, S))):
      if tuple(ids.shape) != want:
        raise ValueError(f'{name}_segment_ids must have shape {list(want)}; got {list(ids.shape)}')
  if alibi_slopes is not None and tuple(alibi_slopes.shape) != (N,):
    raise ValueError(f'alibi_slopes must have shape [{N}]; got {list(alibi_slopes.shape)}')
  if not isinstance(chunk_size, int) or chunk_size < 1:
    raise ValueError(f'chunk_size={chunk_size!r} must be a positive int')


def dot_product_attention(
  q: Array,
  k: Array,
  v: Array,
  *,
  mask: MaskSpec | None = MaskSpec(),
  scale: float | None = None,
  implementation: str | None = None,
  return_probs: bool = False,
  alibi_slopes: Array | None = None,
  chunk_size: int = 128,
  dropout_rate: float = 0.0,
  dropout_rng: Array | None = None,
) -> Array | tuple[Array, Array]:
  """Multi-head (and grouped-query) scaled dot-product attention.

  Query head n reads kv head n // (N // K). Logits, softmax and logsumexp run in float32;
  fully masked query rows return exactly 0 (and 0 gradient).

  Args:
    q: queries `[B, T, N, H]`.
    k: keys `[B, S, K, H]`, with K dividing N.
    v: values `[B, S, K, H]`.
    mask: which keys each query sees; None means all of them.
    scale: logit multiplier; None means 1 / sqrt(H), 1.0 means no scaling.
    implementation: one of 'xla', 'chunked', 'pallas', 'cudnn' (or a registered name);
      None chooses with `select_implementation`.
    return_probs: also return the attention probabilities (only 'xla').
    alibi_slopes: optional `[N]` slopes; adds -slope[n] * |i - j| to the logits of head n.
    chunk_size: keys per block for 'chunked'.
    dropout_rate: dropout on the attention probabilities (needs 'xla' and `dropout_rng`).
    dropout_rng: PRNG key for that dropout.

  Returns:
    out `[B, T, N, H]` in q.dtype; with return_probs, (out, probs float32[B, N, T, S]).
  """
  mask = MaskSpec() if mask is None else mask
  _check_inputs(q, k, v, mask, alibi_slopes, chunk_size)
  T, S = q.shape[1], k.shape[1]
  if implementation is None:
    implementation = select_implementation(T, S, return_probs=return_probs)
  if implementation not in _IMPLEMENTATIONS:
    raise ValueError(
      f'implementation={implementation!r} is not one of '
      f'{sorted(_IMPLEMENTATIONS)} (or None to choose automatically)'
    )
  if return_probs and implementation != 'xla':
    raise ValueError(
      f"return_probs=True needs implementation='xla' (or None); got {implementation!r}"
    )
  if dropout_rate > 0 and (implementation != 'xla' or dropout_rng is None):
    raise ValueError(
      f"dropout_rate={dropout_rate} on attention probabilities needs implementation='xla' and a "
      f'dropout_rng; got implementation={implementation!r}'
    )
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
  kwargs = dict(mask=mask, scale=scale, alibi_slopes=alibi_slopes, chunk_size=chunk_size)
  if return_probs or dropout_rate > 0:
    dropout = (dropout_rate, dropout_rng) if dropout_rate > 0 else None
    return _xla_attention(q, k, v, return_probs=return_probs, dropout=dropout, **kwargs)
  return _IMPLEMENTATIONS[implementation](q, k, v, **kwargs)


# KV cache for decoding ---------------------------------------------------------------------
class CacheMode(NamedTuple):
  """How `MultiHeadAttention` uses its KV cache (the flax collection 'cache') while decoding.

  'prefill' runs a whole prompt through the configured implementation and writes its keys and
  values into a fresh cache: `length` slots for self attention, the encoder's S keys for cross
  attention. 'step' runs one token per row: self attention writes its key/value at the row's
  position (positions double as cache slots) and attends to slots <= that position; cross
  attention reuses the encoder's cached keys/values. Each cache leaf is `[B, L, K, H]` (a scanned
  stack prepends a layer axis).
  """

  phase: str  # 'prefill' | 'step'
  length: int  # L: self-attention slots = longest prompt + tokens to generate


def _attend_one_step(q, k, v, visible, *, scale, alibi_slopes=None, q_pos=None) -> Array:
  """One query per row against cached keys: dense float32 logits [B, K, G, L] are cheap here.

  Kept apart from `dot_product_attention` because the mask and the ALiBi bias depend on each row's
  own position, which the top-left aligned `MaskSpec` cannot express.

  Args:
    q: `[B, 1, N, H]`; k, v: `[B, L, K, H]`; visible: bool `[B or 1, L]`.
    alibi_slopes: optional `[N]`, with q_pos `[B]` the query positions (keys sit at 0..L-1).
  Returns:
    `[B, 1, N, H]` in q.dtype; a row that sees no key gives 0.
  """
  B, _, N, H = q.shape
  L, K = k.shape[1], k.shape[2]
  f32 = jnp.float32
  qg = q.reshape(B, K, N // K, H)  # [B, K, G, H]
  logits = jnp.einsum('bkgh,blkh->bkgl', qg, k, preferred_element_type=f32) * scale
  if alibi_slopes is not None:
    dist = jnp.abs(q_pos[:, None] - jnp.arange(L)[None]).astype(f32)  # [B, L]
    slopes = alibi_slopes.astype(f32).reshape(K, N // K)
    logits = logits - slopes[None, :, :, None] * dist[:, None, None, :]
  visible = visible[:, None, None, :]  # [B or 1, 1, 1, L]
  probs = jax.nn.softmax(jnp.where(visible, logits, _NEG), axis=-1)
  probs = jnp.where(visible, probs, 0.0)  # [B, K, G, L]
  out = jnp.einsum('bkgl,blkh->bkgh', probs.astype(v.dtype), v, preferred_element_type=f32)
  return out.reshape(B, 1, N, H).astype(q.dtype)  # [B, 1, N, H]


class MultiHeadAttention(nn.Module):
  """Self or cross attention: q/k/v/out projections around `dot_product_attention`.

  Positions that act on q and k (RoPE) or on the logits (ALiBi) are applied here, for self
  attention only; absolute positions are added to the embeddings by the model.
  """

  num_heads: int
  num_kv_heads: int
  head_dim: int
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  use_bias: bool = True
  kernel_init: Callable = nn.initializers.xavier_uniform()
  out_kernel_init: Callable = nn.initializers.xavier_uniform()
  dropout_rate: float = 0.0
  scale: float | None = None  # None = 1/sqrt(head_dim); 1.0 = unscaled
  implementation: str | None = None
  chunk_size: int = 128
  rope: tuple | None = None  # (theta, scaling, factor, original_max_length) for RoPE; None = off
  alibi: bool = False

  @nn.compact
  def __call__(
    self,
    inputs_q: Array,
    inputs_kv: Array | None = None,
    *,
    mask: MaskSpec | None = None,
    positions: Array | None = None,
    deterministic: bool = True,
    return_probs: bool = False,
    cache_mode: CacheMode | None = None,
  ):
    """Attends from `inputs_q` [B, T, D] to `inputs_kv` [B, S, D] (None = self attention).

    Args:
      positions: [B, T] integer positions for RoPE/ALiBi in self attention; None = arange(T).
        In the cache's 'step' phase they are required ([B, 1]) and are also the cache slots.
      return_probs: also return the attention probabilities [B, N, T, S] (the 'xla' path).
      cache_mode: decoding with a KV cache (see `CacheMode`); needs mutable=['cache'].
    Returns:
      [B, T, D], or ([B, T, D], [B, N, T, S]) with return_probs.
    """
    self_attention = inputs_kv is None
    inputs_kv = inputs_q if self_attention else inputs_kv
    if cache_mode is not None and cache_mode.phase == 'step' and self_attention:
      if positions is None:
        raise ValueError("CacheMode step needs positions [B, 1]: the slot of each row's token")
    features = inputs_q.shape[-1]

    def dense(heads: int, heads_axis: str, name: str) -> nn.DenseGeneral:
      return nn.DenseGeneral(
        (heads, self.head_dim),
        axis=-1,
        use_bias=self.use_bias,
        dtype=self.dtype,
        param_dtype=self.param_dtype,
        kernel_init=nn.with_logical_partitioning(self.kernel_init, ('embed', heads_axis, 'kv')),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (heads_axis, 'kv')),
        name=name,
      )

    constrain = lambda x, heads_axis: sharding.constrain(x, ('batch', 'length', heads_axis, 'kv'))
    q = constrain(dense(self.num_heads, 'heads', 'query')(inputs_q), 'heads')  # [B, T, N, H]
    k = constrain(
      dense(self.num_kv_heads, 'kv_heads', 'key')(inputs_kv), 'kv_heads'
    )  # [B, S, K, H]
    v = constrain(dense(self.num_kv_heads, 'kv_heads', 'value')(inputs_kv), 'kv_heads')

    alibi_slopes = None
    if self_attention and (self.rope is not None or self.alibi):
      if positions is None:
        positions = jnp.arange(inputs_q.shape[1])[None]  # [1, T]
      if self.rope is not None:
        theta, scaling, factor, original_max_length = self.rope
        inv_freq, mscale = positions_lib.rope_frequencies(
          self.head_dim,
          theta=theta,
          scaling=scaling,
          factor=factor,
          original_max_length=original_max_length,
        )
        q = positions_lib.apply_rope(q, positions, inv_freq, mscale)
        k = positions_lib.apply_rope(k, positions, inv_freq, mscale)
      if self.alibi:
        alibi_slopes = positions_lib.alibi_slopes(self.num_heads)

    if cache_mode is not None:  # decoding: fill the cache, or add one token to it
      k, v = self._update_cache(cache_mode, k, v, self_attention, mask, positions, return_probs)
    dropout = self.dropout_rate > 0 and not deterministic
    if cache_mode is not None and cache_mode.phase == 'step':
      out = self._attend_cache(q, k, v, self_attention, mask, positions, alibi_slopes)
    else:
      out = dot_product_attention(
        q,
        k,
        v,
        mask=mask,
        scale=self.scale,
        implementation='xla' if (dropout or return_probs) else self.implementation,
        return_probs=return_probs,
        alibi_slopes=alibi_slopes,
        chunk_size=self.chunk_size,
        dropout_rate=self.dropout_rate if dropout else 0.0,
        dropout_rng=self.make_rng('dropout') if dropout else None,
      )  # [B, T, N, H]
    out, probs = out if return_probs else (out, None)
    out = constrain(out, 'heads')
    y = nn.DenseGeneral(
      features,
      axis=(-2, -1),
      use_bias=self.use_bias,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      kernel_init=nn.with_logical_partitioning(self.out_kernel_init, ('heads', 'kv', 'embed')),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('embed',)),
      name='out',
    )(out)  # [B, T, D]
    return (y, probs) if return_probs else y

  # KV cache ----------------------------------------------------------------------------------
  def _update_cache(self, mode, k, v, self_attention, mask, positions, return_probs):
    """Writes k/v [B, T, K, H] into the 'cache' collection; returns the keys/values to attend to.

    prefill: the prompt's own k/v (self attention stores them in slots 0..T-1 of L).
    step: self attention writes its one token at slot positions[b] and returns the whole cache
    [B, L, K, H]; cross attention returns the encoder's k/v cached at prefill.
    """
    if mode.phase not in ('prefill', 'step'):
      raise ValueError(f"CacheMode.phase={mode.phase!r} must be 'prefill' or 'step'")
    if return_probs:
      raise ValueError('return_probs=True is not available while decoding with a KV cache')
    if self_attention and (mask is None or not mask.causal):
      raise ValueError('a KV cache needs causal self attention; pass a MaskSpec with causal=True')
    B, T, K, H = k.shape
    if mode.phase == 'prefill':
      if self_attention and T > mode.length:
        raise ValueError(f'a prompt of {T} tokens does not fit a cache of length={mode.length}')
      L = mode.length if self_attention else T
      pad = [(0, 0), (0, L - T), (0, 0), (0, 0)]
      for name, x in (('cached_key', k), ('cached_value', v)):  # [B, L, K, H], 0 past the prompt
        self.variable('cache', name, jnp.zeros, (B, L, K, H), x.dtype).value = jnp.pad(x, pad)
      return k, v
    if not self.has_variable('cache', 'cached_key'):
      raise ValueError("CacheMode 'step' needs the cache that a 'prefill' call filled")
    cached_k = self.variable('cache', 'cached_key')
    cached_v = self.variable('cache', 'cached_value')
    if not self_attention:  # the encoder's keys/values, computed once at prefill
      return cached_k.value, cached_v.value
    if T != 1:
      raise ValueError(f'CacheMode step takes one token per row; got {T}')
    rows, slots = jnp.arange(B), jnp.broadcast_to(positions, (B, 1))[:, 0]  # [B], [B]
    cached_k.value = cached_k.value.at[rows, slots].set(k[:, 0])  # [B, L, K, H]
    cached_v.value = cached_v.value.at[rows, slots].set(v[:, 0])
    return cached_k.value, cached_v.value

  def _attend_cache(self, q, k, v, self_attention, mask, positions, alibi_slopes):
    """'step' attention of q [B, 1, N, H] over cached k/v [B, L, K, H]."""
    scale = 1.0 / math.sqrt(self.head_dim) if self.scale is None else self.scale
    if not self_attention:  # the cross mask is top-left aligned already: [B or 1, S]
      visible = (MaskSpec() if mask is None else mask).dense(1, k.shape[1])[:, 0, 0]
      return _attend_one_step(q, k, v, visible, scale=scale)
    q_pos = jnp.broadcast_to(positions, (q.shape[0], 1))[:, 0]  # [B]
    slots = jnp.arange(k.shape[1])[None]  # [1, L]
    visible = slots <= q_pos[:, None]  # [B, L]: causal; later slots are not written yet
    if mask.window is not None:
      visible &= slots >= q_pos[:, None] - mask.window[0]
    return _attend_one_step(q, k, v, visible, scale=scale, alibi_slopes=alibi_slopes, q_pos=q_pos)
