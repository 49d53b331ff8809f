"""The weight matmul of every Dense layer (model.primitives.dot_general): values and gradients
against lax.dot_general, at awkward shapes, and the cases it hands back unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from transformer.model import primitives


@pytest.mark.parametrize(
  'lhs, rhs, contract',
  [
    ((3, 7, 5), (5, 11), 1),  # Dense: [B, T, D] x [D, F]
    ((2, 3, 5), (5, 4, 6), 1),  # DenseGeneral q/k/v: [B, T, D] x [D, N, H]
    ((2, 9, 4, 6), (4, 6, 5), 2),  # the output projection: [B, T, N, H] x [N, H, D]
    ((13, 5), (5, 1), 1),
  ],
)
def test_values_and_gradients_match_dot_general(lhs, rhs, contract):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=lhs), jnp.float32)
  w = jnp.asarray(rng.normal(size=rhs), jnp.float32)
  numbers = ((tuple(range(len(lhs) - contract, len(lhs))), tuple(range(contract))), ((), ()))
  cotangent = jnp.asarray(rng.normal(size=lhs[: len(lhs) - contract] + rhs[contract:]))

  def loss(f):
    return lambda x, w: jnp.sum(f(x, w, numbers) * cotangent)

  got = primitives.dot_general(x, w, numbers)
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  want = np.tensordot(x64, w64, axes=contract)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  grads = jax.grad(loss(primitives.dot_general), argnums=(0, 1))(x, w)
  reference = jax.grad(loss(lax.dot_general), argnums=(0, 1))(x, w)
  for g, r in zip(grads, reference):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)
  c64 = np.asarray(cotangent, np.float64)  # float64 NumPy: dW = x^T g over the flattened rows
  k = int(np.prod(rhs[:contract]))
  dw = x64.reshape(-1, k).T @ c64.reshape(-1, int(np.prod(rhs[contract:])))
  np.testing.assert_allclose(np.asarray(grads[1]).reshape(dw.shape), dw, rtol=1e-4, atol=1e-4)


def test_batch_axes_and_mixed_dtypes_go_to_dot_general():
  x = jnp.ones((2, 3, 4), jnp.float32)
  batched = (((2,), (1,)), ((0,), (0,)))
  np.testing.assert_array_equal(
    primitives.dot_general(x, jnp.ones((2, 4, 5)), batched),
    lax.dot_general(x, jnp.ones((2, 4, 5)), batched),
  )
  mixed = primitives.dot_general(x, jnp.ones((4, 5), jnp.bfloat16), (((2,), (0,)), ((), ())))
  assert (
    mixed.dtype
    == lax.dot_general(x, jnp.ones((4, 5), jnp.bfloat16), (((2,), (0,)), ((), ()))).dtype
  )
