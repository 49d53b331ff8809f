"""Pallas flash-attention kernels for GPU (Triton lowering): forward, dQ and dK/dV.

Inputs here are already padded: lengths to block multiples, head dim to a power of two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from transformer.kernels import masks

Array = jax.Array
MASK_VALUE = -1e30  # finite, so a fully masked row never computes inf - inf


def key_block_range(
  q_block,
  *,
  block_q: int,
  block_k: int,
  num_k_blocks: int,
  causal: bool,
  window: tuple[int, int] | None,
):
  """Key blocks `[lo, hi)` that query block `q_block` must visit; blocks outside are skipped.

  Works on Python ints and on traced int32 scalars (e.g. `pl.program_id`).
  """
  first_q = q_block * block_q
  last_q = first_q + block_q - 1
  lo, hi = 0, num_k_blocks
  if window is not None:
    left, right = window
    # The block's first query sees back to first_q - left, its last forward to last_q + right.
    lo = lax.div(jnp.maximum(first_q - left, 0), block_k)
    hi = jnp.minimum(hi, lax.div(last_q + right, block_k) + 1)
  if causal:
    hi = jnp.minimum(hi, lax.div(last_q, block_k) + 1)  # key j <= query i
  return lo, hi


def query_block_range(
  k_block,
  *,
  block_q: int,
  block_k: int,
  num_q_blocks: int,
  causal: bool,
  window: tuple[int, int] | None,
):
  """Query blocks `[lo, hi)` that can see key block `k_block` (the dK/dV loop bounds)."""
  first_k = k_block * block_k
  last_k = first_k + block_k - 1
  lo, hi = 0, num_q_blocks
  if causal:
    lo = lax.div(first_k, block_q)  # query i >= key j
  if window is not None:
    left, right = window
    # The mirror of key_block_range: key j is seen by queries j - right .. j + left.
    lo = jnp.maximum(lo, lax.div(jnp.maximum(first_k - right, 0), block_q))
    hi = jnp.minimum(hi, lax.div(last_k + left, block_q) + 1)
  return lo, hi


def block_ranges(ranges, block_q, block_k, num_blocks, causal, window):
  """`key_block_range` or `query_block_range` of one kernel's tiles, as a function of the block."""
  count = 'num_k_blocks' if ranges is key_block_range else 'num_q_blocks'
  fixed = dict(block_q=block_q, block_k=block_k, causal=causal, window=window)
  return functools.partial(ranges, **fixed, **{count: num_blocks})


def _visible(q_pos, k_pos, q_seg, kv_seg, **mask):
  """`masks.visible` on a `[bq, bk]` tile, from positions `[bq]`, `[bk]` and segment ids alike."""
  if q_seg is not None:
    q_seg, kv_seg = q_seg[:, None], kv_seg[None, :]  # [bq, 1], [1, bk]
  return masks.visible(q_pos[:, None], k_pos[None, :], q_seg, kv_seg, **mask)  # or None


