"""The residual blocks and the stack that runs them: `Block` (an encoder's or a decoder-only
model's layer), `CrossBlock` (the 2017 decoder's, with cross attention) and `Stack` (a loop or a
scan of blocks, rematerialised or not). Every variant inside comes from `parts.parts(cfg)`, which
the family passes in."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import lift

from transformer.config import ModelConfig
from transformer.model.attention import CacheMode, MaskSpec, MultiHeadAttention
from transformer.model.layers import HookPoint, constrain, kernel_init, residual_out_init

Array = jax.Array


class Block(nn.Module):
  """One layer of an encoder or a decoder-only model: self attention, then the MLP (none when
  `d_ff=0`: attention only), each wrapped in the residual wiring that `parts` picked.

  `scanned=True` returns `(x, None)` for `nn.scan`. With `cache_mode`, the attention decodes with
  a KV cache (see `attention.CacheMode`).
  """

  cfg: ModelConfig
  parts: Any  # parts.Parts of cfg: the norm, wiring, MLP, ... this model has
  num_layers: int  # depth of the stack, for the scaled init
  deterministic: bool = True
  scanned: bool = False
  cache_mode: CacheMode | None = None

  @nn.compact
  def __call__(self, x: Array, mask: MaskSpec, positions: Array | None, *context):
    """x [B, T, D]; mask: self attention's; positions [B or 1, T] or None. Returns [B, T, D]."""
    p, out_init = self.parts, residual_out_init(self.cfg, self.num_layers)
    # One dropout module for every sub-layer's output, and the tokens' segment ids [B, T] (0 =
    # padding, which BatchNorm's statistics skip): what each sub-layer's wiring needs.
    wiring = (nn.Dropout(self.cfg.dropout_rate), mask.q_segment_ids)
    x = HookPoint(name='hook_resid_pre')(x)  # [B, T, D]
    # Self attention: causal in a decoder, not in an encoder (the mask says which).
    attention = self._attention('self_attention', out_init, p.relative_positions)
    conv = p.short_conv(name='short_conv') if p.short_conv else None
    mix = lambda h: attention(
      conv(h, mask, positions, self.cache_mode) if conv else h,
      mask=mask,
      positions=positions,
      deterministic=self.deterministic,
      cache_mode=self.cache_mode,
    )
    x = self._sublayer(x, mix, 'self_attention', 'hook_attn_out', wiring)  # [B, T, D]
    x = self._after_attention(x, wiring, out_init, *context)
    x = constrain(x, ('batch', 'length', 'embed'))  # [B, T, D]
    x = HookPoint(name='hook_resid_post')(x)
    return (x, None) if self.scanned else x

  def _sublayer(self, x: Array, fn: Callable, name: str, hook: str, wiring) -> Array:
    """x [B, T, D] through `fn` (its output hooked as `hook`) in the residual wiring."""
    (drop, segments), norm = wiring, self.parts.norm(name=f'{name}_norm')
    return self.parts.sublayer(
      x,
      lambda h: HookPoint(name=hook)(fn(h)),
      lambda h: norm(h, segments, self.deterministic),
      lambda h: drop(h, deterministic=self.deterministic),
    )

  def _attention(self, name: str, out_init: Callable, relative_positions) -> nn.Module:
    p = self.parts
    return MultiHeadAttention(
      self.cfg,
      p.attention,
      kernel_init(self.cfg),
      out_init,
      relative_positions,
      p.qk_norm,
      name=name,
    )

  def _after_attention(self, x: Array, wiring, out_init: Callable) -> Array:
    """The MLP sub-layer, if the model has one; attention-only layers end here (TransformerLens
    then has no hook_resid_mid)."""
    if not self.parts.mlp:
      return x
    return self._mlp(HookPoint(name='hook_resid_mid')(x), wiring, out_init)

  def _mlp(self, x: Array, wiring, out_init: Callable) -> Array:
    ffn = self.parts.mlp(self.cfg, out_init, name='mlp')
    return self._sublayer(x, lambda h: ffn(h, self.deterministic), 'mlp', 'hook_mlp_out', wiring)


class CrossBlock(Block):
  """A layer of the 2017 decoder: causal self attention, cross attention to the encoder output,
  then the MLP. Called as (x, self_mask, positions, encoded [B, S, D], cross_mask)."""

  def _after_attention(self, x, wiring, out_init, encoded, cross_mask):
    x = HookPoint(name='hook_resid_mid')(x)
    # RoPE and ALiBi act in self attention only: decoder and encoder positions index different
    # sequences, so their distance means nothing. Queries from x [B, T, D], keys/values from the
    # encoder output [B, S, D].
    attention = self._attention('cross_attention', out_init, None)
    attend = lambda h: attention(
      h, encoded, mask=cross_mask, deterministic=self.deterministic, cache_mode=self.cache_mode
    )
    x = self._sublayer(x, attend, 'cross_attention', 'hook_cross_attn_out', wiring)
    return self._mlp(x, wiring, out_init) if self.parts.mlp else x


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


class Stack(nn.Module):
  """`num_layers` blocks, run as `parts` picked (a loop or a scan, each block rematerialised or
  not), then the final norm of pre-norm wiring."""

  cfg: ModelConfig
  parts: Any  # parts.Parts of cfg
  num_layers: int
  block: type[nn.Module] = Block  # CrossBlock in the 2017 decoder

  @nn.compact
  def __call__(self, x, mask: MaskSpec, positions, *context, deterministic: bool, cache_mode=None):
    """x [B, T, D] -> [B, T, D]; `context`: the block's extra arguments (CrossBlock's)."""
    p = self.parts
    block = functools.partial(
      p.remat(self.block),
      cfg=self.cfg,
      parts=p,
      num_layers=self.num_layers,
      deterministic=deterministic,
      cache_mode=cache_mode,
    )
    x = p.layers(block, self.num_layers, x, mask, positions, *context)  # [B, T, D]
    if p.final_norm:  # pre-norm's residual stream was never normalised
      x = p.norm(name='final_norm')(x, mask.q_segment_ids, deterministic)
    return x  # [B, T, D]
