"""Pallas flash-attention kernels for TPU (Mosaic lowering): forward, dQ and dK/dV.

Inputs are `[B, N, T, H]` (heads before length, so tiles are `[block, H]`) and already padded to
whole blocks. The key-block loop is the last grid axis; blocks outside the causal/window range skip
their compute with `pl.when`, and their index maps repeat an in-range block so no DMA is issued.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from transformer.kernels import masks
from transformer.kernels.gpu import block_ranges, key_block_range, query_block_range

MASK_VALUE = -1e30  # finite, so a fully masked row never computes inf - inf
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


def _dot(a, b, dims=(((1,), (0,)), ((), ()))):
  # a @ b by default, accumulated in float32 on the MXU whatever the input dtype.
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _clamp(j, lo, hi, n):
  """Block index j clamped into [lo, hi) and [0, n): a skipped step re-uses a fetched block."""
  return jnp.clip(jnp.clip(j, lo, hi - 1), 0, n - 1)


def _visible(i, j, bq, bk, q_seg, kv_seg, **mask):
  """`masks.visible` on the `[bq, bk]` tile of query block i and key block j, or None."""
  # Positions as 2D iotas: TPU vectors are 2D tiles, so no 1D arange is broadcast here.
  q_pos = i * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)  # [bq, bk]
  k_pos = j * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)  # [bq, bk]
  return masks.visible(q_pos, k_pos, q_seg, kv_seg, **mask)  # q_seg [bq, 1], kv_seg [1, bk]


def _forward_kernel(*refs, scale, mask_kw, k_blocks, bq, bk, num_k_blocks):
  q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, o_ref, lse_ref, acc_ref, m_ref, l_ref = refs
  # Grid (B, N, query block i, key block j). The j axis runs in order on one core ('arbitrary'),
  # so the VMEM scratch acc/m/l carries the online softmax from one key block to the next.
  i, j = pl.program_id(2), pl.program_id(3)
  lo, hi = k_blocks(i)

  @pl.when(j == 0)
  def _init():
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)

  @pl.when((j >= lo) & (j < hi))
  def _step():
    s = _dot(q_ref[...], k_ref[...], _NT) * scale  # [bq, bk]
    q_seg = None if q_seg_ref is None else q_seg_ref[...]  # [bq, 1]
    kv_seg = None if kv_seg_ref is None else kv_seg_ref[...]  # [1, bk]
    mask = _visible(i, j, bq, bk, q_seg, kv_seg, **mask_kw)  # [bq, bk] or None
    if mask is not None:
      s = jnp.where(mask, s, MASK_VALUE)
    m_prev = m_ref[...]  # [bq, 1]
    # Statistics stay [bq, 1], not [bq]: a TPU vreg tile is 2D, and they broadcast over bk/H.
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [bq, 1]
    p = jnp.exp(s - m_new)  # [bq, bk]
    if mask is not None:
      p = jnp.where(mask, p, 0.0)  # a row with nothing visible yet must stay at zero weight
    alpha = jnp.exp(m_prev - m_new)  # [bq, 1], <= 1: rescales the sums to the new max
    v = v_ref[...]  # [bk, H]
    acc_ref[...] = acc_ref[...] * alpha + _dot(p.astype(v.dtype), v)  # [bq, H]
    l_ref[...] = l_ref[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
    m_ref[...] = m_new

  @pl.when(j == num_k_blocks - 1)  # the last grid step, even if it was skipped as out of range
  def _finish():
    l_sum = l_ref[...]
    seen = l_sum > 0.0
    l_safe = jnp.where(seen, l_sum, 1.0)
    o_ref[...] = (acc_ref[...] / l_safe).astype(o_ref.dtype)  # fully masked rows: 0
    # The logsumexp [bq, 1] lets the backward recompute the probabilities block by block.
    lse_ref[...] = jnp.where(seen, m_ref[...] + jnp.log(l_safe), MASK_VALUE)


def _probs(i, j, q, k, lse, q_seg_ref, kv_seg_ref, *, scale, mask_kw, bq, bk):
  """Softmax block `[bq, bk]` recomputed from the saved logsumexp `[bq, 1]`."""
  p = jnp.exp(_dot(q, k, _NT) * scale - lse)  # [bq, bk], normalised already by the saved lse
  q_seg = None if q_seg_ref is None else q_seg_ref[...]
  kv_seg = None if kv_seg_ref is None else kv_seg_ref[...]
  mask = _visible(i, j, bq, bk, q_seg, kv_seg, **mask_kw)
  return p if mask is None else jnp.where(mask, p, 0.0)


def _dq_kernel(*refs, scale, mask_kw, k_blocks, bq, bk, num_k_blocks):
  q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, do_ref, lse_ref, delta_ref, dq_ref, acc_ref = refs
  i, j = pl.program_id(2), pl.program_id(3)
  lo, hi = k_blocks(i)

  @pl.when(j == 0)
  def _init():
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when((j >= lo) & (j < hi))
  def _step():
    k, v = k_ref[...], v_ref[...]
    q, lse = q_ref[...], lse_ref[...]
    p = _probs(i, j, q, k, lse, q_seg_ref, kv_seg_ref, scale=scale, mask_kw=mask_kw, bq=bq, bk=bk)
    # Softmax backward: ds = p * (dp - delta), with delta = sum_j p dp precomputed per row.
    ds = p * (_dot(do_ref[...], v, _NT) - delta_ref[...])  # [bq, bk]
    acc_ref[...] += _dot(ds.astype(k.dtype), k)  # [bq, H]

  @pl.when(j == num_k_blocks - 1)
  def _finish():
    dq_ref[...] = (acc_ref[...] * scale).astype(dq_ref.dtype)  # d(s)/d(q) carries the scale


def _dkv_kernel(*refs, scale, mask_kw, q_blocks, bq, bk, num_q_blocks, group):
  q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, do_ref, lse_ref, delta_ref = refs[:8]
  dk_ref, dv_ref, dk_acc, dv_acc = refs[8:]
  # Grid (B, K, key block j, group member g, query block i): the last two axes are the
  # reduction, so one program's dk/dv scratch sums over all G query heads of its kv head.
  j, g, i = pl.program_id(2), pl.program_id(3), pl.program_id(4)
  lo, hi = q_blocks(j)

  @pl.when((g == 0) & (i == 0))
  def _init():
    dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
    dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

  @pl.when((i >= lo) & (i < hi))
  def _step():
    q, do = q_ref[...], do_ref[...]  # [bq, H]
    k, lse = k_ref[...], lse_ref[...]
    p = _probs(i, j, q, k, lse, q_seg_ref, kv_seg_ref, scale=scale, mask_kw=mask_kw, bq=bq, bk=bk)
    dv_acc[...] += _dot(p.astype(do.dtype), do, _TN)  # [bk, H]
    ds = p * (_dot(do, v_ref[...], _NT) - delta_ref[...])  # [bq, bk]
    dk_acc[...] += _dot(ds.astype(q.dtype), q, _TN)  # [bk, H]

  @pl.when((g == group - 1) & (i == num_q_blocks - 1))
  def _finish():
    dk_ref[...] = (dk_acc[...] * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _params(semantics):
  return pltpu.CompilerParams(dimension_semantics=semantics)


def forward(q, k, v, q_seg, kv_seg, *, scale, causal, window, kv_len, blocks, interpret):
  """q `[B, N, T, H]`, k/v `[B, K, S, H]`, q_seg `[B, T, 1]`, kv_seg `[B, 1, S]`.

  Returns `(out [B, N, T, H], lse [B, N, T, 1] float32)`.
  """
  B, N, T, H = q.shape
  K, S = k.shape[1], k.shape[2]
  bq, bk, group = blocks.block_q, blocks.block_k, N // K
  nk = S // bk  # key blocks: the innermost grid axis
  ranges = block_ranges(key_block_range, bq, bk, nk, causal, window)

  def kv_map(b, n, i, j):
    # A skipped step maps to the block already in VMEM, so Pallas issues no copy for it.
    return (b, lax.div(n, group), _clamp(j, *ranges(i), nk), 0)  # GQA: the shared kv head

  def kv_seg_map(b, n, i, j):
    return (b, 0, _clamp(j, *ranges(i), nk))

  # The same q/out block for every j: it stays in VMEM while the key blocks stream past.
  row = pl.BlockSpec((None, None, bq, H), lambda b, n, i, j: (b, n, i, 0))
  mask_kw = dict(causal=causal, window=window, kv_len=kv_len)
  kernel = functools.partial(
    _forward_kernel, scale=scale, mask_kw=mask_kw, k_blocks=ranges, bq=bq, bk=bk, num_k_blocks=nk
  )
  has_seg = q_seg is not None
  return pl.pallas_call(
    kernel,
    grid=(B, N, T // bq, nk),
    in_specs=[
      row,
      pl.BlockSpec((None, None, bk, H), kv_map),
      pl.BlockSpec((None, None, bk, H), kv_map),
      pl.BlockSpec((None, bq, 1), lambda b, n, i, j: (b, i, 0)) if has_seg else None,
      pl.BlockSpec((None, 1, bk), kv_seg_map) if has_seg else None,
    ],
    out_specs=[row, pl.BlockSpec((None, None, bq, 1), lambda b, n, i, j: (b, n, i, 0))],
    out_shape=[
      jax.ShapeDtypeStruct(q.shape, q.dtype),
      jax.ShapeDtypeStruct((B, N, T, 1), jnp.float32),
    ],
    scratch_shapes=[
      pltpu.VMEM((bq, H), jnp.float32),  # output accumulator
      pltpu.VMEM((bq, 1), jnp.float32),  # running max
      pltpu.VMEM((bq, 1), jnp.float32),  # running sum
    ],
    # The key-block axis is a sequential reduction; the others may be split across cores.
    compiler_params=_params(('parallel', 'parallel', 'parallel', 'arbitrary')),
    interpret=interpret,
    name='sparrow_flash_forward_tpu',
  )(q, k, v, q_seg, kv_seg)


def backward(
  q, k, v, q_seg, kv_seg, out, lse, do, *, scale, causal, window, kv_len, blocks, interpret
):
  """Returns `(dq, dk, dv)` shaped like `(q, k, v)`; layouts as in `forward`."""
  # delta_t = sum_h out * dout = sum_j p_tj dp_tj: the softmax backward's row term, once per row.
  delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), -1, keepdims=True)  # [B,N,T,1]
  static = dict(scale=scale, mask_kw=dict(causal=causal, window=window, kv_len=kv_len))
  args = (q, k, v, q_seg, kv_seg, do, lse, delta)
  dq = _backward_dq(*args, blocks=blocks, static=static, interpret=interpret)
  dk, dv = _backward_dkv(*args, blocks=blocks, static=static, interpret=interpret)
  return dq, dk, dv


def _backward_dq(q, k, v, q_seg, kv_seg, do, lse, delta, *, blocks, static, interpret):
  """dQ [B, N, T, H]: a grid over query blocks, reducing over key blocks."""
  B, N, T, H = q.shape
  K, S = k.shape[1], k.shape[2]
  group = N // K
  has_seg = q_seg is not None
  bq, bk = blocks.block_q_dq, blocks.block_k_dq
  nk = S // bk
  mask_kw = static['mask_kw']
  k_ranges = block_ranges(key_block_range, bq, bk, nk, mask_kw['causal'], mask_kw['window'])

  def kv_map(b, n, i, j):
    return (b, lax.div(n, group), _clamp(j, *k_ranges(i), nk), 0)

  row = pl.BlockSpec((None, None, bq, H), lambda b, n, i, j: (b, n, i, 0))
  stat = pl.BlockSpec((None, None, bq, 1), lambda b, n, i, j: (b, n, i, 0))
  kernel = functools.partial(_dq_kernel, k_blocks=k_ranges, bq=bq, bk=bk, num_k_blocks=nk, **static)
  return pl.pallas_call(
    kernel,
    grid=(B, N, T // bq, nk),
    in_specs=[
      row,
      pl.BlockSpec((None, None, bk, H), kv_map),
      pl.BlockSpec((None, None, bk, H), kv_map),
      pl.BlockSpec((None, bq, 1), lambda b, n, i, j: (b, i, 0)) if has_seg else None,
      pl.BlockSpec((None, 1, bk), lambda b, n, i, j: (b, 0, _clamp(j, *k_ranges(i), nk)))
      if has_seg
      else None,
      row,
      stat,
      stat,
    ],
    out_specs=row,
    out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
    scratch_shapes=[pltpu.VMEM((bq, H), jnp.float32)],
    compiler_params=_params(('parallel', 'parallel', 'parallel', 'arbitrary')),
    interpret=interpret,
    name='sparrow_flash_dq_tpu',
  )(q, k, v, q_seg, kv_seg, do, lse, delta)


def _backward_dkv(q, k, v, q_seg, kv_seg, do, lse, delta, *, blocks, static, interpret):
  """dK, dV [B, K, S, H]: a grid over (kv head, key block), reducing over query heads and blocks."""
  B, N, T, H = q.shape
  K, S = k.shape[1], k.shape[2]
  group = N // K
  has_seg = q_seg is not None
  bq, bk = blocks.block_q_dkv, blocks.block_k_dkv
  nq = T // bq
  mask_kw = static['mask_kw']
  q_ranges = block_ranges(query_block_range, bq, bk, nq, mask_kw['causal'], mask_kw['window'])

  def q_map(b, h, j, g, i):
    # Query head n = h * G + g reads kv head h; skipped steps reuse a fetched block.
    return (b, h * group + g, _clamp(i, *q_ranges(j), nq), 0)

  q_row = pl.BlockSpec((None, None, bq, H), q_map)
  q_stat = pl.BlockSpec((None, None, bq, 1), q_map)
  kv_row = pl.BlockSpec((None, None, bk, H), lambda b, h, j, g, i: (b, h, j, 0))
  kernel = functools.partial(
    _dkv_kernel, q_blocks=q_ranges, bq=bq, bk=bk, num_q_blocks=nq, group=group, **static
  )
  return pl.pallas_call(
    kernel,
    grid=(B, K, S // bk, group, nq),
    in_specs=[
      q_row,
      kv_row,
      kv_row,
      pl.BlockSpec((None, bq, 1), lambda b, h, j, g, i: (b, _clamp(i, *q_ranges(j), nq), 0))
      if has_seg
      else None,
      pl.BlockSpec((None, 1, bk), lambda b, h, j, g, i: (b, 0, j)) if has_seg else None,
      q_row,
      q_stat,
      q_stat,
    ],
    out_specs=[kv_row, kv_row],
    out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
    scratch_shapes=[pltpu.VMEM((bk, H), jnp.float32), pltpu.VMEM((bk, H), jnp.float32)],
    compiler_params=_params(('parallel', 'parallel', 'parallel', 'arbitrary', 'arbitrary')),
    interpret=interpret,
    name='sparrow_flash_dkv_tpu',
  )(q, k, v, q_seg, kv_seg, do, lse, delta)