def _dot(a, b, trans_b=False):
  """Matmul with float32 accumulation; `trans_b` contracts the last dims of both."""
  # float32 accumulation even for bfloat16 inputs: sums over H or a key block lose digits.
  dims = (((1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _forward_kernel(*refs, scale, mask_kw, k_blocks, bq, bk):
  q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, o_ref, lse_ref = refs
  # One program per (batch, query head, query block); its refs are that slice: q [bq, H], and all
  # S keys [S, H] of the kv head this query head reads (see the BlockSpecs in `forward`).
  # mask_kw: causal, window and kv_len for `masks.visible`; k_blocks: `key_block_range` of a block.
  q_block = pl.program_id(2)
  q = q_ref[...]  # [bq, H]
  q_pos = q_block * bq + jnp.arange(bq)  # [bq]
  q_seg = None if q_seg_ref is None else q_seg_ref[...]  # [bq]

  def body(kb, carry):
    acc, m, l_sum = carry  # [bq, H], [bq], [bq]
    ks = pl.ds(kb * bk, bk)
    k, v = k_ref[ks, :], v_ref[ks, :]  # [bk, H]
    s = _dot(q, k, trans_b=True) * scale  # [bq, bk]
    kv_seg = None if kv_seg_ref is None else kv_seg_ref[ks]  # [bk]
    mask = _visible(q_pos, kb * bk + jnp.arange(bk), q_seg, kv_seg, **mask_kw)  # [bq, bk] or None
    if mask is not None:
      s = jnp.where(mask, s, MASK_VALUE)
    # Online softmax: keep a running max m and rescale the sums so far when it grows.
    m_new = jnp.maximum(m, jnp.max(s, axis=1))  # [bq]
    p = jnp.exp(s - m_new[:, None])  # [bq, bk]
    if mask is not None:
      p = jnp.where(mask, p, 0.0)  # a row with nothing visible yet must stay at zero weight
    alpha = jnp.exp(m - m_new)  # [bq], <= 1: rescales acc and l_sum to the new max
    acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)  # [bq, H]
    return acc, m_new, l_sum * alpha + jnp.sum(p, axis=1)

  lo, hi = k_blocks(q_block)
  # (acc [bq, H], running max [bq], denominator [bq]); the max starts finite, see MASK_VALUE.
  init = (
    jnp.zeros(q.shape, jnp.float32),
    jnp.full((bq,), MASK_VALUE, jnp.float32),
    jnp.zeros((bq,), jnp.float32),
  )
  # Only the key blocks that a causal/window mask can leave visible: the rest are never read.
  acc, m, l_sum = lax.fori_loop(lo, hi, body, init)
  seen = l_sum > 0.0  # [bq]: False on rows that saw no key
  l_safe = jnp.where(seen, l_sum, 1.0)
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)  # fully masked rows: 0
  # The logsumexp [bq] is all the backward needs to rebuild the probabilities. On empty rows
  # every key is masked, so _probs zeroes whatever exp(s - MASK_VALUE) gives there.
  lse_ref[...] = jnp.where(seen, m + jnp.log(l_safe), MASK_VALUE)


def _probs(q, k, lse, q_pos, k_pos, q_seg, kv_seg, *, scale, mask_kw):
  """Recompute the softmax block `[bq, bk]` from the saved logsumexp."""
  s = _dot(q, k, trans_b=True) * scale  # [bq, bk]
  p = jnp.exp(s - lse[:, None])  # already normalised: lse = log of the row's softmax sum
  mask = _visible(q_pos, k_pos, q_seg, kv_seg, **mask_kw)
  return p if mask is None else jnp.where(mask, p, 0.0)


def _dq_kernel(*refs, scale, mask_kw, k_blocks, bq, bk):
  q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, do_ref, lse_ref, delta_ref, dq_ref = refs
  q_block = pl.program_id(2)
  q, do = q_ref[...], do_ref[...]  # [bq, H]
  lse, delta = lse_ref[...], delta_ref[...]  # [bq]
  q_pos = q_block * bq + jnp.arange(bq)
  q_seg = None if q_seg_ref is None else q_seg_ref[...]

  def body(kb, dq):
    ks = pl.ds(kb * bk, bk)
    k, v = k_ref[ks, :], v_ref[ks, :]  # [bk, H]
    kv_seg = None if kv_seg_ref is None else kv_seg_ref[ks]
    k_pos = kb * bk + jnp.arange(bk)
    p = _probs(q, k, lse, q_pos, k_pos, q_seg, kv_seg, scale=scale, mask_kw=mask_kw)  # [bq, bk]
    dp = _dot(do, v, trans_b=True)  # [bq, bk]
    # Softmax backward: ds = p * (dp - sum_j p dp), with that row sum precomputed as delta.
    ds = p * (dp - delta[:, None])  # [bq, bk]
    return dq + _dot(ds.astype(k.dtype), k)  # [bq, H]

  lo, hi = k_blocks(q_block)
  dq = lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))  # [bq, H]
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)  # d(s)/d(q) carries the logit scale


def _dkv_kernel(*refs, scale, mask_kw, q_blocks, bq, bk, group):
  q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs
  # One program per (batch, kv head, key block): it owns dk/dv of those keys, so no two programs
  # write the same output and no atomics are needed; it loops over the query blocks instead.
  k_block = pl.program_id(2)
  k, v = k_ref[...], v_ref[...]  # [bk, H]
  k_pos = k_block * bk + jnp.arange(bk)  # [bk]
  kv_seg = None if kv_seg_ref is None else kv_seg_ref[...]
  lo, hi = q_blocks(k_block)
  dk = jnp.zeros(k.shape, jnp.float32)
  dv = jnp.zeros(v.shape, jnp.float32)
  for g in range(group):  # the query heads that share this kv head (GQA), unrolled

    def body(qb, carry, g=g):
      dk, dv = carry
      qs = pl.ds(qb * bq, bq)
      q, do = q_ref[qs, g, :], do_ref[qs, g, :]  # [bq, H]
      lse, delta = lse_ref[g, qs], delta_ref[g, qs]  # [bq]
      q_seg = None if q_seg_ref is None else q_seg_ref[qs]
      q_pos = qb * bq + jnp.arange(bq)
      p = _probs(q, k, lse, q_pos, k_pos, q_seg, kv_seg, scale=scale, mask_kw=mask_kw)
      dv = dv + _dot(p.T.astype(do.dtype), do)  # [bk, H]
      ds = p * (_dot(do, v, trans_b=True) - delta[:, None])  # [bq, bk]
      dk = dk + _dot(ds.T.astype(q.dtype), q)  # [bk, H]
      return dk, dv

    dk, dv = lax.fori_loop(lo, hi, body, (dk, dv))
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _params(head_dim: int, num_warps: int | None, num_stages: int):
  # Default: more warps for wider heads, whose [bq, H] tiles need more threads.
  warps = num_warps or (4 if head_dim <= 64 else 8)
  return plgpu.CompilerParams(num_warps=warps, num_stages=num_stages)


