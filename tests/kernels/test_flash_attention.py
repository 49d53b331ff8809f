"""Tests for transformer/kernels/: the Pallas flash-attention kernel against float64 NumPy.

Kernel numerics run with interpret=True on CPU; the lowering tests lower for 'cuda' without a GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.kernels import BlockSizes, flash_attention
from transformer.kernels.gpu import key_block_range, query_block_range
from transformer.kernels.reference import attention_float64 as _reference_np
from transformer.kernels.reference import visible_float64 as _visible_np

SMALL = BlockSizes(block_q=16, block_k=16)


def _rel(x, ref):
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  return np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30)


def _inputs(B, T, S, N, K, H, dtype, seed=0):
  rng = np.random.default_rng(seed)
  q, k, v = (rng.standard_normal(shape) for shape in ((B, T, N, H), (B, S, K, H), (B, S, K, H)))
  g = rng.standard_normal((B, T, N, H))
  q, k, v, g = (jnp.asarray(x, dtype) for x in (q, k, v, g))
  return q, k, v, g


def _check(q, k, v, g, tol, backend, block_sizes=SMALL, **mask):
  """Kernel forward and vjp against the float64 reference on the same (rounded) inputs."""
  seg = {}
  if mask.get('q_seg') is not None:
    seg = dict(q_segment_ids=jnp.asarray(mask['q_seg']), kv_segment_ids=jnp.asarray(mask['kv_seg']))
  kw = dict(causal=mask.get('causal', False), window=mask.get('window'), scale=mask.get('scale'))
  kw.update(block_sizes=block_sizes, backend=backend, interpret=True)
  f = lambda q, k, v: flash_attention(q, k, v, **kw, **seg)

  @jax.jit  # one compile: the interpreted kernels run op by op otherwise
  def forward_and_vjp(q, k, v, g):
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(g)

  out, grads = forward_and_vjp(q, k, v, g)
  ref_out, ref_grads = _reference_np(q, k, v, g, **mask)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert _rel(out, ref_out) <= tol, ('out', _rel(out, ref_out))
  for name, x, ref in zip(('dq', 'dk', 'dv'), grads, ref_grads):
    assert x.shape == ref.shape
    assert np.isfinite(np.asarray(x, np.float32)).all(), name
    assert _rel(x, ref) <= tol, (name, _rel(x, ref))
  return out, grads


class TestInterpretGPU:
  """The GPU (Triton) kernel run by the Pallas interpreter, f32 unless noted."""

  backend = 'gpu'

  def test_plain_unaligned_length(self):
    # T=S=40 with 16-blocks: the padded key tail must be masked.
    _check(*_inputs(2, 40, 40, 2, 2, 32, jnp.float32), tol=1e-5, backend=self.backend)

  def test_causal_gqa_head_dim_64(self):
    _check(
      *_inputs(1, 32, 32, 4, 2, 64, jnp.float32, seed=1),
      tol=1e-5,
      backend=self.backend,
      causal=True,
    )

  def test_padding_gives_zero_rows_and_grads(self):
    q, k, v, g = _inputs(2, 24, 24, 2, 1, 32, jnp.float32, seed=2)  # MQA
    q_seg = np.ones((2, 24), np.int32)
    q_seg[0, 20:] = 0  # padded queries, including fully masked rows
    q_seg[1, 5:] = 0
    kv_seg = q_seg.copy()
    out, (dq, _, _) = _check(
      q, k, v, g, tol=1e-5, backend=self.backend, causal=True, q_seg=q_seg, kv_seg=kv_seg
    )
    assert np.all(np.asarray(out)[0, 20:] == 0) and np.all(np.asarray(out)[1, 5:] == 0)
    assert np.all(np.asarray(dq)[0, 20:] == 0) and np.all(np.asarray(dq)[1, 5:] == 0)

  def test_packed_segments(self):
    q, k, v, g = _inputs(1, 48, 48, 2, 2, 32, jnp.float32, seed=3)
    seg = np.repeat(np.array([[1, 2, 3, 0]]), [10, 20, 14, 4], axis=1).astype(np.int32)
    _check(q, k, v, g, tol=1e-5, backend=self.backend, q_seg=seg, kv_seg=seg)

  @pytest.mark.parametrize('head_dim', [96, 128, 256])
  def test_larger_head_dims_causal(self, head_dim):
    _check(
      *_inputs(1, 20, 20, 2, 1, head_dim, jnp.float32, seed=head_dim),
      tol=1e-5,
      backend=self.backend,
      causal=True,
    )

  def test_sliding_window(self):
    _check(
      *_inputs(1, 64, 64, 2, 1, 32, jnp.float32, seed=4),
      tol=1e-5,
      backend=self.backend,
      window=(5, 2),
    )

  def test_cross_attention_head_dim_80_no_scale(self):
    # T != S, head dim 80 (padded to 128 inside), scale=1.0, larger default blocks shrunk to fit.
    _check(
      *_inputs(1, 24, 40, 2, 2, 80, jnp.float32, seed=5),
      tol=1e-5,
      backend=self.backend,
      block_sizes=None,
      scale=1.0,
    )

  @pytest.mark.parametrize('dtype', [jnp.bfloat16, jnp.float16])
  def test_half_precision_causal_window(self, dtype):
    if self.backend == 'tpu' and dtype == jnp.float16:
      pytest.skip('TPUs have no float16 matmul; bfloat16 covers half precision there')
    _check(
      *_inputs(1, 48, 48, 4, 2, 64, dtype, seed=6),
      tol=2e-2,
      backend=self.backend,
      causal=True,
      window=(20, 0),
    )

  @pytest.mark.parametrize('causal,window,first_bad', [(True, None, 48), (False, (8, 8), 32)])
  def test_skipped_blocks_are_never_read(self, causal, window, first_bad):
    # NaN values in key blocks that no query of block 0 may see: a kernel that loops over every
    # block and only masks would compute 0 * NaN = NaN there; a kernel that skips stays finite.
    q, k, v, _ = _inputs(1, 64, 64, 2, 2, 16, jnp.float32, seed=8)
    v_bad = v.at[:, first_bad:].set(jnp.nan)
    out = flash_attention(
      q,
      k,
      v_bad,
      causal=causal,
      window=window,
      block_sizes=SMALL,
      backend=self.backend,
      interpret=True,
    )
    ref, _ = _reference_np(q, k, v, np.zeros(q.shape), causal=causal, window=window)
    assert np.isfinite(np.asarray(out[:, :16])).all()
    assert _rel(out[:, :16], ref[:, :16]) <= 1e-5


class TestInterpretTPU(TestInterpretGPU):
  """The same cases through the TPU (Mosaic) kernel, run by the Pallas interpreter."""

  backend = 'tpu'


@pytest.mark.parametrize('causal,window', [(True, None), (False, (9, 3)), (True, (40, 0))])
@pytest.mark.parametrize('T,S,bq,bk', [(64, 64, 16, 16), (48, 80, 16, 32), (128, 32, 32, 16)])
def test_block_ranges_are_tight(causal, window, T, S, bq, bk):
  """The loop bounds cover every visible block and skip every fully masked one."""
  visible = _visible_np(T, S, causal, window, None, None)[0]  # [T, S]
  nq, nk = T // bq, S // bk
  for i in range(nq):
    lo, hi = key_block_range(
      i, block_q=bq, block_k=bk, num_k_blocks=nk, causal=causal, window=window
    )
    need = [j for j in range(nk) if visible[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk].any()]
    assert list(range(int(lo), int(hi))) == need
  for j in range(nk):
    lo, hi = query_block_range(
      j, block_q=bq, block_k=bk, num_q_blocks=nq, causal=causal, window=window
    )
    need = [i for i in range(nq) if visible[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk].any()]
    assert list(range(int(lo), int(hi))) == need


def test_causal_skips_upper_blocks():
  nk = 8
  visited = sum(
    int(hi) - int(lo)
    for lo, hi in (
      key_block_range(i, block_q=64, block_k=64, num_k_blocks=nk, causal=True, window=None)
      for i in range(nk)
    )
  )
  assert visited == nk * (nk + 1) // 2  # 36 of 64 blocks


class TestValidation:
  def _qkv(self, T=16, S=16, N=2, K=2, H=16):
    return jnp.zeros((1, T, N, H)), jnp.zeros((1, S, K, H)), jnp.zeros((1, S, K, H))

  def test_rank(self):
    q, k, v = self._qkv()
    with pytest.raises(ValueError, match='rank 4'):
      flash_attention(q[0], k, v, interpret=True)

  def test_head_dim_mismatch(self):
    q, k, v = self._qkv()
    with pytest.raises(ValueError, match='head dims differ'):
      flash_attention(q, k[..., :8], v[..., :8], interpret=True)

  def test_kv_heads_must_divide(self):
    q, k, v = self._qkv(N=3, K=2)
    with pytest.raises(ValueError, match='must divide query heads N=3'):
      flash_attention(q, k, v, interpret=True)

  def test_k_v_shapes(self):
    q, k, v = self._qkv()
    with pytest.raises(ValueError, match='same shape'):
      flash_attention(q, k, v[:, :8], interpret=True)

  def test_segment_ids(self):
    q, k, v = self._qkv()
    ids = jnp.ones((1, 16), jnp.int32)
    with pytest.raises(ValueError, match='both'):
      flash_attention(q, k, v, q_segment_ids=ids, interpret=True)
    with pytest.raises(ValueError, match=r'kv_segment_ids must have shape \[1, 16\]'):
      flash_attention(q, k, v, q_segment_ids=ids, kv_segment_ids=ids[:, :8], interpret=True)

  def test_window(self):
    q, k, v = self._qkv()
    with pytest.raises(ValueError, match='window'):
      flash_attention(q, k, v, window=(-1, 2), interpret=True)

  def test_block_sizes(self):
    with pytest.raises(ValueError, match='power of two'):
      BlockSizes(block_q=48, block_k=16)
    with pytest.raises(ValueError, match='smallest gpu tile'):
      q, k, v = self._qkv()
      flash_attention(q, k, v, block_sizes=BlockSizes(8, 16), backend='gpu', interpret=True)
    with pytest.raises(ValueError, match='backend'):
      BlockSizes.default('cpu', 64)

  def test_backend(self):
    q, k, v = self._qkv()
    with pytest.raises(ValueError, match="backend='fpga'"):
      flash_attention(q, k, v, backend='fpga')
    if jax.default_backend() == 'cpu':
      with pytest.raises(ValueError, match='interpret=True'):
        flash_attention(q, k, v)


def _lower(fn, platform, *args):
  return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _target_h200():
  """Names the GPU to lower Triton for: jax >= 0.12 needs one on a machine without a GPU."""
  from jax._src.mesh import AbstractDevice

  device = AbstractDevice('NVIDIA H200', 132, 'gpu')
  mesh = jax.sharding.AbstractMesh((1,), ('x',), abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


@pytest.mark.parametrize('head_dim', [64, 96, 128, 256])
def test_lowers_for_cuda(head_dim):
  """Forward and gradient lower through Triton for CUDA on a CPU-only machine."""
  q = jax.ShapeDtypeStruct((2, 256, 4, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 256, 2, head_dim), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((2, 256), jnp.int32)

  def f(q, k, v, ids):
    return flash_attention(
      q, k, v, causal=True, q_segment_ids=ids, kv_segment_ids=ids, backend='gpu'
    )

  def loss(q, k, v, ids):
    return f(q, k, v, ids).astype(jnp.float32).sum()

  with _target_h200():
    assert 'triton' in _lower(f, 'cuda', q, kv, kv, ids)
    grad_text = _lower(jax.grad(loss, argnums=(0, 1, 2)), 'cuda', q, kv, kv, ids)
    assert grad_text.count('triton') >= 3  # forward, dQ and dK/dV kernels

    window = lambda q, k, v: flash_attention(q, k, v, window=(64, 0), backend='gpu')
    exported = jax.export.export(
      jax.jit(jax.grad(lambda q, k, v: window(q, k, v).astype(jnp.float32).sum())),
      platforms=['cuda'],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call('__gpu$xla.gpu.triton')],
    )(q, kv, kv)
  assert exported.platforms == ('cuda',)


@pytest.mark.parametrize('head_dim', [64, 80, 128, 256])
def test_lowers_for_tpu(head_dim):
  """Forward and gradient lower through Mosaic for TPU on a CPU-only machine."""
  q = jax.ShapeDtypeStruct((2, 256, 4, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 256, 2, head_dim), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((2, 256), jnp.int32)

  def f(q, k, v, ids):
    return flash_attention(
      q, k, v, causal=True, window=(100, 0), q_segment_ids=ids, kv_segment_ids=ids, backend='tpu'
    )

  def loss(q, k, v, ids):
    return f(q, k, v, ids).astype(jnp.float32).sum()

  assert 'tpu_custom_call' in _lower(f, 'tpu', q, kv, kv, ids)
  grad_text = _lower(jax.grad(loss, argnums=(0, 1, 2)), 'tpu', q, kv, kv, ids)
  assert grad_text.count('tpu_custom_call') >= 3  # forward, dQ and dK/dV kernels
