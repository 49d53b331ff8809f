"""Rematerialisation of a block that saves memory on every backend, scanned or not: `remat`, and
the policies a config may name (`REMAT_POLICIES`)."""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import lift

REMAT_POLICIES = {
  'full': None,  # save nothing, recompute the whole block
  # Keep the weight matmuls' outputs (attention's batched einsums are recomputed, as is the rest).
  'save_matmuls': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


# Rematerialisation ---------------------------------------------------------------------------
# jax.checkpoint alone does not save memory in an unscanned stack on XLA:CPU: its guard against
# CSE, an optimization barrier on the residuals (and cotangents) in the backward, is removed by
# XLA:CPU before CSE runs, which then merges each recomputed forward back into the original one
# (the activations stay live from forward to backward, as without remat). Here the residuals
# instead get a data dependence on the block's incoming cotangent: `x + 0 * ct[0]`, which no
# backend may fold (0 * NaN is NaN), so the recomputation can neither be merged with the forward
# nor scheduled before the backward reaches the block. It is exact for finite cotangents.
def _tie_to_cotangent(residuals, ct):
  """`residuals` with each numeric leaf made to depend on the first float leaf of `ct`."""
  floats = [c for c in jax.tree.leaves(ct) if jnp.issubdtype(c.dtype, jnp.inexact)]
  if not floats:
    return residuals
  zero = floats[0].ravel()[0] * 0  # a traced 0: the dependence, not a constant XLA may fold

  def tie(r):
    if jnp.issubdtype(r.dtype, jnp.inexact) or jnp.issubdtype(r.dtype, jnp.integer):
      return r + zero.astype(r.dtype)
    return r  # bool masks and PRNG keys: cheap to rebuild, and `+` does not apply

  return jax.tree.map(tie, residuals)


def _checkpoint(fn: Callable, policy: Callable | None) -> Callable:
  """`jax.checkpoint(fn, policy=policy)` whose recomputation waits for the output cotangent."""

  def call(*args):
    # Trace `fn` once, here: flax's scope functions are stateful (RNG counters), and custom_vjp
    # would retrace them later (inside nn.scan, with other dropout masks than the forward's).
    pure, consts = jax.closure_convert(fn, *args)
    rematted = jax.checkpoint(pure, policy=policy, prevent_cse=False)  # the tie prevents CSE

    @jax.custom_vjp
    def checkpointed(*args):
      return pure(*args)

    def forward(*args):
      return jax.vjp(rematted, *args)  # residuals: the inputs and what `policy` saves

    def backward(vjp_fn, ct):
      return _tie_to_cotangent(vjp_fn, ct)(ct)  # recompute the block, then its vjp

    checkpointed.defvjp(forward, backward)
    return checkpointed(*args, *consts)

  return call


def _lift_checkpoint(fn: Callable, policy: Callable | None) -> Callable:
  """`flax.core.lift.checkpoint` with `_checkpoint` in place of `jax.checkpoint`."""

  def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args):
    def pure(variable_groups, rng_groups, *args):
      scope = scope_fn(variable_groups, rng_groups)
      return fn(scope, *args), repack_fn(scope)

    return _checkpoint(pure, policy)(variable_groups, rng_groups, *args)

  return lift.pack(inner, (True,), (True,), (True,), name='remat')


def remat(module: type[nn.Module], policy: Callable | None) -> type[nn.Module]:
  """`nn.remat(module, policy=policy)` that saves memory on every backend, scanned or not.

  The parameter tree is that of `module`: only the gradient computation changes.
  """
  return nn.transforms.lift_transform(_lift_checkpoint, module, policy=policy)
