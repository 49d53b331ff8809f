"""Memory scaling of attention gradients, from XLA's compiled memory analysis (compile only).

'chunked' must need temp memory linear in T; the dense 'xla' path is the control that grows ~T^2.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from transformer.model.attention import MaskSpec, dot_product_attention

LENGTHS = (512, 1024, 2048)
B, N, H = 1, 2, 32


def gradient_temp_bytes(implementation: str, T: int) -> int:
  """Temp bytes of the compiled d/d(q, k, v) of sum(out * cot) for self attention of length T."""

  def loss(q, k, v, cot):
    out = dot_product_attention(
      q, k, v, mask=MaskSpec(causal=False), implementation=implementation, chunk_size=128
    )  # [B, T, N, H]
    return jnp.sum(out * cot)

  shape = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  memory = grad.lower(shape, shape, shape, shape).compile().memory_analysis()
  if memory is None:
    pytest.skip(f'no compiled memory analysis on backend {jax.default_backend()!r}')
  return memory.temp_size_in_bytes


@functools.cache
def temps(implementation: str) -> tuple[int, ...]:
  """Gradient temp bytes at each T in LENGTHS."""
  return tuple(gradient_temp_bytes(implementation, T) for T in LENGTHS)


def test_chunked_gradient_memory_grows_linearly():
  t = temps('chunked')
  ratios = [b / a for a, b in zip(t, t[1:])]  # growth per doubling of T
  assert all(r < 2.6 for r in ratios), f'chunked temp {t} grew {ratios} per doubling of T'


def test_xla_gradient_memory_grows_quadratically():
  # The control: the same measurement tells dense [T, S] logits apart from linear memory. XLA's
  # CPU buffer assignment does not grow 4x at every doubling (1024 -> 2048 is ~2.4x with these
  # shapes), so check the quadratic floor at every T and the growth over the whole sweep, which
  # must exceed what the linear bound above allows for two doublings (2.6^2).
  t = temps('xla')
  for T, temp in zip(LENGTHS, t):
    logits = B * N * T * T * 4  # one float32 [B, N, T, T] block
    assert temp >= logits, f'xla temp {temp} at T={T} is below one dense logits block {logits}'
  assert t[-1] / t[0] > 2.6**2, f'xla temp {t} grew only {t[-1] / t[0]:.2f}x over {LENGTHS}'
