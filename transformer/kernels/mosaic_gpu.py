"""Pallas Mosaic GPU flash attention for Hopper (sm90+): forward, dQ and dK/dV, warp-specialised.

Each CTA runs one or two compute warpgroups (64 rows each, wgmma) and one memory warpgroup that
feeds them through a TMA ring. `interpret=True` runs the same kernels in Pallas's GPU interpreter,
one XLA:CPU computation per warpgroup, which wait for each other: on fewer than 4 cores set
PJRT_NPROC=8 (XLA:CPU's thread pool size) before JAX starts, or a kernel can hang for good.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from transformer.kernels import masks
from transformer.kernels.gpu import key_block_range, query_block_range

Array = jax.Array
HEAD_DIMS = (64, 128, 256)
DTYPES = ('bfloat16', 'float16')
ROWS = 64  # rows per compute warpgroup: the M of one wgmma
# Compute warpgroups per CTA (a further one issues the TMA copies), by kernel and head dim.
# Every thread of a CTA gets the same registers, 65536 / threads: 168 with two compute warpgroups
# (384 threads), 255 with one (256). Hopper's setmaxnreg could move the memory warpgroup's share
# to the compute ones, but JAX's pip builds link Mosaic GPU kernels with nvJitLink, which compiles
# PTX as a separate compilation unit, where ptxas ignores it ("C7504: 'setmaxnreg' ignored to
# maintain compatibility across compilation units"), so the kernels do not use it. Two warpgroups
# share each streamed block where their tiles fit 168 registers without spilling; elsewhere one
# warpgroup gets 255 (`python -m experiments.gpu_check --deviceless` shows each kernel's report).
# dK/dV always runs one: its two [64, H] float32 accumulators spilled in 168 registers at every H.
COMPUTE_WGS = {
  # kernel: {head_dim: warpgroups}
  'forward': {64: 2, 128: 1, 256: 1},
  'dq': {64: 2, 128: 1, 256: 1},
}
LOG2E = math.log2(math.e)
MASK_VALUE = -1e30  # finite: a fully masked row never computes inf - inf
EMPTY_LSE = 1e30  # logsumexp of a row that sees no key: exp2(s - EMPTY_LSE) == 0 in backward
_LOAD_TAKES_INDEX = 'idx' in inspect.signature(plgpu.load).parameters  # jax < 0.11


def interpret_params():
  """The GPU interpreter's parameters (public in jax >= 0.11, private before)."""
  params = getattr(plgpu, 'InterpretGPUParams', None)
  if params is None:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
  return params()


# --- The few places where the interpreter needs another spelling of the same operation. ---
# Pallas's GPU interpreter runs TMA, barriers and warpgroups, but not wgmma on transposed or
# accumulator refs, nor layout casts. Everything else below is one code path for both.


def _scores(a_ref, b_ref, shape, interpret):
  """`a @ b.T` in float32 `[M, N]` from two SMEM tiles `[M, D]` and `[N, D]`."""
  if interpret:
    dims = (((1,), (1,)), ((), ()))
    return lax.dot_general(a_ref[...], b_ref[...], dims, preferred_element_type=jnp.float32)

  def body(acc_ref):
    plgpu.wgmma(acc_ref, a_ref, b_ref.transpose((1, 0)))
    return acc_ref[...]

  return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def _accumulate(acc, a, b_ref, interpret):
  """`acc + a @ b`: acc float32 `[M, N]`, a 16-bit registers `[M, K]`, b an SMEM tile `[K, N]`."""
  if interpret:
    dims = (((1,), (0,)), ((), ()))
    return acc + lax.dot_general(a, b_ref[...], dims, preferred_element_type=jnp.float32)

  def body(acc_ref):
    plgpu.wgmma(acc_ref, a, b_ref)

  return pl.run_state(body)(plgpu.ACC.init(acc))


def _filled(shape, value, interpret, reduce_axis=None):
  """A float32 constant in the wgmma register layout (or that layout reduced along an axis)."""
  x = jnp.full(shape, value, jnp.float32)
  if interpret:
    return x
  layout = plgpu.Layout.WGMMA if reduce_axis is None else plgpu.Layout.WGMMA.reduce(reduce_axis)
  return plgpu.layout_cast(x, layout)


