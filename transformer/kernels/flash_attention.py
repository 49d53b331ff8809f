"""Public flash attention: block sizes, input checks, padding and the custom_vjp.

Kernels live in `mosaic_gpu.py` (Hopper), `gpu.py` (Triton, older GPUs) and `tpu.py`
(Mosaic TPU), beside this file; callers see `[B, T, N, H]`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from transformer.kernels import gpu, mosaic_gpu, target, tpu

Array = jax.Array
_MIN_GPU_BLOCK = 16  # Triton's smallest tile for tl.dot
BACKENDS = ('mosaic_gpu', 'gpu', 'tpu')  # Hopper, Triton (any CUDA GPU), TPU


def _is_pow2(x: int) -> bool:
  return isinstance(x, int) and x > 0 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes for the forward, dQ and dK/dV kernels (powers of two; None = same as forward).

  Blocks larger than a (padded) sequence are shrunk to fit it, so defaults suit any length.
  """

  block_q: int
  block_k: int
  block_q_dq: int | None = None
  block_k_dq: int | None = None
  block_q_dkv: int | None = None
  block_k_dkv: int | None = None
  num_warps: int | None = None  # Triton only; None = 4 for head dim <= 64, else 8
  num_stages: int = 2  # GPU only: software pipelining depth (Mosaic GPU: TMA ring slots)

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.name.startswith('block') and value is not None and not _is_pow2(value):
        raise ValueError(f'BlockSizes.{field.name}={value!r} must be a positive power of two')
    if self.num_warps is not None and not _is_pow2(self.num_warps):
      raise ValueError(f'BlockSizes.num_warps={self.num_warps!r} must be a power of two or None')
    if not isinstance(self.num_stages, int) or self.num_stages < 1:
      raise ValueError(f'BlockSizes.num_stages={self.num_stages!r} must be an int >= 1')

  @classmethod
  def default(cls, backend: str, head_dim: int, dtype=jnp.bfloat16) -> BlockSizes:
    """Reasonable tiles for `backend` ('mosaic_gpu', 'gpu' or 'tpu'), `head_dim` and `dtype`.

    Mosaic GPU: block_q, block_q_dq and block_k_dkv are the rows of one warpgroup (64); a CTA
    covers one or two of them (`kernels.mosaic_gpu.COMPUTE_WGS`). Triton: 8 warps, and halved
    tiles for float32, whose doubled registers and SMEM spilled, or at head dim 256 overflowed an
    H200's 227 KiB of SMEM (`python -m experiments.gpu_check --deviceless`).
    """
    if backend == 'mosaic_gpu':
      big = head_dim > 128
      return cls(
        block_q=64,
        block_k=64 if big else 128,
        block_q_dq=64,
        block_k_dq=64,
        block_q_dkv=64,
        block_k_dkv=64,
      )
    if backend == 'gpu':
      big = head_dim > 128  # keep [block, H] tiles within shared memory
      wide = jnp.dtype(dtype).itemsize > 2
      shrink = (lambda b: max(_MIN_GPU_BLOCK, b // 2)) if wide else (lambda b: b)
      return cls(
        block_q=shrink(64 if big else 128),
        block_k=shrink(32 if big else 64),
        block_q_dq=shrink(64),
        block_k_dq=shrink(32 if big else 64),
        block_q_dkv=shrink(32 if big else 64),
        block_k_dkv=shrink(32 if head_dim > 64 else 64),  # dK and dV: two [block, H] accumulators
        num_warps=8,
      )
    if backend == 'tpu':
      return cls(block_q=128, block_k=128)
    raise ValueError(
      f"backend={backend!r} has no default block sizes; use 'mosaic_gpu', 'gpu' or 'tpu'"
    )

  def resolved(self) -> BlockSizes:
    """A copy with every backward block filled in from the forward blocks."""
    q, k = self.block_q, self.block_k
    return dataclasses.replace(
      self,
      block_q_dq=self.block_q_dq or q,
      block_k_dq=self.block_k_dq or k,
      block_q_dkv=self.block_q_dkv or q,
      block_k_dkv=self.block_k_dkv or k,
    )

  def check(self, backend: str) -> None:
    """Raises ValueError when a block does not suit `backend` (GPU: >= 16, TPU: >= 8).

    Mosaic GPU: the warpgroup row blocks (block_q, block_q_dq, block_k_dkv) must be 64, and the
    streamed blocks 64, 128 or 256.
    """
    if backend == 'mosaic_gpu':
      b = self.resolved()
      for name in ('block_q', 'block_q_dq', 'block_k_dkv'):
        if getattr(b, name) != mosaic_gpu.ROWS:
          raise ValueError(
            f'BlockSizes.{name}={getattr(b, name)} must be {mosaic_gpu.ROWS} for '
            "backend='mosaic_gpu' (the rows of one warpgroup's wgmma)"
          )
      for name in ('block_k', 'block_k_dq', 'block_q_dkv'):
        if getattr(b, name) not in (64, 128, 256):
          raise ValueError(
            f'BlockSizes.{name}={getattr(b, name)} must be 64, 128 or 256 for '
            "backend='mosaic_gpu' (the K of a wgmma is a multiple of 64)"
          )
      return
    smallest = _MIN_GPU_BLOCK if backend == 'gpu' else 8
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.name.startswith('block') and value is not None and value < smallest:
        raise ValueError(
          f'BlockSizes.{field.name}={value} is below {smallest}, the smallest {backend} tile'
        )

  def fit(self, T: int, S: int) -> BlockSizes:
    """Shrinks blocks that exceed the sequence lengths (rounded up to a power of two >= 16)."""
    tq = max(_MIN_GPU_BLOCK, _next_pow2(T))
    tk = max(_MIN_GPU_BLOCK, _next_pow2(S))
    b = self.resolved()
    return dataclasses.replace(
      b,
      block_q=min(b.block_q, tq),
      block_k=min(b.block_k, tk),
      block_q_dq=min(b.block_q_dq, tq),
      block_k_dq=min(b.block_k_dq, tk),
      block_q_dkv=min(b.block_q_dkv, tq),
      block_k_dkv=min(b.block_k_dkv, tk),
    )


def _next_pow2(x: int) -> int:
  """Smallest power of two >= x."""
  return 1 if x <= 1 else 1 << (x - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static settings of one call; hashable so it can be a custom_vjp nondiff argument."""

  scale: float
  causal: bool
  window: tuple[int, int] | None
  kv_len: int | None  # true key length when keys were padded, else None
  blocks: BlockSizes
  interpret: bool
  backend: str  # one of BACKENDS

  @property
  def kernels(self):
    return {'mosaic_gpu': mosaic_gpu, 'gpu': gpu, 'tpu': tpu}[self.backend]

  def kernel_kwargs(self) -> dict:
    """The keyword arguments of every backend's `forward` and `backward`."""
    names = ('scale', 'causal', 'window', 'kv_len', 'blocks', 'interpret')
    return {name: getattr(self, name) for name in names}


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, q_seg, kv_seg, cfg: _Config):
  return cfg.kernels.forward(q, k, v, q_seg, kv_seg, **cfg.kernel_kwargs())[0]


def _attention_fwd(q, k, v, q_seg, kv_seg, cfg: _Config):
  out, lse = cfg.kernels.forward(q, k, v, q_seg, kv_seg, **cfg.kernel_kwargs())  # lse f32
  return out, (q, k, v, q_seg, kv_seg, out, lse)


def _attention_bwd(cfg: _Config, residuals, do):
  q, k, v, q_seg, kv_seg, out, lse = residuals
  kw = cfg.kernel_kwargs()
  dq, dk, dv = cfg.kernels.backward(q, k, v, q_seg, kv_seg, out, lse, do, **kw)
  return dq, dk, dv, None, None  # segment ids are integers: no cotangent


_attention.defvjp(_attention_fwd, _attention_bwd)


def gpu_capability() -> tuple[str, float] | None:
  """(device kind, compute capability) of the target when it is an NVIDIA GPU, else None.

  The target is the mesh being compiled for, or the first local device (`kernels.target`).
  """
  where = target.current()
  return (where.device_kind, where.compute_capability) if where.nvidia else None


def _mosaic_supports(head_dim: int, dtype) -> bool:
  return head_dim in mosaic_gpu.HEAD_DIMS and jnp.dtype(dtype).name in mosaic_gpu.DTYPES


def _check_mosaic(head_dim: int, dtype, interpret: bool) -> None:
  """One clear error for what the Hopper kernel cannot run, naming what it and others can."""
  if head_dim not in mosaic_gpu.HEAD_DIMS:
    raise ValueError(
      f"backend='mosaic_gpu' supports head dims {mosaic_gpu.HEAD_DIMS}; got H={head_dim}. "
      "Use backend='gpu' (Triton, any head dim) or backend=None to choose"
    )
  if jnp.dtype(dtype).name not in mosaic_gpu.DTYPES:
    raise ValueError(
      f"backend='mosaic_gpu' supports dtypes {mosaic_gpu.DTYPES}; got {jnp.dtype(dtype).name}. "
      "Cast q, k and v, or use backend='gpu' (Triton, also float32)"
    )
  gpu = gpu_capability()
  if not interpret and gpu is not None and gpu[1] < 9.0:
    raise ValueError(
      f"backend='mosaic_gpu' needs a Hopper (sm90) or newer GPU; this is {gpu[0]} (compute "
      f"capability {gpu[1]}). Use backend='gpu' (Triton) or backend=None to choose"
    )


def _resolve_backend(backend: str | None, interpret: bool, head_dim: int, dtype) -> str:
  if backend is None:
    platform, gpu = target.current().platform, gpu_capability()
    if platform == 'tpu':
      return 'tpu'
    if gpu is not None:  # Hopper and newer get the Mosaic GPU kernel where it applies
      return 'mosaic_gpu' if gpu[1] >= 9.0 and _mosaic_supports(head_dim, dtype) else 'gpu'
    if platform == 'gpu':
      return 'gpu'
    if not interpret:
      raise ValueError(
        f'flash_attention has no compiled kernel for backend {platform!r}; pass interpret=True '
        "(slow, for tests) or backend='mosaic_gpu'/'gpu'/'tpu' to lower for another device, or "
        "use the 'xla' or 'chunked' attention implementation"
      )
    return 'gpu'  # interpret the Triton kernel on CPU
  if backend == 'mosaic_gpu':
    _check_mosaic(head_dim, dtype, interpret)
    return backend
  if backend in ('gpu', 'cuda', 'rocm'):
    return 'gpu'
  if backend == 'tpu':
    return 'tpu'
  raise ValueError(f"backend={backend!r} is not one of 'mosaic_gpu', 'gpu', 'tpu' or None")


def _check_shapes(q, k, v, q_segment_ids, kv_segment_ids, window):
  for name, x in (('q', q), ('k', k), ('v', v)):
    if x.ndim != 4:
      raise ValueError(f'{name} must have rank 4 ([B, T, N, H] / [B, S, K, H]); got {x.shape}')
  B, T, N, H = q.shape
  if k.shape != v.shape:
    raise ValueError(f'k and v must have the same shape; got k {k.shape} and v {v.shape}')
  if k.shape[0] != B:
    raise ValueError(f'batch sizes differ: q has B={B}, k/v have B={k.shape[0]}')
  if k.shape[3] != H:
    raise ValueError(f'head dims differ: q has H={H}, k/v have H={k.shape[3]}')
  K = k.shape[2]
  if N % K:
    raise ValueError(f'kv heads K={K} must divide query heads N={N} (grouped-query attention)')
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError('pass both q_segment_ids and kv_segment_ids, or neither')
  if q_segment_ids is not None:
    for name, ids, want in (('q', q_segment_ids, (B, T)), ('kv', kv_segment_ids, (B, k.shape[1]))):
      if ids.shape != want:
        raise ValueError(f'{name}_segment_ids must have shape {list(want)}; got {list(ids.shape)}')
      if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f'{name}_segment_ids must be integers; got {ids.dtype}')
  if window is not None:
    ok = len(window) == 2 and all(isinstance(w, int) and w >= 0 for w in window)
    if not ok:
      raise ValueError(f'window={window!r} must be a pair of non-negative ints (left, right)')


def _pad_axis(x: Array, axis: int, size: int) -> Array:
  """Zero-pads `axis` of `x` up to `size`."""
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


@functools.partial(
  jax.jit,
  static_argnames=('causal', 'window', 'scale', 'block_sizes', 'backend', 'interpret'),
)
def flash_attention(
  q: Array,
  k: Array,
  v: Array,
  *,
  causal: bool = False,
  q_segment_ids: Array | None = None,
  kv_segment_ids: Array | None = None,
  window: tuple[int, int] | None = None,
  scale: float | None = None,
  block_sizes: BlockSizes | None = None,
  backend: str | None = None,
  interpret: bool = False,
) -> Array:
  """Tiled flash attention (online softmax); never builds the [T, S] score matrix.

  Query i sees key j iff all given conditions hold: causal (j <= i), equal non-zero segment ids
  (0 = padding), window=(left, right) (i - left <= j <= i + right). Rows that see no key give 0.

  Args:
    q: queries `[B, T, N, H]`.
    k: keys `[B, S, K, H]`; K divides N (grouped-query / multi-query attention).
    v: values `[B, S, K, H]`.
    causal: top-left aligned causal mask.
    q_segment_ids: int `[B, T]`; pass together with `kv_segment_ids`.
    kv_segment_ids: int `[B, S]`.
    window: sliding window `(left, right)`, non-negative ints.
    scale: logit scale; None = 1/sqrt(H).
    block_sizes: kernel tiles; None = `BlockSizes.default(backend, H, q.dtype)`.
    backend: 'mosaic_gpu' (Hopper: head dims 64/128/256, bf16/fp16), 'gpu' (Triton) or 'tpu'
      picks the kernel; None = from the device (Mosaic GPU on sm90+ where it applies).
    interpret: run the kernel in the Pallas interpreter (slow; for CPU tests).

  Returns:
    `[B, T, N, H]` in q.dtype.
  """
  _check_shapes(q, k, v, q_segment_ids, kv_segment_ids, window)
  B, T, N, H = q.shape
  backend = _resolve_backend(backend, interpret, H, q.dtype)
  S = k.shape[1]
  scale = 1.0 / math.sqrt(H) if scale is None else float(scale)
  blocks = block_sizes or BlockSizes.default(backend, H, q.dtype)
  if not isinstance(blocks, BlockSizes):
    raise ValueError(f'block_sizes must be a BlockSizes or None; got {type(blocks).__name__}')
  blocks.check(backend)
  if backend == 'mosaic_gpu':  # a CTA covers two warpgroups' rows; blocks never shrink
    blocks = blocks.resolved()
    q_tile = max(2 * blocks.block_q, 2 * blocks.block_q_dq, blocks.block_q_dkv)
    k_tile = max(blocks.block_k, blocks.block_k_dq, 2 * blocks.block_k_dkv)
  else:
    blocks = blocks.fit(T, S)
    q_tile = max(blocks.block_q, blocks.block_q_dq, blocks.block_q_dkv)  # all powers of two
    k_tile = max(blocks.block_k, blocks.block_k_dq, blocks.block_k_dkv)

  # Pad lengths to whole blocks and the head dim to a power of two; padded keys are masked.
  T_pad, S_pad = -(-T // q_tile) * q_tile, -(-S // k_tile) * k_tile
  H_pad = max(_MIN_GPU_BLOCK, _next_pow2(H)) if backend == 'gpu' else H  # Triton: power of 2
  qp = _pad_axis(_pad_axis(q, 1, T_pad), 3, H_pad)  # [B, T_pad, N, H_pad]
  kp = _pad_axis(_pad_axis(k, 1, S_pad), 3, H_pad)  # [B, S_pad, K, H_pad]
  vp = _pad_axis(_pad_axis(v, 1, S_pad), 3, H_pad)
  q_seg = kv_seg = None
  if q_segment_ids is not None:
    q_seg = _pad_axis(q_segment_ids.astype(jnp.int32), 1, T_pad)  # [B, T_pad], pad = 0
    kv_seg = _pad_axis(kv_segment_ids.astype(jnp.int32), 1, S_pad)  # [B, S_pad]
  kv_len = None if S_pad == S or q_seg is not None else S  # segment id 0 already masks the pad
  cfg = _Config(scale, bool(causal), window, kv_len, blocks, bool(interpret), backend)
  if backend in ('gpu', 'mosaic_gpu'):
    out = _attention(qp, kp, vp, q_seg, kv_seg, cfg)  # [B, T_pad, N, H_pad]
    return out[:, :T, :, :H]  # [B, T, N, H]
  # TPU tiles are [block, H]: heads go before length, segment ids get a unit lane/sublane axis.
  qt, kt, vt = (x.transpose(0, 2, 1, 3) for x in (qp, kp, vp))  # [B, N, T_pad, H], [B, K, S_pad, H]
  if q_seg is not None:
    q_seg, kv_seg = q_seg[:, :, None], kv_seg[:, None, :]  # [B, T_pad, 1], [B, 1, S_pad]
  out = _attention(qt, kt, vt, q_seg, kv_seg, cfg)  # [B, N, T_pad, H]
  return out.transpose(0, 2, 1, 3)[:, :T]  # [B, T, N, H]
