"""The weight matmul of every projection on CPU (model.layers.cpu_matmul): values and gradients
against lax.dot_general and float64 NumPy, at awkward shapes, and where `dense` uses it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from transformer.config import ModelConfig
from transformer.model import layers


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

  got = layers.cpu_matmul(x, w, numbers)
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  want = np.tensordot(x64, w64, axes=contract)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  grads = jax.grad(loss(layers.cpu_matmul), argnums=(0, 1))(x, w)
  reference = jax.grad(loss(lax.dot_general), argnums=(0, 1))(x, w)
  for g, r in zip(grads, reference):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)
  c64 = np.asarray(cotangent, np.float64)  # float64 NumPy: dW = x^T g over the flattened rows
  k = int(np.prod(rhs[:contract]))
  dw = x64.reshape(-1, k).T @ c64.reshape(-1, int(np.prod(rhs[contract:])))
  np.testing.assert_allclose(np.asarray(grads[1]).reshape(dw.shape), dw, rtol=1e-4, atol=1e-4)


def test_dense_takes_it_on_cpu_only_where_asked_and_computes_what_lax_does():
  cfg = ModelConfig(vocab_size=11, d_model=6, num_heads=2, d_ff=10, num_layers=1, max_length=8)
  x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 2, 3)), jnp.float32)
  for axis, features, axes in ((-1, 7, ('kv', 'mlp')), ((-2, -1), 5, ('heads', 'kv', 'embed'))):
    fast = layers.dense(cfg, features, axes, 'p', axis=axis, matmul=True)
    plain = layers.dense(cfg, features, axes, 'p', axis=axis)
    params = plain.init(jax.random.key(0), x)
    assert fast.dot_general is (layers.cpu_matmul if jax.default_backend() == 'cpu' else None)
    assert plain.dot_general is None  # lax.dot_general
    np.testing.assert_allclose(fast.apply(params, x), plain.apply(params, x), rtol=1e-6, atol=1e-6)
