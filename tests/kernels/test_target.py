"""The compile target, not this process's backend, picks the attention kernel."""

import jax
import jax.numpy as jnp
import pytest
from jax._src.mesh import AbstractDevice

from transformer.kernels import flash_attention, target
from transformer.model.attention import MaskSpec, dot_product_attention


def _target(kind, platform='gpu'):
  """A mesh context naming a device that this CPU-only machine does not have."""
  mesh = jax.sharding.AbstractMesh((1,), ('x',), abstract_device=AbstractDevice(kind, 1, platform))
  return jax.sharding.use_abstract_mesh(mesh)


def _lower(fn, *args):
  return jax.jit(fn).trace(*args).lower(lowering_platforms=('cuda',)).as_text()


@pytest.mark.parametrize(
  'kind, capability',
  [
    ('NVIDIA H200', 9.0),
    ('NVIDIA H100 80GB HBM3', 9.0),
    ('NVIDIA A100-SXM4-80GB', 8.0),
    ('NVIDIA A10G', 8.6),
    ('NVIDIA B200', 10.0),
    ('Some future GPU', None),
  ],
)
def test_capability_comes_from_the_target_kind(kind, capability):
  with _target(kind):
    where = target.current()
  assert (where.platform, where.device_kind, where.compute_capability) == ('gpu', kind, capability)
  assert where.compiles_kernels


def test_without_a_mesh_the_local_device_decides():
  where = target.current()
  local = jax.local_devices()[0]
  assert where.device_kind == local.device_kind
  assert where.compiles_kernels == (jax.default_backend() in ('gpu', 'tpu'))


@pytest.mark.parametrize(
  'kind, marker, absent',
  [('NVIDIA H200', 'mosaic_gpu', 'triton'), ('NVIDIA A100-SXM4-80GB', 'triton', 'mosaic_gpu')],
)
def test_pallas_compiles_the_targets_kernel(kind, marker, absent):
  """Under an H200 target 'pallas' lowers the Mosaic GPU kernel, under an A100 one Triton; in
  neither case the interpreter (which would lower to plain HLO loops, not a custom call)."""
  q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  attend = lambda q, k, v: dot_product_attention(
    q, k, v, mask=MaskSpec(causal=True), implementation='pallas'
  )
  with _target(kind):
    text = _lower(attend, q, q, q)
  assert marker in text and absent not in text


def test_cudnn_is_accepted_for_an_nvidia_target_only():
  q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
  attend = lambda q, k, v: dot_product_attention(q, k, v, implementation='cudnn')
  with _target('NVIDIA H200'):
    try:  # past sparrow's check, JAX's cuDNN lowering needs the CUDA plugin and real devices
      assert 'cudnn' in _lower(attend, q, q, q).lower()
    except (RuntimeError, ValueError) as error:
      assert 'needs an NVIDIA GPU' not in str(error)
      assert 'cuDNN is not detected' in str(error) or 'require devices' in str(error)
  with _target('TPU v5 lite', 'tpu'), pytest.raises(ValueError, match="'TPU v5 lite'"):
    _lower(attend, q, q, q)
  if jax.default_backend() == 'cpu':
    with pytest.raises(ValueError, match="needs an NVIDIA GPU, but the target is 'cpu'"):
      _lower(attend, q, q, q)


def test_mosaic_refuses_an_older_target():
  q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
  with _target('NVIDIA A100-SXM4-80GB'), pytest.raises(ValueError, match='A100'):
    jax.jit(lambda q: flash_attention(q, q, q, backend='mosaic_gpu')).trace(q)
