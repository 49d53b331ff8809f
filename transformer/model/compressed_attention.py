"""Hierarchical compression, the seed's third way out of O(n^2): aggregate first, then interact
globally. Keys and values are mean-pooled over blocks of `block` positions; each query attends,
in one softmax, to the keys of its own block (causally, when causal) and to one pooled key/value
per other block (the blocks before its own, when causal). A query then sees `block` local keys
plus T / block summaries: the cost grows as T * (block + T / block), smallest at block ~ sqrt(T).

It follows the compression branch of Native Sparse Attention (Yuan et al. 2025): contiguous
blocks pooled into one key/value each, attended by every later query, with its local branch
(NSA's sliding window) taken as the query's own block. Unlike NSA it pools by a mean rather than
a learned MLP, and it joins the two branches in one softmax instead of gating two outputs.

Segments (packing, padding): a query sees a pooled block only when every key in that block
belongs to the query's own non-padding segment, so documents never mix through a summary.
Tensors are [B, T, N, H] as in attention.py; K kv heads serve G = N / K query heads each (GQA).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import Array

from transformer.kernels.masks import NEG, MaskSpec
from transformer.model.attention import default_scale, logit_scale

_F32 = jnp.float32


def check(q: Array, k: Array, v: Array, mask: MaskSpec, block: int) -> None:
  """One ValueError for shapes, a block size or a mask this attention cannot serve."""
  for name, x in (('q', q), ('k', k), ('v', v)):
    if x.ndim != 4:
      raise ValueError(f'{name} must have rank 4 [B, length, heads, head_dim]; got {x.shape}')
  if k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
    raise ValueError(
      f'compressed attention is self attention: k/v {k.shape} must be [B, T, K, H] with q '
      f'{q.shape} = [B, T, N, H]'
    )
  if q.shape[2] % k.shape[2]:
    raise ValueError(f'num_kv_heads={k.shape[2]} does not divide num_heads={q.shape[2]}')
  if isinstance(block, bool) or not isinstance(block, int) or block < 1:
    raise ValueError(f'compress_block={block!r} must be a positive integer')
  if q.shape[1] % block:
    raise ValueError(
      f'compress_block={block} does not divide the row length {q.shape[1]}; choose a divisor '
      f'of it (the cost is lowest near sqrt({q.shape[1]}) = {math.isqrt(q.shape[1])})'
    )
  if mask.window is not None:
    raise ValueError(
      f'window={mask.window} does not combine with compressed attention, whose own block is '
      'already its local window; set window=None'
    )


def pool(x: Array, block: int) -> Array:
  """[B, T, K, H] -> [B, T / block, K, H]: the mean over each block of positions (float32)."""
  B, T, K, H = x.shape
  return x.astype(_F32).reshape(B, T // block, block, K, H).mean(axis=2)


def _block_segments(kv_seg: Array, block: int) -> Array:
  """[B, T] ids -> [B, C]: a block's segment id, or 0 when its keys are not all of one id."""
  B, T = kv_seg.shape
  blocks = kv_seg.reshape(B, T // block, block)
  first = blocks[:, :, 0]
  return jnp.where(jnp.all(blocks == first[:, :, None], axis=-1), first, 0)


def compressed_attention(
  q: Array, k: Array, v: Array, *, block: int, mask: MaskSpec | None = None, scale=None
) -> Array:
  """Attention of q [B, T, N, H] over its own block's k/v and the other blocks' means.

  Args:
    block: positions per block; must divide T.
    mask: causal (own block causally, earlier blocks only) and/or segment ids; no window.
    scale: logit scale; None = 1 / sqrt(H).
  Returns:
    [B, T, N, H] in q's dtype; a query that sees no key (padding) gets 0.
  """
  mask = MaskSpec() if mask is None else mask
  check(q, k, v, mask, block)
  B, T, N, H = q.shape
  K, C, b = k.shape[2], T // block, block
  G = N // K
  scale = default_scale(H) if scale is None else scale
  # [B, C, b, K, G, H]: queries by block; [B, C, b, K, H]: the block's own keys and values.
  qb = q.astype(_F32).reshape(B, C, b, K, G, H) * scale
  kb, vb = (x.astype(_F32).reshape(B, C, b, K, H) for x in (k, v))
  kc, vc = pool(k, b), pool(v, b)  # [B, C, K, H]

  local = jnp.einsum('bcikgh,bcjkh->bckgij', qb, kb)  # [B, C, K, G, b, b]
  summary = jnp.einsum('bcikgh,bdkh->bckgid', qb, kc)  # [B, C, K, G, b, C]

  pos = jnp.arange(b)
  see_local = jnp.ones((b, b), bool) if not mask.causal else pos[None, :] <= pos[:, None]
  blocks = jnp.arange(C)
  # [C, C]: may block c read block d's summary? Causal: earlier blocks; else every other block.
  see_block = blocks[None, :] < blocks[:, None] if mask.causal else blocks[None] != blocks[:, None]
  see_local = see_local[None, None, None, None]  # [1, 1, 1, 1, b, b]
  see_summary = see_block[None, :, None, None, None, :]  # [1, C, 1, 1, 1, C]
  if mask.q_segment_ids is not None:
    q_seg = mask.q_segment_ids.reshape(B, C, b)  # [B, C, b]
    kv_seg = mask.kv_segment_ids.reshape(B, C, b)
    same = (q_seg[..., :, None] == kv_seg[..., None, :]) & (q_seg[..., :, None] != 0)
    see_local = see_local & same[:, :, None, None]  # [B, C, 1, 1, b, b]
    whole = _block_segments(mask.kv_segment_ids, b)  # [B, C]
    ok = (q_seg[..., :, None] == whole[:, None, None, :]) & (q_seg[..., :, None] != 0)
    see_summary = see_summary & ok[:, :, None, None]  # [B, C, 1, 1, b, C]

  local = jnp.where(see_local, local, NEG)
  summary = jnp.where(see_summary, summary, NEG)
  top = jnp.maximum(local.max(-1), summary.max(-1))[..., None]  # [B, C, K, G, b, 1]
  p_local = jnp.where(see_local, jnp.exp(local - top), 0.0)
  p_summary = jnp.where(see_summary, jnp.exp(summary - top), 0.0)
  den = p_local.sum(-1) + p_summary.sum(-1)  # [B, C, K, G, b]
  num = jnp.einsum('bckgij,bcjkh->bcikgh', p_local, vb) + jnp.einsum(
    'bckgid,bdkh->bcikgh', p_summary, vc
  )  # [B, C, b, K, G, H]
  den = jnp.moveaxis(den, -1, 2)[..., None]  # [B, C, b, K, G, 1]
  out = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)
  return out.reshape(B, T, N, H).astype(q.dtype)