def forward(q, k, v, q_seg, kv_seg, *, scale, causal, window, kv_len, blocks, interpret):
  """Returns `(out [B, T, N, H], lse [B, N, T] float32)` for padded inputs."""
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  bq, bk, group = blocks.block_q, blocks.block_k, N // K
  mask_kw = dict(causal=causal, window=window, kv_len=kv_len)
  k_blocks = block_ranges(key_block_range, bq, bk, S // bk, causal, window)
  kernel = functools.partial(
    _forward_kernel, scale=scale, mask_kw=mask_kw, k_blocks=k_blocks, bq=bq, bk=bk
  )
  has_seg = q_seg is not None
  # Grid (B, N, T / bq); a None block dim is squeezed out, so the kernel sees [bq, H] and [S, H].
  row = pl.BlockSpec((None, bq, None, H), lambda b, n, i: (b, i, n, 0))
  kv_all = pl.BlockSpec((None, S, None, H), lambda b, n, i: (b, 0, lax.div(n, group), 0))  # GQA
  return pl.pallas_call(
    kernel,
    grid=(B, N, T // bq),
    in_specs=[
      row,
      kv_all,
      kv_all,
      pl.BlockSpec((None, bq), lambda b, n, i: (b, i)) if has_seg else None,
      pl.BlockSpec((None, S), lambda b, n, i: (b, 0)) if has_seg else None,
    ],
    out_specs=[row, pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i))],
    out_shape=[
      jax.ShapeDtypeStruct(q.shape, q.dtype),
      jax.ShapeDtypeStruct((B, N, T), jnp.float32),
    ],
    compiler_params=_params(H, blocks.num_warps, blocks.num_stages),
    interpret=interpret,
    name='sparrow_flash_forward',
  )(q, k, v, q_seg, kv_seg)


def backward(
  q, k, v, q_seg, kv_seg, out, lse, do, *, scale, causal, window, kv_len, blocks, interpret
):
  """Returns `(dq, dk, dv)` shaped like `(q, k, v)` for padded inputs."""
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  group = N // K
  has_seg = q_seg is not None
  # delta_t = sum_h out * dout = sum_j p_tj dp_tj: the softmax backward's row term, once per row.
  delta = jnp.einsum('btnh,btnh->bnt', out.astype(jnp.float32), do.astype(jnp.float32))  # [B,N,T]
  static = dict(scale=scale, mask_kw=dict(causal=causal, window=window, kv_len=kv_len))
  params = _params(H, blocks.num_warps, blocks.num_stages)

  # dQ: one program per (batch, query head, query block), looping over key blocks.
  bq, bk = blocks.block_q_dq, blocks.block_k_dq
  k_blocks = block_ranges(key_block_range, bq, bk, S // bk, causal, window)
  row = pl.BlockSpec((None, bq, None, H), lambda b, n, i: (b, i, n, 0))
  kv_all = pl.BlockSpec((None, S, None, H), lambda b, n, i: (b, 0, lax.div(n, group), 0))
  stat = pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i))
  dq = pl.pallas_call(
    functools.partial(_dq_kernel, k_blocks=k_blocks, bq=bq, bk=bk, **static),
    grid=(B, N, T // bq),
    in_specs=[
      row,
      kv_all,
      kv_all,
      pl.BlockSpec((None, bq), lambda b, n, i: (b, i)) if has_seg else None,
      pl.BlockSpec((None, S), lambda b, n, i: (b, 0)) if has_seg else None,
      row,
      stat,
      stat,
    ],
    out_specs=row,
    out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
    compiler_params=params,
    interpret=interpret,
    name='sparrow_flash_dq',
  )(q, k, v, q_seg, kv_seg, do, lse, delta)

  # dK/dV: one program per (batch, kv head, key block), looping over the G query heads of the
  # group and their query blocks; queries arrive as [T, G, H].
  bq, bk = blocks.block_q_dkv, blocks.block_k_dkv
  q_blocks = block_ranges(query_block_range, bq, bk, T // bq, causal, window)
  q_group = pl.BlockSpec((None, T, group, H), lambda b, h, j: (b, 0, h, 0))  # all heads of a group
  stat_group = pl.BlockSpec((None, group, T), lambda b, h, j: (b, h, 0))
  kv_row = pl.BlockSpec((None, bk, None, H), lambda b, h, j: (b, j, h, 0))
  dk, dv = pl.pallas_call(
    functools.partial(_dkv_kernel, q_blocks=q_blocks, bq=bq, bk=bk, group=group, **static),
    grid=(B, K, S // bk),
    in_specs=[
      q_group,
      kv_row,
      kv_row,
      pl.BlockSpec((None, T), lambda b, h, j: (b, 0)) if has_seg else None,
      pl.BlockSpec((None, bk), lambda b, h, j: (b, j)) if has_seg else None,
      q_group,
      stat_group,
      stat_group,
    ],
    out_specs=[kv_row, kv_row],
    out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
    compiler_params=params,
    interpret=interpret,
    name='sparrow_flash_dkv',
  )(q, k, v, q_seg, kv_seg, do, lse, delta)
  return dq, dk, dv