def _iota(shape, dim, interpret):
  if interpret:
    return lax.broadcasted_iota(jnp.int32, shape, dim)
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _iota_vector(shape, dim, interpret):
  """0, 1, ... along `dim` of a wgmma tile `shape`, as the tile's row (dim 0) or column vector."""
  if interpret:
    return lax.iota(jnp.int32, shape[dim])
  layout = plgpu.Layout.WGMMA.reduce(1 - dim)
  return plgpu.broadcasted_iota(jnp.int32, (shape[dim],), 0, layout=layout)


def _load_vector(ref, reduce_axis, interpret):
  """An SMEM vector as the per-row (reduce_axis=1) or per-column (0) slice of a wgmma tile."""
  if interpret:
    return ref[...]
  layout = plgpu.Layout.WGMMA.reduce(reduce_axis)
  return plgpu.load(ref, (), layout=layout) if _LOAD_TAKES_INDEX else plgpu.load(ref, layout=layout)


# --- Tile code shared by the three kernels. ---


def _visible(shape, q_first, k_first, q_seg, kv_seg, cfg, *, keys_on_rows=False):
  """`masks.visible` on a `[rows, cols]` score tile, or None when every key is visible.

  Rows are queries and columns keys, or the reverse when `keys_on_rows` (the dK/dV kernel).
  """
  q_dim, k_dim = (1, 0) if keys_on_rows else (0, 1)
  q_pos = k_pos = None  # read by the rule only for causal, window and kv_len
  if cfg.causal or cfg.window is not None:
    # Positions as a per-row and a per-column vector, broadcast where compared: a thread holds
    # 2 rows and 16 columns of a [64, 64] tile, so that is 18 values instead of two 32-value
    # tiles, which the dK/dV kernel at head dim 128 cannot keep beside its accumulators.
    q_pos = q_first + _iota_vector(shape, q_dim, cfg.interpret)
    k_pos = k_first + _iota_vector(shape, k_dim, cfg.interpret)
    q_pos = lax.broadcast_in_dim(q_pos, shape, [q_dim])
    k_pos = lax.broadcast_in_dim(k_pos, shape, [k_dim])
  elif cfg.kv_len is not None:
    # The padded-tail condition alone keeps whole tiles: Mosaic GPU's layout inference (jax 0.12)
    # finds no layout for a broadcast vector compared just once.
    q_pos = q_first + _iota(shape, q_dim, cfg.interpret)
    k_pos = k_first + _iota(shape, k_dim, cfg.interpret)
  if q_seg is not None:
    q_seg = lax.broadcast_in_dim(q_seg, shape, [q_dim])
    kv_seg = lax.broadcast_in_dim(kv_seg, shape, [k_dim])
  return masks.visible(q_pos, k_pos, q_seg, kv_seg, **cfg.mask_kw())


def _softmax_step(carry, s, mask, v_s, dtype, interpret):
  """One online-softmax update with a scaled (base-2) score tile `s` `[bq, bk]`."""
  acc, m, l_sum = carry  # [bq, H], [bq], [bq]
  if mask is not None:
    s = jnp.where(mask, s, MASK_VALUE)
  m_new = jnp.maximum(m, s.max(axis=1))
  alpha = jnp.exp2(m - m_new)
  p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))  # [bq, bk]
  if mask is not None:
    p = jnp.where(mask, p, 0.0)  # a row with nothing visible yet stays at zero weight
  l_sum = l_sum * alpha + p.sum(axis=1)
  acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
  return _accumulate(acc, p.astype(dtype), v_s, interpret), m_new, l_sum