def attend_step(q: Array, k: Array, v: Array, q_pos: Array, *, block: int, scale=None) -> Array:
  """One decoding step: q [B, 1, N, H] at positions q_pos [B] over a causal cache k/v
  [B, L, K, H] whose slots 0..q_pos are written. The same numbers as `compressed_attention` at
  that position: the written slots of the query's own block, and the means of the blocks before
  it (all complete, since they end before the query)."""
  B, L, K, H = k.shape
  N = q.shape[2]
  G, b = N // K, block
  scale = default_scale(H) if scale is None else scale
  pad = -L % b  # the cache rounded up to whole blocks; the padding sits after every query
  if pad:
    k, v = (jnp.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)]) for x in (k, v))
  kc, vc = pool(k, b), pool(v, b)  # [B, C, K, H]
  C = kc.shape[1]
  qg = q.astype(_F32).reshape(B, K, G, H) * scale
  own = q_pos // b  # [B]
  slots = jnp.arange(L + pad)[None]  # [1, L']
  see_local = (slots >= (own * b)[:, None]) & (slots <= q_pos[:, None])  # [B, L']
  see_summary = jnp.arange(C)[None] < own[:, None]  # [B, C]
  local = jnp.einsum('bkgh,blkh->bkgl', qg, k.astype(_F32))  # [B, K, G, L']
  summary = jnp.einsum('bkgh,bckh->bkgc', qg, kc)  # [B, K, G, C]
  local = jnp.where(see_local[:, None, None], local, NEG)
  summary = jnp.where(see_summary[:, None, None], summary, NEG)
  top = jnp.maximum(local.max(-1), summary.max(-1))[..., None]
  p_local = jnp.where(see_local[:, None, None], jnp.exp(local - top), 0.0)
  p_summary = jnp.where(see_summary[:, None, None], jnp.exp(summary - top), 0.0)
  num = jnp.einsum('bkgl,blkh->bkgh', p_local, v.astype(_F32))
  num = num + jnp.einsum('bkgc,bckh->bkgh', p_summary, vc)
  den = (p_local.sum(-1) + p_summary.sum(-1))[..., None]  # [B, K, G, 1]
  return (num / den).reshape(B, 1, N, H).astype(q.dtype)


# As a kind of attention.Kind: the functions MultiHeadAttention m calls (its KV cache is softmax's)
def attend(m, q, k, v, mask, alibi_slopes, self_attention, prefill, dropout, return_probs):
  """Whole blocks of self attention. A prompt being prefilled may end inside a block: it is
  padded at the end (padding segment 0), which no earlier causal query can see."""
  del alibi_slopes, dropout  # config validation refuses ALiBi and dropout here
  if return_probs:
    raise ValueError("return_probs=True needs kind='softmax': compressed attention pools keys")
  if not self_attention:
    raise ValueError("kind='compressed' pools the keys of self attention, not cross attention")
  T, block = q.shape[1], m.cfg.compress_block
  pad = -T % block if (prefill and mask is not None and mask.causal) else 0
  if pad:
    grow = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    q, k, v = grow(q), grow(k), grow(v)
    real = jnp.ones((q.shape[0], T), jnp.int32)
    segments = lambda ids: grow(real if ids is None else ids)
    mask = MaskSpec(
      causal=True,
      q_segment_ids=segments(mask.q_segment_ids),
      kv_segment_ids=segments(mask.kv_segment_ids),
    )
  return compressed_attention(q, k, v, block=block, mask=mask, scale=logit_scale(m.cfg))[:, :T]


def step(m, q, k, v, self_attention, mask, positions, alibi_slopes):
  """q [B, 1, N, H] over the self attention's cache, which holds every written key."""
  del self_attention, mask, alibi_slopes
  q_pos = jnp.broadcast_to(positions, (q.shape[0], 1))[:, 0]  # [B]
  return attend_step(q, k, v, q_pos, block=m.cfg.compress_block, scale=logit_scale(m.cfg))
