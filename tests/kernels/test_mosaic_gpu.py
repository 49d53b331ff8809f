"""Tests for transformer/kernels/mosaic_gpu.py, the Hopper kernel, on CPU.

Numerics: the warp-specialised kernels themselves (TMA ring, barriers, both compute warpgroups,
block skipping, masks) run in Pallas's GPU interpreter against float64; only the wgmma calls are
spelled as plain dots there. About 4 minutes on 2 busy cores with jax 0.10 (~1.5 with 0.12).
Lowering: forward and gradient lower to Mosaic GPU for 'cuda'.
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_flash_attention import _check, _inputs, _reference_np, _rel, _target_h200

from transformer.kernels import BlockSizes, flash_attention

fa = importlib.import_module(
  'transformer.kernels.flash_attention'
)  # the module (the package exports the fn)

# Tiles that make short sequences span several key blocks, so the two-slot ring wraps around.
RING = BlockSizes(block_q=64, block_k=64, block_q_dkv=64, block_k_dkv=64, num_stages=2)
TOL = {jnp.bfloat16: 2e-2, jnp.float16: 4e-3}


def _run(q, k, v, g, dtype, block_sizes=RING, **mask):
  return _check(q, k, v, g, TOL[dtype], 'mosaic_gpu', block_sizes=block_sizes, **mask)


class TestInterpretMosaicGPU:
  """The Mosaic GPU kernels run by the Pallas GPU interpreter, bf16 unless noted."""

  def test_causal_gqa_unaligned(self):
    # S=200 keys: 4 blocks through the 2-slot ring, a padded tail; 2 query heads share a kv head.
    _run(*_inputs(1, 100, 200, 2, 1, 64, jnp.bfloat16, seed=1), jnp.bfloat16, causal=True)

  def test_plain_float16_cross_attention(self):
    # T != S and no mask but the padded key tail; float16, scale given. One head here and in the
    # two tests below: the interpreter's time grows with heads, and GQA is covered above and by
    # the head dim 256 test.
    _run(*_inputs(1, 70, 150, 1, 1, 64, jnp.float16, seed=2), jnp.float16, scale=0.3)

  def test_padding_and_packed_segments(self):
    q, k, v, g = _inputs(1, 100, 100, 1, 1, 64, jnp.bfloat16, seed=4)
    seg = np.repeat([[1, 2, 0]], [30, 40, 30], axis=1).astype(np.int32)  # packed, then padding
    out, (dq, _, _) = _run(q, k, v, g, jnp.bfloat16, causal=True, q_seg=seg, kv_seg=seg)
    assert np.all(np.asarray(out, np.float32)[0, 70:] == 0)  # fully masked rows
    assert np.all(np.asarray(dq, np.float32)[0, 70:] == 0)

  def test_sliding_window(self):
    _run(*_inputs(1, 100, 100, 1, 1, 64, jnp.bfloat16, seed=3), jnp.bfloat16, window=(30, 5))

  @pytest.mark.parametrize('head_dim', [pytest.param(128, marks=pytest.mark.slow), 256])
  def test_larger_head_dims(self, head_dim):
    # 256 runs the backward with one compute warpgroup per CTA (SMEM); default blocks. 128 is
    # slow (~40 s on 2 busy cores) and adds only a head dim to what the others cover.
    _run(
      *_inputs(1, 40, 40, 2, 1, head_dim, jnp.bfloat16, seed=head_dim),
      jnp.bfloat16,
      block_sizes=None,
      causal=True,
    )

  def test_skipped_blocks_are_never_read(self):
    # Window (20, 0) over T=256: query CTA 1 (rows 128..255) never streams key block 0, and
    # its second warpgroup (rows 192..255) skips block 1 that its first one needs. NaN there
    # would turn rows into NaN if a kernel computed on a block it should skip. One head: the
    # blocks a CTA reads do not depend on it, and the interpreter's time grows with heads.
    q, k, v, _ = _inputs(1, 256, 256, 1, 1, 64, jnp.bfloat16, seed=8)
    k_bad, v_bad = k.at[:, :64].set(jnp.nan), v.at[:, :64].set(jnp.nan)
    kw = dict(window=(20, 0), block_sizes=RING, backend='mosaic_gpu', interpret=True)
    out = flash_attention(q, k_bad, v_bad, **kw)
    bad = flash_attention(q, k.at[:, 64:128].set(jnp.nan), v.at[:, 64:128].set(jnp.nan), **kw)
    ref, _ = _reference_np(q, k, v, np.zeros(q.shape), window=(20, 0))
    assert np.isfinite(np.asarray(out[:, 128:], np.float32)).all()
    assert _rel(out[:, 128:], ref[:, 128:]) <= TOL[jnp.bfloat16]
    assert np.isfinite(np.asarray(bad[:, 192:], np.float32)).all()
    assert _rel(bad[:, 192:], ref[:, 192:]) <= TOL[jnp.bfloat16]
    assert np.isnan(np.asarray(bad[:, 128:192], np.float32)).any()  # the test can fail


def _lower(fn, *args):
  return jax.jit(fn).trace(*args).lower(lowering_platforms=('cuda',)).as_text()


MASKS = {
  'none': {},
  'causal': dict(causal=True),
  'segments': dict(segments=True),
  'window': dict(window=(100, 0)),
  'all': dict(causal=True, segments=True, window=(64, 0)),
}


# Each head dim once, both dtypes. CI's `gpu_check --deviceless` compiles them all to sm_90a
# (bf16 at every mask, fp16 causal) on the newest jax; this checks the lowering on both stacks.
@pytest.mark.parametrize(
  'head_dim, dtype', [(64, jnp.bfloat16), (128, jnp.float16), (256, jnp.bfloat16)]
)
def test_lowers_for_cuda(head_dim, dtype):
  """Forward and gradient lower to Mosaic GPU for CUDA (SMEM budgets checked) for every mask."""
  q = jax.ShapeDtypeStruct((2, 320, 4, head_dim), dtype)  # 320: not a multiple of the CTA rows
  kv = jax.ShapeDtypeStruct((2, 320, 2, head_dim), dtype)  # GQA: 2 kv heads for 4 query heads
  ids = jax.ShapeDtypeStruct((2, 320), jnp.int32)
  for name, mask in MASKS.items():
    seg = mask.get('segments', False)

    def f(q, k, v, ids, mask=mask, seg=seg):
      kw = dict(causal=mask.get('causal', False), window=mask.get('window'))
      if seg:
        kw.update(q_segment_ids=ids, kv_segment_ids=ids)
      return flash_attention(q, k, v, backend='mosaic_gpu', **kw)

    def loss(q, k, v, ids, f=f):
      return f(q, k, v, ids).astype(jnp.float32).sum()

    fwd = _lower(f, q, kv, kv, ids)
    assert 'sparrow_mgpu_forward' in fwd and 'mosaic_gpu' in fwd, name
    grad = _lower(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, ids)
    for kernel in ('sparrow_mgpu_forward', 'sparrow_mgpu_dq', 'sparrow_mgpu_dkv'):
      assert kernel in grad, (name, kernel)


class TestChoiceAndErrors:
  def _qkv(self, H=64, dtype=jnp.bfloat16):
    x = jnp.zeros((1, 16, 2, H), dtype)
    return x, x, x

  def test_head_dim(self):
    with pytest.raises(ValueError, match=r'head dims \(64, 128, 256\); got H=96.*backend=.gpu'):
      flash_attention(*self._qkv(H=96), backend='mosaic_gpu', interpret=True)

  def test_dtype(self):
    with pytest.raises(ValueError, match=r"dtypes \('bfloat16', 'float16'\); got float32"):
      flash_attention(*self._qkv(dtype=jnp.float32), backend='mosaic_gpu', interpret=True)

  def test_block_sizes(self):
    bad = BlockSizes(block_q=128, block_k=64)
    with pytest.raises(ValueError, match='block_q=128 must be 64'):
      flash_attention(*self._qkv(), backend='mosaic_gpu', block_sizes=bad, interpret=True)
    bad = BlockSizes(block_q=64, block_k=32, block_k_dkv=64)
    with pytest.raises(ValueError, match='block_k=32 must be 64, 128 or 256'):
      flash_attention(*self._qkv(), backend='mosaic_gpu', block_sizes=bad, interpret=True)

  def test_needs_hopper(self, monkeypatch):
    jax.clear_caches()
    monkeypatch.setattr(fa, 'gpu_capability', lambda: ('NVIDIA A100-SXM4-80GB', 8.0))
    with pytest.raises(ValueError, match=r'needs a Hopper \(sm90\).*A100.*backend=.gpu'):
      flash_attention(*self._qkv(), backend='mosaic_gpu')

  @pytest.mark.parametrize(
    'gpu,head_dim,dtype,kernel',
    [
      (('NVIDIA H200', 9.0), 128, jnp.bfloat16, 'mosaic_gpu'),
      (('NVIDIA H200', 9.0), 96, jnp.bfloat16, 'triton'),  # head dim the Hopper kernel lacks
      (('NVIDIA H200', 9.0), 64, jnp.float32, 'triton'),
      (('NVIDIA A100-SXM4-80GB', 8.0), 128, jnp.bfloat16, 'triton'),
    ],
  )
  def test_default_choice(self, monkeypatch, gpu, head_dim, dtype, kernel):
    """backend=None picks Mosaic GPU on sm90+ where it applies, Triton elsewhere."""
    jax.clear_caches()  # the choice is made when flash_attention traces
    monkeypatch.setattr(fa, 'gpu_capability', lambda: gpu)
    q = jax.ShapeDtypeStruct((1, 128, 2, head_dim), dtype)
    with _target_h200():  # Triton needs a named GPU to lower for on jax >= 0.12
      text = _lower(lambda q: flash_attention(q, q, q, causal=True), q)
    assert kernel in text
    assert ('mosaic_gpu' in text) == (kernel == 'mosaic_gpu')