def _key_range(q_block, *, block_q, block_k, num_k_blocks, causal, window, kv_len):
  """Key blocks `[lo, hi)` a query block visits: causal, window and unpadded-length bounds."""
  ranges = dict(block_q=block_q, block_k=block_k, num_k_blocks=num_k_blocks)
  lo, hi = key_block_range(q_block, **ranges, causal=causal, window=window)
  if kv_len is not None:
    hi = jnp.minimum(hi, -(-kv_len // block_k))  # blocks wholly in the padded tail
  return jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)


def _own_range(union, own):
  """A warpgroup's block range clipped into its CTA's (the union), and never reversed."""
  lo = jnp.clip(own[0], union[0], union[1])
  return lo, jnp.clip(own[1], lo, union[1])


def _stream(union, own, step, skip, carry):
  """Runs `step(j, carry)` on blocks `own` of the stream `union`, `skip(j)` on the others.

  Skipped blocks are waited for and released unread, so the compute warpgroups observe every
  barrier phase in order while the memory warpgroup streams the whole union.
  """

  def skip_body(j, c):
    skip(j)
    return c

  carry = lax.fori_loop(union[0], own[0], skip_body, carry)
  carry = lax.fori_loop(own[0], own[1], step, carry)
  return lax.fori_loop(own[1], union[1], skip_body, carry)


class _Ring:
  """A TMA ring of `depth` slots fed by the memory warpgroup and drained by compute ones."""

  def __init__(self, buffers, ready, consumed, depth):
    self.buffers, self.ready, self.consumed, self.depth = buffers, ready, consumed, depth

  def slot(self, t):
    return lax.rem(t, jnp.int32(self.depth))

  def feed(self, num_steps, sources):
    """Memory warpgroup: for step t, copies `sources(t)` (GMEM refs) into slot t % depth."""

    def load(t, _):
      slot = self.slot(t)

      @pl.when(t >= self.depth)
      def _():
        plgpu.barrier_wait(self.consumed.at[slot])  # the slot's previous block was released

      for src, buf, bar in zip(sources(t), self.buffers, self.ready):
        if buf is not None:
          plgpu.copy_gmem_to_smem(src, buf.at[slot], bar.at[slot])
      return _

    lax.fori_loop(0, num_steps, load, None)
    # Observe the releases of the last blocks too, so the ring ends with no phase pending.
    lax.fori_loop(
      jnp.maximum(num_steps - self.depth, 0),
      num_steps,
      lambda t, c: (plgpu.barrier_wait(self.consumed.at[self.slot(t)]), c)[1],
      None,
    )

  def wait(self, t):
    """Compute warpgroup: waits for step t's copies and returns the slot's tiles."""
    slot = self.slot(t)
    for buf, bar in zip(self.buffers, self.ready):
      if buf is not None:
        plgpu.barrier_wait(bar.at[slot])
    return [None if buf is None else buf.at[slot] for buf in self.buffers]

  def release(self, t):
    plgpu.barrier_arrive(self.consumed.at[self.slot(t)])

  def skip(self, t):
    self.wait(t)
    self.release(t)


def _smem(shape, dtype, tiled):
  if not tiled:
    return plgpu.SMEM(shape, dtype)
  transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  return plgpu.SMEM(shape, dtype, transforms=transforms)


def _barriers(n, arrivals=1):
  return plgpu.Barrier(num_arrivals=arrivals, num_barriers=n)


def _launch(kernel, operands, out_type, scratch, grid, grid_names, interpret, name, wgs):
  """Runs `kernel(*operand and output refs, scratch refs as one tuple)` on `grid`."""

  def body(*refs):
    return kernel(*refs[: -len(scratch)], tuple(refs[-len(scratch) :]))

  return plgpu.kernel(
    body,
    out_type=out_type,
    scratch_types=scratch,
    grid=grid,
    grid_names=grid_names,
    num_threads=wgs + 1,
    thread_name='wg',
    compiler_params=plgpu.CompilerParams(approx_math=True),
    interpret=interpret_params() if interpret else None,
    kernel_name=name,
  )(*operands)


def _compute_wg(fn, wgs):
  """Runs `fn(wg)` on the `wgs` compute warpgroups."""
  wg = lax.axis_index('wg')

  @pl.when(wg < wgs)
  def _():
    fn(wg)


def _memory_wg(fn, wgs):
  @pl.when(lax.axis_index('wg') == wgs)
  def _():
    fn()


def compute_wgs(kernel: str, head_dim: int) -> int:
  """Compute warpgroups per CTA of `kernel` ('forward' or 'dq') at `head_dim`."""
  return COMPUTE_WGS[kernel][head_dim]


class _Static(NamedTuple):
  """Static settings the kernels close over."""

  scale: float
  causal: bool
  window: tuple[int, int] | None
  kv_len: int | None
  interpret: bool
  dtype: jnp.dtype
  head_dim: int

  def mask_kw(self):
    return dict(causal=self.causal, window=self.window, kv_len=self.kv_len)


# --- Forward: each CTA owns 2 x bq query rows of one head; keys stream through the ring. ---


def _feed_keys(ring, union, bk, b, kv_head, k_ref, v_ref, kv_seg_ref):
  """Memory warpgroup of the forward and dQ kernels: key blocks `union` of one kv head."""

  def sources(t):
    keys = pl.ds((union[0] + t) * bk, bk)
    seg = None if kv_seg_ref is None else kv_seg_ref.at[b, keys]
    return k_ref.at[b, keys, kv_head], v_ref.at[b, keys, kv_head], seg

  ring.feed(union[1] - union[0], sources)


def _forward_kernel(*refs, cfg, bq, bk, depth, group, has_seg, wgs):
  q_ref, k_ref, v_ref = refs[:3]
  q_seg_ref, kv_seg_ref = refs[3:5] if has_seg else (None, None)
  o_ref, lse_ref, scratch = refs[-3], refs[-2], refs[-1]
  q_s, q_seg_s, lse_s, k_s, v_s, kv_seg_s, q_bar, ready, consumed = scratch
  b, n, i = lax.axis_index('batch'), lax.axis_index('heads'), lax.axis_index('q_tiles')
  kv_head = lax.div(n, jnp.int32(group))
  num_k_blocks = k_ref.shape[1] // bk
  ranges = functools.partial(_key_range, block_k=bk, num_k_blocks=num_k_blocks, **cfg.mask_kw())
  union = ranges(i, block_q=wgs * bq)
  ring = _Ring((k_s, v_s, kv_seg_s), ready, consumed, depth)

  def compute(wg):
    q_first = (i * wgs + wg) * bq
    rows = pl.ds(q_first, bq)
    plgpu.copy_gmem_to_smem(q_ref.at[b, rows, n], q_s.at[wg], q_bar.at[wg])
    if has_seg:
      plgpu.copy_gmem_to_smem(q_seg_ref.at[b, rows], q_seg_s.at[wg], q_bar.at[wgs + wg])
      plgpu.barrier_wait(q_bar.at[wgs + wg])
    plgpu.barrier_wait(q_bar.at[wg])
    q_seg = _load_vector(q_seg_s.at[wg], 1, cfg.interpret) if has_seg else None
    own = _own_range(union, ranges(i * wgs + wg, block_q=bq))

    def step(j, carry):
      t = j - union[0]
      k_tile, v_tile, seg_tile = ring.wait(t)
      s = _scores(q_s.at[wg], k_tile, (bq, bk), cfg.interpret) * (cfg.scale * LOG2E)
      kv_seg = _load_vector(seg_tile, 0, cfg.interpret) if has_seg else None
      mask = _visible((bq, bk), q_first, j * bk, q_seg, kv_seg, cfg)
      carry = _softmax_step(carry, s, mask, v_tile, cfg.dtype, cfg.interpret)
      ring.release(t)
      return carry

    init = (
      _filled((bq, cfg.head_dim), 0.0, cfg.interpret),
      _filled((bq,), MASK_VALUE, cfg.interpret, reduce_axis=1),
      _filled((bq,), 0.0, cfg.interpret, reduce_axis=1),
    )
    acc, m, l_sum = _stream(union, own, step, lambda j: ring.skip(j - union[0]), init)
    seen = l_sum > 0.0
    l_safe = jnp.where(seen, l_sum, 1.0)
    q_s.at[wg][...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(cfg.dtype)
    lse_s.at[wg][...] = jnp.where(seen, m + jnp.log2(l_safe), EMPTY_LSE)  # base 2
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_s.at[wg], o_ref.at[b, rows, n])
    plgpu.copy_smem_to_gmem(lse_s.at[wg], lse_ref.at[b, n, rows])
    plgpu.wait_smem_to_gmem(0)

  _compute_wg(compute, wgs)
  _memory_wg(lambda: _feed_keys(ring, union, bk, b, kv_head, k_ref, v_ref, kv_seg_ref), wgs)


def forward(q, k, v, q_seg, kv_seg, *, scale, causal, window, kv_len, blocks, interpret):
  """Returns `(out [B, T, N, H], lse [B, N, T] float32, base 2)` for padded inputs."""
  B, T, N, H = q.shape
  K = k.shape[2]
  bq, bk, depth = blocks.block_q, blocks.block_k, max(2, blocks.num_stages)
  cfg = _Static(scale, causal, window, kv_len, interpret, q.dtype, H)
  has_seg = q_seg is not None
  W = compute_wgs('forward', H)
  scratch = (
    _smem((W, bq, H), q.dtype, True),  # q, then the output
    _smem((W, bq), jnp.int32, False) if has_seg else None,
    _smem((W, bq), jnp.float32, False),  # lse
    _smem((depth, bk, H), k.dtype, True),
    _smem((depth, bk, H), v.dtype, True),
    _smem((depth, bk), jnp.int32, False) if has_seg else None,
    _barriers(2 * W),  # q (and q segment ids) per warpgroup
    (_barriers(depth), _barriers(depth), _barriers(depth) if has_seg else None),
    _barriers(depth, arrivals=W),  # released by every compute warpgroup
  )
  kernel = functools.partial(
    _forward_kernel, cfg=cfg, bq=bq, bk=bk, depth=depth, group=N // K, has_seg=has_seg, wgs=W
  )
  operands = (q, k, v, q_seg, kv_seg) if has_seg else (q, k, v)
  out_type = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, N, T), jnp.float32))
  grid, grid_names = (B, N, T // (W * bq)), ('batch', 'heads', 'q_tiles')
  name = 'sparrow_mgpu_forward'
  return _launch(kernel, operands, out_type, scratch, grid, grid_names, interpret, name, W)


# --- dQ: like the forward, 2 x bq query rows per CTA, keys and values stream through the ring. ---


def _dq_kernel(*refs, cfg, bq, bk, depth, group, has_seg, wgs):
  q_ref, k_ref, v_ref = refs[:3]
  q_seg_ref, kv_seg_ref = refs[3:5] if has_seg else (None, None)
  do_ref, lse_ref, delta_ref = refs[5:8] if has_seg else refs[3:6]
  dq_ref, scratch = refs[-2], refs[-1]
  q_s, do_s, q_seg_s, lse_s, delta_s, k_s, v_s, kv_seg_s, q_bar, ready, consumed = scratch
  b, n, i = lax.axis_index('batch'), lax.axis_index('heads'), lax.axis_index('q_tiles')
  kv_head = lax.div(n, jnp.int32(group))
  ranges = functools.partial(
    _key_range, block_k=bk, num_k_blocks=k_ref.shape[1] // bk, **cfg.mask_kw()
  )
  union = ranges(i, block_q=wgs * bq)
  ring = _Ring((k_s, v_s, kv_seg_s), ready, consumed, depth)

  def compute(wg):
    q_first = (i * wgs + wg) * bq
    rows = pl.ds(q_first, bq)
    copies = [
      (q_ref.at[b, rows, n], q_s),
      (do_ref.at[b, rows, n], do_s),
      (lse_ref.at[b, n, rows], lse_s),
      (delta_ref.at[b, n, rows], delta_s),
    ] + ([(q_seg_ref.at[b, rows], q_seg_s)] if has_seg else [])
    for c, (src, dst) in enumerate(copies):
      plgpu.copy_gmem_to_smem(src, dst.at[wg], q_bar.at[c * wgs + wg])
    for c in range(len(copies)):
      plgpu.barrier_wait(q_bar.at[c * wgs + wg])
    lse = _load_vector(lse_s.at[wg], 1, cfg.interpret)
    delta = _load_vector(delta_s.at[wg], 1, cfg.interpret)
    q_seg = _load_vector(q_seg_s.at[wg], 1, cfg.interpret) if has_seg else None
    own = _own_range(union, ranges(i * wgs + wg, block_q=bq))

    def step(j, dq):
      t = j - union[0]
      k_tile, v_tile, seg_tile = ring.wait(t)
      s = _scores(q_s.at[wg], k_tile, (bq, bk), cfg.interpret) * (cfg.scale * LOG2E)
      p = jnp.exp2(s - lax.broadcast_in_dim(lse, s.shape, [0]))  # [bq, bk]
      kv_seg = _load_vector(seg_tile, 0, cfg.interpret) if has_seg else None
      mask = _visible((bq, bk), q_first, j * bk, q_seg, kv_seg, cfg)
      if mask is not None:
        p = jnp.where(mask, p, 0.0)
      dp = _scores(do_s.at[wg], v_tile, (bq, bk), cfg.interpret)
      ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
      dq = _accumulate(dq, ds.astype(cfg.dtype), k_tile, cfg.interpret)
      ring.release(t)
      return dq

    init = _filled((bq, cfg.head_dim), 0.0, cfg.interpret)
    dq = _stream(union, own, step, lambda j: ring.skip(j - union[0]), init)
    q_s.at[wg][...] = (dq * cfg.scale).astype(cfg.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_s.at[wg], dq_ref.at[b, rows, n])
    plgpu.wait_smem_to_gmem(0)

  _compute_wg(compute, wgs)
  _memory_wg(lambda: _feed_keys(ring, union, bk, b, kv_head, k_ref, v_ref, kv_seg_ref), wgs)


# --- dK/dV: each CTA owns bk keys of one kv head, in one compute warpgroup; the group's queries
# stream through. ---


def _dkv_kernel(*refs, cfg, bq, bk, depth, group, has_seg):
  q_ref, k_ref, v_ref = refs[:3]
  q_seg_ref, kv_seg_ref = refs[3:5] if has_seg else (None, None)
  do_ref, lse_ref, delta_ref = refs[5:8] if has_seg else refs[3:6]
  dk_ref, dv_ref, scratch = refs[-3], refs[-2], refs[-1]
  k_s, v_s, kv_seg_s, q_s, do_s, lse_s, delta_s, q_seg_s, k_bar, ready, consumed = scratch
  b, h, j = lax.axis_index('batch'), lax.axis_index('heads'), lax.axis_index('k_tiles')
  num_q_blocks = q_ref.shape[1] // bq
  mask_kw = dict(causal=cfg.causal, window=cfg.window)
  ranges = functools.partial(query_block_range, block_q=bq, num_q_blocks=num_q_blocks, **mask_kw)
  first, last = (jnp.asarray(x, jnp.int32) for x in ranges(j, block_k=bk))
  per_head = last - first  # query blocks streamed for each head of the group
  num_steps = group * per_head
  # Step t of the stream: query head h * group + t // per_head, query block first + t % per_head.
  head_of = lambda t: h * group + lax.div(t, jnp.maximum(per_head, 1))
  block_of = lambda t: first + lax.rem(t, jnp.maximum(per_head, 1))
  ring = _Ring((q_s, do_s, lse_s, delta_s, q_seg_s), ready, consumed, depth)

  def compute(_):
    k_first = j * bk
    keys = pl.ds(k_first, bk)
    copies = [(k_ref.at[b, keys, h], k_s), (v_ref.at[b, keys, h], v_s)]
    copies += [(kv_seg_ref.at[b, keys], kv_seg_s)] if has_seg else []
    for c, (src, dst) in enumerate(copies):
      plgpu.copy_gmem_to_smem(src, dst, k_bar.at[c])
    for c in range(len(copies)):
      plgpu.barrier_wait(k_bar.at[c])
    kv_seg = _load_vector(kv_seg_s, 1, cfg.interpret) if has_seg else None

    # One flat loop over (head of the group, query block), in the order the memory warpgroup
    # feeds them: a loop over heads around the loop over blocks kept its state beside the two
    # accumulators, and at head dim 128 with GQA under a causal or window mask ptxas spilled.
    def step(t, carry):
      dk, dv = carry
      q_tile, do_tile, lse_tile, delta_tile, seg_tile = ring.wait(t)
      st = _scores(k_s, q_tile, (bk, bq), cfg.interpret) * (cfg.scale * LOG2E)
      lse = _load_vector(lse_tile, 0, cfg.interpret)
      pt = jnp.exp2(st - lax.broadcast_in_dim(lse, st.shape, [1]))  # [bk, bq]
      q_seg = _load_vector(seg_tile, 0, cfg.interpret) if has_seg else None
      mask = _visible((bk, bq), block_of(t) * bq, k_first, q_seg, kv_seg, cfg, keys_on_rows=True)
      if mask is not None:
        pt = jnp.where(mask, pt, 0.0)
      dv = _accumulate(dv, pt.astype(cfg.dtype), do_tile, cfg.interpret)
      dpt = _scores(v_s, do_tile, (bk, bq), cfg.interpret)
      delta = _load_vector(delta_tile, 0, cfg.interpret)
      dst = pt * (dpt - lax.broadcast_in_dim(delta, dpt.shape, [1]))
      dk = _accumulate(dk, dst.astype(cfg.dtype), q_tile, cfg.interpret)
      ring.release(t)
      return dk, dv

    zeros = _filled((bk, cfg.head_dim), 0.0, cfg.interpret)
    dk, dv = lax.fori_loop(0, num_steps, step, (zeros, zeros))
    k_s[...] = (dk * cfg.scale).astype(cfg.dtype)
    v_s[...] = dv.astype(cfg.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_s, dk_ref.at[b, keys, h])
    plgpu.copy_smem_to_gmem(v_s, dv_ref.at[b, keys, h])
    plgpu.wait_smem_to_gmem(0)

  def memory():
    def sources(t):
      n, rows = head_of(t), pl.ds(block_of(t) * bq, bq)
      seg = q_seg_ref.at[b, rows] if has_seg else None
      return (
        q_ref.at[b, rows, n],
        do_ref.at[b, rows, n],
        lse_ref.at[b, n, rows],
        delta_ref.at[b, n, rows],
        seg,
      )

    ring.feed(num_steps, sources)

  _compute_wg(compute, 1)
  _memory_wg(memory, 1)


def backward(
  q, k, v, q_seg, kv_seg, out, lse, do, *, scale, causal, window, kv_len, blocks, interpret
):
  """Returns `(dq, dk, dv)` shaped like `(q, k, v)` for padded inputs (lse from `forward`)."""
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  group, depth = N // K, max(2, blocks.num_stages)
  cfg = _Static(scale, causal, window, kv_len, interpret, q.dtype, H)
  has_seg = q_seg is not None
  delta = jnp.einsum('btnh,btnh->bnt', out.astype(jnp.float32), do.astype(jnp.float32))  # [B,N,T]
  ids = (q_seg, kv_seg) if has_seg else ()
  operands = (q, k, v, *ids, do, lse, delta)

  bq, bk, W = blocks.block_q_dq, blocks.block_k_dq, compute_wgs('dq', H)
  dq_scratch = (
    _smem((W, bq, H), q.dtype, True),  # q, then dq
    _smem((W, bq, H), do.dtype, True),
    _smem((W, bq), jnp.int32, False) if has_seg else None,
    _smem((W, bq), jnp.float32, False),  # lse
    _smem((W, bq), jnp.float32, False),  # delta
    _smem((depth, bk, H), k.dtype, True),
    _smem((depth, bk, H), v.dtype, True),
    _smem((depth, bk), jnp.int32, False) if has_seg else None,
    _barriers(5 * W),  # q, do, lse, delta (and q segment ids) per warpgroup
    (_barriers(depth), _barriers(depth), _barriers(depth) if has_seg else None),
    _barriers(depth, arrivals=W),
  )
  kernel = functools.partial(
    _dq_kernel, cfg=cfg, bq=bq, bk=bk, depth=depth, group=group, has_seg=has_seg, wgs=W
  )
  grid, grid_names = (B, N, T // (W * bq)), ('batch', 'heads', 'q_tiles')
  out_type = jax.ShapeDtypeStruct(q.shape, q.dtype)
  name = 'sparrow_mgpu_dq'
  dq = _launch(kernel, operands, out_type, dq_scratch, grid, grid_names, interpret, name, W)

  bq, bk = blocks.block_q_dkv, blocks.block_k_dkv
  dkv_scratch = (
    _smem((bk, H), k.dtype, True),  # k, then dk
    _smem((bk, H), v.dtype, True),  # v, then dv
    _smem((bk,), jnp.int32, False) if has_seg else None,
    _smem((depth, bq, H), q.dtype, True),
    _smem((depth, bq, H), do.dtype, True),
    _smem((depth, bq), jnp.float32, False),  # lse
    _smem((depth, bq), jnp.float32, False),  # delta
    _smem((depth, bq), jnp.int32, False) if has_seg else None,
    _barriers(3),  # k, v (and kv segment ids)
    tuple(_barriers(depth) for _ in range(4)) + ((_barriers(depth),) if has_seg else (None,)),
    _barriers(depth),
  )
  kernel = functools.partial(
    _dkv_kernel, cfg=cfg, bq=bq, bk=bk, depth=depth, group=group, has_seg=has_seg
  )
  grid, grid_names = (B, K, S // bk), ('batch', 'heads', 'k_tiles')
  out_type = (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
  name = 'sparrow_mgpu_dkv'
  dk, dv = _launch(kernel, operands, out_type, dkv_scratch, grid, grid_names, interpret, name, 1)
  return dq, dk, dv
