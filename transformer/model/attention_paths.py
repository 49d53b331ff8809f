"""The implementations behind `dot_product_attention` beside the dense one (attention.py):
'chunked' (flash attention in pure JAX), 'cudnn' and 'pallas' (our kernel in transformer/kernels/),
which register themselves there; and the KV cache with its one-token decoding step.

Each takes q `[B, T, N, H]`, k/v `[B, S, K, H]` and keywords (mask, scale, alibi_slopes,
chunk_size) and returns out `[B, T, N, H]`, exactly 0 on fully masked query rows.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from transformer.kernels import masks as kernel_masks
from transformer.kernels.masks import NEG, MaskSpec
from transformer.model import attention
from transformer.model.attention import logit_scale, scores, softcap_kwargs
from transformer.model.positions import alibi_bias


def _visible_keys(causal, window, q_pos, k_pos, q_seg, kv_seg, kv_len=None) -> Array:
  """bool[B or 1, 1, T, C]: may query at q_pos[t] see key at k_pos[c]? (`kernel_masks.visible`)

  q_pos `[T]`, k_pos `[C]`; q_seg `[B, T]` and kv_seg `[B, C]` (0 = padding) or both None; keys
  from kv_len on are padding added by the chunked path.
  """
  B, T, C = 1 if q_seg is None else q_seg.shape[0], q_pos.shape[0], k_pos.shape[0]
  if q_seg is not None:
    q_seg, kv_seg = q_seg[:, None, :, None], kv_seg[:, None, None, :]  # [B, 1, T, 1], [B, 1, 1, C]
  ok = kernel_masks.visible(
    q_pos[:, None], k_pos[None, :], q_seg, kv_seg, causal=causal, window=window, kv_len=kv_len
  )  # broadcastable to [B, 1, T, C], or None
  return jnp.ones((B, 1, T, C), bool) if ok is None else jnp.broadcast_to(ok, (B, 1, T, C))


class _ChunkConfig(NamedTuple):
  causal: bool
  window: tuple[int, int] | None
  scale: float
  chunk: int  # C, keys per block
  kv_len: int  # S before padding to a multiple of C
  softcap: float | None = None  # logits -> softcap * tanh(logits / softcap), or None


def _key_blocks(k, v, kv_seg, C):
  """Scan inputs: ((k, v, kv_seg) as [nC, B, C, ...], zero-padded to nC * C keys; starts [nC])."""

  def split(x):  # [B, S, ...] -> [nC, B, C, ...]
    # The padded keys are masked by kv_len in `visible`, so their zeros never reach the softmax.
    x = jnp.pad(x, [(0, 0), (0, -x.shape[1] % C)] + [(0, 0)] * (x.ndim - 2))  # [B, nC * C, ...]
    # The block axis leads, because lax.scan iterates over axis 0.
    return jnp.moveaxis(x.reshape(x.shape[0], -1, C, *x.shape[2:]), 1, 0)  # [nC, B, C, ...]

  blocks = jax.tree.map(split, (k, v, kv_seg))  # kv_seg may be None
  return blocks, jnp.arange(blocks[0].shape[0]) * C  # starts: position of each block's first key


def _chunk_logits(cfg, qg, k_c, start, q_seg, kv_seg_c, slopes):
  """Scaled, biased, masked logits of one key block: (float32[B, K, G, T, C], visible)."""
  T, K, C = qg.shape[1], qg.shape[2], k_c.shape[1]
  q_pos, k_pos = jnp.arange(T), start + jnp.arange(C)
  bias = None if slopes is None else alibi_bias(slopes, q_pos, k_pos).reshape(K, -1, T, C)
  s = scores(qg, k_c, cfg.scale, bias, softcap=cfg.softcap)  # [B, K, G, T, C]
  visible = _visible_keys(cfg.causal, cfg.window, q_pos, k_pos, q_seg, kv_seg_c, cfg.kv_len)
  visible = visible[:, :, None]  # [B or 1, 1, 1, T, C]
  return jnp.where(visible, s, NEG), visible


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
    # exp relative to the running max never overflows; the where zeroes masked keys even on a
    # row whose max so far is NEG (where exp(NEG - NEG) would be 1).
    p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)  # [B, K, G, T, C]
    # Rescales what was summed against the old max to the new one.
    corr = jnp.exp(m - m_new)  # [B, K, G, T]
    # [B, K, G, T, H]
    pv = jnp.einsum('bkgtc,bckh->bkgth', p.astype(v.dtype), v_c, preferred_element_type=jnp.float32)
    return (m_new, denom * corr + p.sum(-1), acc * corr[..., None] + pv), None

  zeros = jnp.zeros((B, K, N // K, T), jnp.float32)  # [B, K, G, T]
  # (max, denominator, accumulator [B, K, G, T, H]); the max starts at NEG, not -inf, so that
  # m - m_new stays finite (no inf - inf = NaN) on rows that have seen no key yet.
  init = (jnp.full_like(zeros, NEG), zeros, jnp.zeros((*zeros.shape, H), jnp.float32))
  (m, denom, acc), _ = jax.lax.scan(step, init, _key_blocks(k, v, kv_seg, cfg.chunk))
  seen = denom > 0  # False on fully masked rows, whose output is exactly 0
  l_safe = jnp.where(seen, denom, 1.0)
  out = jnp.where(seen[..., None], acc / l_safe[..., None], 0.0)  # [B, K, G, T, H]
  out = out.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H).astype(q.dtype)  # [B, T, N, H]
  # logsumexp of each row's logits: all the backward pass needs to recompute the probabilities.
  lse = jnp.where(seen, m + jnp.log(l_safe), 0.0)  # [B, K, G, T]
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, q_seg, kv_seg, slopes, cfg):
  return _flash_forward(q, k, v, q_seg, kv_seg, slopes, cfg)[0]


def _flash_fwd(q, k, v, q_seg, kv_seg, slopes, cfg):
  out, lse = _flash_forward(q, k, v, q_seg, kv_seg, slopes, cfg)
  # Residuals are O(T + S), never the [T, S] probabilities: the backward recomputes them.
  return out, (q, k, v, q_seg, kv_seg, slopes, out, lse)


def _flash_bwd(cfg, res, dout):
  """Recomputes each key block's probabilities from lse; dq accumulates, dk/dv per block."""
  q, k, v, q_seg, kv_seg, slopes, out, lse = res
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  qg = q.reshape(B, T, K, N // K, H)  # [B, T, K, G, H]
  dog = dout.reshape(qg.shape)  # [B, T, K, G, H]
  f32 = jnp.float32
  # D [B, K, G, T]: D_t = sum_h dout * out = sum_s p_ts dp_ts, the softmax backward's row term.
  D = jnp.einsum('btkgh,btkgh->bkgt', dog.astype(f32), out.reshape(qg.shape).astype(f32))

  def step(carry, x):
    dq, dslopes = carry
    (k_c, v_c, seg_c), start = x
    s, visible = _chunk_logits(cfg, qg, k_c, start, q_seg, seg_c, slopes)  # [B, K, G, T, C]
    p = jnp.where(visible, jnp.exp(s - lse[..., None]), 0.0)  # softmax probs of this block
    # [B, C, K, H]
    dv_c = jnp.einsum('bkgtc,btkgh->bckh', p.astype(v.dtype), dog, preferred_element_type=f32)
    dp = jnp.einsum('btkgh,bckh->bkgtc', dog, v_c, preferred_element_type=f32)  # [B, K, G, T, C]
    ds = p * (dp - D[..., None])  # d logits, [B, K, G, T, C]
    if cfg.softcap is not None:  # through the cap: d tanh(r) = 1 - tanh(r)^2, r = logits / cap
      ds = ds * jnp.where(visible, 1.0 - jnp.square(s / cfg.softcap), 0.0)
    ds_in = ds.astype(q.dtype)
    # [B, T, K, G, H]
    dq = dq + jnp.einsum('bkgtc,bckh->btkgh', ds_in, k_c, preferred_element_type=f32)
    # Summing over g folds the G query heads' gradients into their one shared kv head.
    dk_c = jnp.einsum('bkgtc,btkgh->bckh', ds_in, qg, preferred_element_type=f32)  # [B, C, K, H]
    if slopes is not None:  # d bias / d slope = -|i - j|
      k_pos = start + jnp.arange(k_c.shape[1])
      dist = jnp.abs(jnp.arange(T)[:, None] - k_pos[None, :]).astype(f32)  # [T, C]
      dslopes = dslopes - jnp.einsum('bkgtc,tc->kg', ds, dist)
    return (dq, dslopes), (dk_c * cfg.scale, dv_c)  # stacked by scan: [nC, B, C, K, H]

  init = (jnp.zeros(qg.shape, f32), None if slopes is None else jnp.zeros((K, N // K), f32))
  (dq, dslopes), (dk, dv) = jax.lax.scan(step, init, _key_blocks(k, v, kv_seg, cfg.chunk))
  dq = (dq * cfg.scale).reshape(B, T, N, H).astype(q.dtype)  # [B, T, N, H]
  # [nC, B, C, K, H] -> [B, nC * C, K, H], then drop the keys that only padded the last block.
  dk = jnp.moveaxis(dk, 0, 1).reshape(B, -1, K, H)[:, :S].astype(k.dtype)  # [B, S, K, H]
  dv = jnp.moveaxis(dv, 0, 1).reshape(B, -1, K, H)[:, :S].astype(v.dtype)  # [B, S, K, H]
  dslopes = None if slopes is None else dslopes.reshape(N).astype(slopes.dtype)
  return dq, dk, dv, None, None, dslopes  # segment ids are integers: no gradient


_flash.defvjp(_flash_fwd, _flash_bwd)


def chunked_attention(q, k, v, *, mask, scale, alibi_slopes, chunk_size=128, softcap=None):
  """Flash-attention style in pure JAX: memory O(T * chunk_size), exact custom gradient."""
  S = k.shape[1]
  # A static (hashable) config, the custom_vjp's nondiff argument; C <= S, so short inputs are
  # not padded up to a whole chunk.
  cap = None if softcap is None else float(softcap)
  cfg = _ChunkConfig(mask.causal, mask.window, float(scale), min(chunk_size, S), S, cap)
  return _flash(q, k, v, mask.q_segment_ids, mask.kv_segment_ids, alibi_slopes, cfg)


def cudnn_attention(q, k, v, *, mask, scale, alibi_slopes, chunk_size=None):
  """cuDNN fused attention through `jax.nn.dot_product_attention` (NVIDIA GPUs only)."""
  from transformer.kernels import (
    target,
  )  # the device being compiled for, not this process's backend

  del chunk_size
  where = target.current()
  if not where.nvidia:
    raise ValueError(
      f"implementation='cudnn' needs an NVIDIA GPU, but the target is {where.device_kind!r} "
      f"('{where.platform}'); use 'xla' or 'chunked' (or None to choose)"
    )
  T, S = q.shape[1], k.shape[1]
  # cuDNN applies is_causal and the window separately; with causal, its right edge is 0 anyway.
  window = None if mask.window is None else (mask.window[0], 0 if mask.causal else mask.window[1])
  segments = None  # the dense segment mask [B, 1, T, S], which cuDNN folds into its bias
  if mask.q_segment_ids is not None:
    segments = MaskSpec(q_segment_ids=mask.q_segment_ids, kv_segment_ids=mask.kv_segment_ids)
    segments = segments.dense(T, S)
  bias = None
  if alibi_slopes is not None:
    bias = alibi_bias(alibi_slopes, jnp.arange(T), jnp.arange(S))  # [N, T, S]
    bias = bias[None].astype(q.dtype)  # [1, N, T, S]
  cudnn = functools.partial(jax.nn.dot_product_attention, implementation='cudnn')
  out = cudnn(q, k, v, bias, segments, scale=scale, is_causal=mask.causal, local_window_size=window)
  # cuDNN does not promise 0 on rows with no visible key; the contract here does.
  any_visible = mask.dense(T, S).any(-1)[:, 0, :, None, None]  # [B or 1, T, 1, 1]
  return jnp.where(any_visible, out, 0).astype(q.dtype)  # fully masked rows -> exactly 0


def pallas_attention(q, k, v, *, mask, scale, alibi_slopes, chunk_size=None):
  """Our Pallas flash-attention kernel (transformer/kernels/): Mosaic GPU on Hopper (sm90+) for
  bf16/fp16 at head dims 64/128/256, Triton on other GPUs and shapes, Mosaic on TPU.

  On any other backend it runs in the Pallas interpreter: exact but slow, for tests only.
  """
  # Imported here: importing the model loads no Pallas kernel.
  from transformer.kernels import flash_attention, target

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
    interpret=not target.current().compiles_kernels,  # the compile target, not this process
  )


# KV-cache decoding: one query per row ------------------------------------------------------
def attend_one_step(
  q, k, v, visible, *, scale, alibi_slopes=None, q_pos=None, softcap=None
) -> Array:
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
  # The one query position is dropped after the logits: [B, K, G, L], query head n = k * G + g.
  bias = None
  if alibi_slopes is not None:
    bias = alibi_bias(alibi_slopes, q_pos, jnp.arange(L))  # [N, B, L]: row b's query at q_pos[b]
    bias = bias.reshape(K, N // K, B, 1, L).transpose(2, 0, 1, 3, 4)  # [B, K, G, 1, L]
  qg = q.reshape(B, 1, K, N // K, H)
  logits = scores(qg, k, scale, bias, form='step', softcap=softcap)[:, :, :, 0]
  visible = visible[:, None, None, :]  # [B or 1, 1, 1, L]
  probs = jax.nn.softmax(jnp.where(visible, logits, NEG), axis=-1)
  # A row with no visible key has uniform softmax over NEG logits; zero it so it outputs 0.
  probs = jnp.where(visible, probs, 0.0)  # [B, K, G, L]
  # [B, K, G, H]
  out = jnp.einsum('bkgl,blkh->bkgh', probs.astype(v.dtype), v, preferred_element_type=f32)
  return out.reshape(B, 1, N, H).astype(q.dtype)  # [B, 1, N, H]


def kv_cache(m, mode, k, v, self_attention, mask, positions):
  """Writes k/v [B, T, K, H] into the 'cache' collection; returns the keys/values to attend to.

  prefill: the prompt's own k/v (self attention stores them in slots 0..T-1 of L).
  step: self attention writes its one token at slot positions[b] and returns the whole cache
  [B, L, K, H]; cross attention returns the encoder's k/v cached at prefill.
  """
  del mask
  B, T, K, H = k.shape
  if mode.phase == 'prefill':
    if self_attention and T > mode.length:
      raise ValueError(f'a prompt of {T} tokens does not fit a cache of length={mode.length}')
    # Self attention gets L slots for the tokens still to come; cross attention caches the
    # encoder's S keys, which never grow (here T is S).
    L = mode.length if self_attention else T
    pad = [(0, 0), (0, L - T), (0, 0), (0, 0)]  # right-pad the length axis: T -> L
    for name, x in (('cached_key', k), ('cached_value', v)):  # [B, L, K, H], 0 past the prompt
      m.variable('cache', name, jnp.zeros, (B, L, K, H), x.dtype).value = jnp.pad(x, pad)
    return k, v  # prefill attends over the prompt only, [B, T, K, H]
  if not m.has_variable('cache', 'cached_key'):
    raise ValueError("CacheMode 'step' needs the cache that a 'prefill' call filled")
  cached_k = m.variable('cache', 'cached_key')
  cached_v = m.variable('cache', 'cached_value')
  if not self_attention:  # the encoder's keys/values, computed once at prefill
    return cached_k.value, cached_v.value
  if T != 1:
    raise ValueError(f'CacheMode step takes one token per row; got {T}')
  # Each row writes at its own position, so right-padded prompts of different lengths decode
  # in one batch without shifting any cache.
  rows, slots = jnp.arange(B), jnp.broadcast_to(positions, (B, 1))[:, 0]  # [B], [B]
  cached_k.value = cached_k.value.at[rows, slots].set(k[:, 0])  # [B, L, K, H]
  cached_v.value = cached_v.value.at[rows, slots].set(v[:, 0])  # [B, L, K, H]
  return cached_k.value, cached_v.value


def softmax_step(m, q, k, v, self_attention, mask, positions, alibi_slopes):
  """q [B, 1, N, H] over the cached k/v [B, L, K, H]."""
  kw = dict(scale=logit_scale(m.cfg), **softcap_kwargs(m.cfg))
  if not self_attention:  # the cross mask is top-left aligned already: [B or 1, S]
    visible = (MaskSpec() if mask is None else mask).dense(1, k.shape[1])[:, 0, 0]
    return attend_one_step(q, k, v, visible, **kw)
  q_pos = jnp.broadcast_to(positions, (q.shape[0], 1))[:, 0]  # [B]
  slots = jnp.arange(k.shape[1])[None]  # [1, L]
  # Row b's query sits at q_pos[b]; causal, as later slots are not written yet.
  visible = kernel_masks.visible(
    q_pos[:, None], slots, None, None, causal=True, window=mask.window
  )  # [B, L]
  return attend_one_step(q, k, v, visible, alibi_slopes=alibi_slopes, q_pos=q_pos, **kw)


# The blocked paths and the cuDNN kernel, beside the dense one that attention.py writes.
for _name, _fn in (('chunked', chunked_attention), ('pallas', pallas_attention),
                   ('cudnn', cudnn_attention)):  # fmt: skip
  attention.register_implementation(_name, _fn)
