"""`dot_general` for the weight matmuls of Dense/DenseGeneral, as one 2-D matmul with its own VJP.

XLA:CPU runs the autodiff transpose of a [B, T, D] x [D, ...] dot_general (a weight gradient that
contracts B and T together) as transposed copies plus an unfused dot; flattened to
[B*T, D] @ [D, F], with the weight gradient written as x.T @ g, the same sums run as plain matmuls
(a char_lm step 1.4x as fast). Only on CPU: elsewhere it is `lax.dot_general`.
"""

from __future__ import annotations

import math

import jax
from jax import lax


@jax.custom_vjp
def _mm(x, w):  # [M, K] @ [K, N] -> [M, N]
  return x @ w


def _mm_fwd(x, w):
  return x @ w, (x, w)


def _mm_bwd(res, g):
  x, w = res
  return g @ w.T, x.T @ g  # d x [M, K], d w [K, N]


_mm.defvjp(_mm_fwd, _mm_bwd)


def dot_general(
  lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **options
):
  """`lax.dot_general` for lhs [..., *C] and rhs [*C, ...] contracting the C axes, no batch axes;
  anything else goes to `lax.dot_general` unchanged."""
  (lc, rc), (lb, rb) = dimension_numbers
  n = len(lc)
  plain = (
    not lb
    and not rb
    and tuple(lc) == tuple(range(lhs.ndim - n, lhs.ndim))
    and tuple(rc) == tuple(range(n))
    and precision is None
    and preferred_element_type is None
    and lhs.dtype == rhs.dtype
    and not any(v is not None for v in options.values())  # e.g. a newer flax's out_sharding
  )
  if not plain or jax.default_backend() != 'cpu':  # GPU and TPU transpose dot_general well
    return lax.dot_general(
      lhs, rhs, dimension_numbers, precision, preferred_element_type, **options
    )
  k = math.prod(rhs.shape[:n])
  out = _mm(lhs.reshape(-1, k), rhs.reshape(k, -1))
  return out.reshape(lhs.shape[: lhs.ndim - n] + rhs.shape[n:])
