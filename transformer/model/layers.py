"""Building blocks: embeddings, norms, feed-forward and the one residual block every family uses."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import lift

from transformer import sharding
from transformer.config import ModelConfig
from transformer.model import positions as positions_lib
from transformer.model.attention import CacheMode, MaskSpec, MultiHeadAttention
from transformer.model.primitives import BatchNorm, HookPoint, Norm, dot_general

Array = jax.Array


# Initialisation ------------------------------------------------------------------------------
def kernel_init(cfg: ModelConfig) -> Callable:
  """The weight initialiser of every projection: Xavier uniform (paper) or normal(init_std)."""
  if cfg.init_distribution == 'normal':
    return nn.initializers.normal(cfg.init_std)  # GPT-2 / BERT: std 0.02
  # Xavier scales by fan-in + fan-out, keeping activation variance about constant per layer.
  return nn.initializers.xavier_uniform()


def residual_out_init(cfg: ModelConfig, num_layers: int) -> Callable:
  """Init of projections that write into the residual stream (attention out, second FFN layer).

  The 'scaled' scheme shrinks them by 1/sqrt(2 * num_layers), so that each residual branch starts
  near zero and the stack near the identity (GPT-2, T5-style); 'plain' leaves them alone;
  'large' multiplies them by sqrt(2 * num_layers), the deliberate opposite, for ablations.
  """
  base = kernel_init(cfg)
  if cfg.init == 'plain':
    return base
  # Each layer adds two residual branches (attention, FFN): 2 * num_layers in all. Scaling each
  # by 1/sqrt(2L) keeps the variance of their sum O(1) instead of growing with depth.
  factor = math.sqrt(2 * num_layers) ** (1 if cfg.init == 'large' else -1)

  def init(key, shape, dtype=jnp.float32):  # same shape as base, times `factor`
    return base(key, shape, dtype) * jnp.asarray(factor, dtype)

  return init


def embedding_init(cfg: ModelConfig) -> Callable:
  """Token embeddings: std d_model^-0.5 when they are scaled up by sqrt(d_model), else init_std."""
  # d_model^-0.5 x sqrt(d_model) = 1: the scaled embedding has unit-variance entries, the scale
  # of the sinusoids it is added to; the tied output projection sees the small, unscaled table.
  std = cfg.d_model**-0.5 if cfg.scale_embeddings else cfg.init_std
  return nn.initializers.normal(std)


def dense(
  cfg: ModelConfig, features: int, axes: tuple, name: str, init=None, use_bias=True, matmul=None
) -> nn.Dense:
  """A projection to `features` in `cfg`'s dtypes, its kernel on the logical `axes` (initialised
  by `init`, default `kernel_init(cfg)`) and its bias on the output axis; `matmul`: the
  dot_general (default lax's)."""
  return nn.Dense(
    features,
    use_bias=use_bias,
    dtype=cfg.compute_dtype,
    param_dtype=cfg.params_dtype,
    kernel_init=nn.with_logical_partitioning(init or kernel_init(cfg), axes),
    bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[1:]),  # output axis
    dot_general=matmul,
    name=name,
  )


# Norms ---------------------------------------------------------------------------------------
def make_norm(cfg: ModelConfig, name: str | None = None) -> Norm | BatchNorm:
  """The norm module of `cfg.norm`; call it through `apply_norm`, which feeds BatchNorm."""
  if cfg.norm == 'batchnorm':
    return BatchNorm(
      cfg.norm_eps, cfg.compute_dtype, cfg.params_dtype, use_bias=cfg.norm_bias, name=name
    )
  return Norm(
    cfg.norm, cfg.norm_eps, cfg.compute_dtype, cfg.params_dtype, use_bias=cfg.norm_bias, name=name
  )


def apply_norm(
  cfg: ModelConfig, name: str, x: Array, segments: Array | None, deterministic: bool
) -> Array:
  """The norm `name` of `cfg` on x [B, T, D] -> [B, T, D].

  LayerNorm and RMSNorm work on each token alone. BatchNorm takes its statistics from the real
  tokens of the batch (segment ids [B, T] > 0; None: all of them) while training (not
  `deterministic`), and normalises by its running statistics otherwise.
  """
  norm = make_norm(cfg, name)
  if isinstance(norm, BatchNorm):
    return norm(x, segments, use_running_average=deterministic)
  return norm(x)


# Embeddings ----------------------------------------------------------------------------------
class Embed(nn.Module):
  """Token embedding table [V, D] of `cfg`; `attend` reuses it as the tied output projection."""

  cfg: ModelConfig

  def setup(self):
    cfg = self.cfg
    self.embedding = self.param(  # [V, D]
      'embedding',
      nn.with_logical_partitioning(embedding_init(cfg), ('vocab', 'embed')),
      (cfg.vocab_size, cfg.d_model),
      cfg.params_dtype,
    )

  def __call__(self, tokens: Array) -> Array:
    # FSDP: gather the table's d_model shards first, so the lookup's rows stay batch-sharded.
    table = sharding.constrain(self.embedding, ('vocab', None))
    x = jnp.take(table, tokens, axis=0).astype(self.cfg.compute_dtype)  # [B, T] -> [B, T, D]
    x = sharding.constrain(x, ('batch', 'length', 'embed'))
    if not self.cfg.scale_embeddings:
      return x
    # x sqrt(D): brings entries of std D^-0.5 (see embedding_init) up to the positions' scale.
    return x * jnp.asarray(math.sqrt(self.cfg.d_model), x.dtype)  # [B, T, D]

  def attend(self, x: Array) -> Array:
    """Logits against every embedding: [B, T, D] -> [B, T, V]."""
    # No sqrt(D) here: the scale applies to the lookup only, as in the paper.
    logits = jnp.einsum('btd,vd->btv', x, self.table())  # [B, T, V]
    return sharding.constrain(logits, ('batch', 'length', 'vocab'))

  def table(self) -> Array:
    """The [V, D] table in the compute dtype, as `attend` multiplies by it."""
    return self.embedding.astype(self.cfg.compute_dtype)


class AddPositions(nn.Module):
  """Adds absolute positions (sinusoidal or learned) to embeddings; other schemes pass through."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x: Array, positions: Array | None) -> Array:
    cfg = self.cfg
    if positions is None:
      positions = jnp.arange(x.shape[1])[None]  # [1, T], broadcast over the batch
    # hook_pos_embed: what is added, [B, T, D] like x (TransformerLens repeats it per row).
    hook = lambda table: HookPoint(name='hook_pos_embed')(jnp.broadcast_to(table, x.shape))
    if cfg.position == 'sinusoidal':
      return x + hook(positions_lib.sinusoidal(positions, cfg.d_model).astype(x.dtype))
    if cfg.position == 'learned':
      table = positions_lib.LearnedPositions(
        cfg.max_length,
        cfg.d_model,
        embedding_init=nn.with_logical_partitioning(
          nn.initializers.normal(cfg.init_std), (None, 'embed')
        ),
        param_dtype=cfg.params_dtype,
        name='positions',
      )
      return x + hook(table(positions).astype(x.dtype))  # [B, T, D]
    return x  # 'rope' and 'alibi' act inside attention; 'none' adds nothing


# Feed-forward --------------------------------------------------------------------------------
ACTIVATIONS = {
  'relu': nn.relu,
  # Exact GELU, x * Phi(x), in erf form: XLA:CPU runs it faster than nn.gelu's erfc form.
  'gelu': lambda x: 0.5 * x * (1.0 + jax.lax.erf(x * (1.0 / math.sqrt(2.0)))),
  'gelu_tanh': lambda x: nn.gelu(x, approximate=True),
}


class FeedForward(nn.Module):
  """Position-wise MLP: D -> d_ff -> D with ReLU, GELU (exact or tanh) or SwiGLU."""

  cfg: ModelConfig
  out_init: Callable = nn.initializers.xavier_uniform()

  @nn.compact
  def __call__(self, x: Array, deterministic: bool) -> Array:
    cfg = self.cfg

    def proj(features, name, axes, init=None):
      return dense(cfg, features, axes, name, init, cfg.use_bias, dot_general)

    up = ('embed', 'mlp')  # logical axes of the [D, F] up projections
    if cfg.activation == 'swiglu':
      # SwiGLU: silu(x W_gate) * (x W_in), a gated unit with two up projections (LLaMA).
      pre = HookPoint(name='hook_pre')(proj(cfg.d_ff, 'gate', up)(x))  # [B, T, F]
      linear = HookPoint(name='hook_pre_linear')(proj(cfg.d_ff, 'wi', up)(x))  # [B, T, F]
      h = nn.silu(pre) * linear  # [B, T, F]
    else:
      h = ACTIVATIONS[cfg.activation](HookPoint(name='hook_pre')(proj(cfg.d_ff, 'wi', up)(x)))
    h = sharding.constrain(h, ('batch', 'length', 'mlp'))
    h = nn.Dropout(cfg.ffn_dropout_rate)(h, deterministic=deterministic)
    h = HookPoint(name='hook_post')(h)  # [B, T, F]
    # 'wo' writes into the residual stream, so it takes the block's (maybe scaled) out_init.
    return proj(cfg.d_model, 'wo', ('mlp', 'embed'), self.out_init)(h)  # [B, T, D]


# The residual block --------------------------------------------------------------------------
class ShortConv(nn.Module):
  """A causal depthwise convolution over the last `taps` positions: [B, T, D] -> [B, T, D].

  y[t] = sum_i w[i] * x[t - i] per channel, over positions of the same example (segment) only.
  Before self attention it hands each token its predecessors, the short convolution that H3,
  Zoology's MQAR models and Based put before their sequence mixers: an attention layer above it
  can match a key against the token before each value without first learning a previous-token
  head. Initialised to the identity (w[0] = 1). While decoding, the block's inputs are cached by
  position like the KV cache, so a step reads the `taps - 1` before it.
  """

  taps: int
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array, mask: MaskSpec | None, positions, cache_mode=None) -> Array:
    B, T, D = x.shape
    identity = lambda key, shape, dtype: jnp.zeros(shape, dtype).at[0].set(1.0)
    init = nn.with_logical_partitioning(identity, (None, 'embed'))
    w = self.param('kernel', init, (self.taps, D), self.param_dtype).astype(x.dtype)  # [K, D]
    if cache_mode is not None and cache_mode.phase == 'step':
      if not self.has_variable('cache', 'conv_inputs'):
        raise ValueError("CacheMode 'step' needs the cache that a 'prefill' call filled")
      if T != 1:
        raise ValueError(f'CacheMode step takes one token per row; got {T}')
      cache = self.variable('cache', 'conv_inputs')
      rows, slots = jnp.arange(B), jnp.broadcast_to(positions, (B, 1))[:, 0]  # [B], [B]
      cache.value = cache.value.at[rows, slots].set(x[:, 0])  # [B, L, D]
      back = slots[:, None] - jnp.arange(self.taps)[None]  # [B, K]: the slots read
      taps = cache.value[rows[:, None], jnp.maximum(back, 0)]  # [B, K, D]
      taps = jnp.where((back >= 0)[..., None], taps, 0)
      return jnp.einsum('bkd,kd->bd', taps, w)[:, None]  # [B, 1, D]
    if cache_mode is not None:  # prefill: the prompt's inputs in slots 0..T-1 of L
      if T > cache_mode.length:
        raise ValueError(
          f'a prompt of {T} tokens does not fit a cache of length={cache_mode.length}'
        )
      pad = [(0, 0), (0, cache_mode.length - T), (0, 0)]
      self.variable(
        'cache', 'conv_inputs', jnp.zeros, (B, cache_mode.length, D), x.dtype
      ).value = jnp.pad(x, pad)
    segments = None if mask is None else mask.q_segment_ids  # [B, T]; 0 = padding
    out = x * w[0]
    for i in range(1, self.taps):
      shifted = jnp.pad(x, [(0, 0), (i, 0), (0, 0)])[:, :T]  # x[t - i], 0 before the row
      if segments is not None:  # no tap reaches into the previous packed example
        same = segments == jnp.pad(segments, [(0, 0), (i, 0)])[:, :T]  # [B, T]
        shifted = jnp.where(same[..., None], shifted, 0)
      out = out + shifted * w[i]
    return out  # [B, T, D]


class Block(nn.Module):
  """One Transformer layer: self attention, optional cross attention, feed-forward (none when
  `d_ff=0`: attention only).

  Each sub-layer is `x + dropout(f(norm(x)))` with pre-LN, or `norm(x + dropout(f(x)))` with
  post-LN (the paper). `scanned=True` returns `(x, None)` for `nn.scan`. With `cache_mode`, the
  attentions decode with a KV cache (see `attention.CacheMode`).
  """

  cfg: ModelConfig
  num_layers: int  # depth of the stack, for the scaled init
  cross_attention: bool = False
  deterministic: bool = True
  scanned: bool = False
  cache_mode: CacheMode | None = None

  @nn.compact
  def __call__(
    self,
    x: Array,
    encoded: Array | None,
    self_mask: MaskSpec,
    cross_mask: MaskSpec | None,
    positions: Array | None,
  ):
    """x: [B, T, D]; encoded: [B, S, D] for cross attention. Returns [B, T, D]."""
    cfg = self.cfg
    out_init = residual_out_init(cfg, self.num_layers)
    drop = nn.Dropout(cfg.dropout_rate)
    # x's tokens: segment ids [B, T], 0 = padding (BatchNorm's statistics skip those).
    segments = None if self_mask is None else self_mask.q_segment_ids

    def sublayer(x, fn, name):  # [B, T, D] -> [B, T, D]
      # Pre-LN leaves the residual path un-normalised (stable deep stacks, needs a final norm);
      # post-LN normalises the sum, as in the 2017 paper.
      # residual=False ablates the skip connection: the sub-layer's output replaces x.
      skip = x if cfg.residual else 0
      norm = lambda h: apply_norm(cfg, f'{name}_norm', h, segments, self.deterministic)
      if cfg.norm_placement == 'pre':
        return skip + drop(fn(norm(x)), deterministic=self.deterministic)
      return norm(skip + drop(fn(x), deterministic=self.deterministic))

    # RoPE and ALiBi act in self attention only: in cross attention, decoder and encoder
    # positions index different sequences, so their distance means nothing.
    attention = lambda name: MultiHeadAttention(cfg, kernel_init(cfg), out_init, name=name)

    self_attn = attention('self_attention')
    conv = lambda h: h
    if cfg.short_conv:
      short = ShortConv(cfg.short_conv, param_dtype=cfg.params_dtype, name='short_conv')
      conv = lambda h: short(h, self_mask, positions, self.cache_mode)
    hook = lambda name, h: HookPoint(name=name)(h)  # TransformerLens's names; see hooks.py
    x = hook('hook_resid_pre', x)  # [B, T, D]
    # Self attention: causal in a decoder, not in an encoder (self_mask says which).
    x = sublayer(
      x,
      lambda h: hook(
        'hook_attn_out',
        self_attn(
          conv(h),
          mask=self_mask,
          positions=positions,
          deterministic=self.deterministic,
          cache_mode=self.cache_mode,
        ),
      ),
      'self_attention',
    )  # [B, T, D]
    if cfg.d_ff or self.cross_attention:  # attention-only: resid_post follows (TransformerLens)
      x = hook('hook_resid_mid', x)
    if self.cross_attention:
      cross_attn = attention('cross_attention')
      # Queries from x [B, T, D], keys/values from the encoder output [B, S, D].
      x = sublayer(
        x,
        lambda h: hook(
          'hook_cross_attn_out',
          cross_attn(
            h,
            encoded,
            mask=cross_mask,
            deterministic=self.deterministic,
            cache_mode=self.cache_mode,
          ),
        ),
        'cross_attention',
      )  # [B, T, D]
    if cfg.d_ff:  # d_ff=0: an attention-only layer (Elhage et al. 2021), no MLP sub-layer
      ffn = FeedForward(cfg, out_init, name='mlp')
      x = sublayer(x, lambda h: hook('hook_mlp_out', ffn(h, self.deterministic)), 'mlp')
    x = sharding.constrain(x, ('batch', 'length', 'embed'))  # [B, T, D]
    x = hook('hook_resid_post', x)
    return (x, None) if self.scanned else x


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
  """`num_layers` blocks, optionally rematerialised and/or scanned, plus the pre-LN final norm."""

  cfg: ModelConfig
  num_layers: int
  cross_attention: bool = False

  @nn.compact
  def __call__(
    self,
    x,
    encoded,
    self_mask,
    cross_mask,
    positions,
    deterministic: bool,
    cache_mode: CacheMode | None = None,
  ):
    cfg = self.cfg
    block = Block
    if cfg.remat != 'none':
      # Recompute activations in the backward pass instead of keeping them (see `remat`).
      block = remat(block, REMAT_POLICIES[cfg.remat])
    kwargs = dict(
      cfg=cfg,
      num_layers=self.num_layers,
      cross_attention=self.cross_attention,
      deterministic=deterministic,
      cache_mode=cache_mode,
    )
    # Scanning compiles one block and loops it L times (compile time independent of depth);
    # the Python loop unrolls L separate blocks.
    if cfg.scan_layers and self.num_layers:
      axes = {'params': 0, 'cache': 0}  # each layer its own params and KV cache
      if cfg.norm == 'batchnorm':
        axes['batch_stats'] = 0  # and its own running statistics
      scanned = nn.scan(
        block,
        variable_axes=axes,
        split_rngs={'params': True, 'dropout': True},  # each layer its own init and dropout
        in_axes=(nn.broadcast,) * 4,  # encoded, masks and positions: the same for every layer
        length=self.num_layers,
        metadata_params={nn.PARTITION_NAME: 'layers'},  # stacked params: [layers, ...]
      )
      x, _ = scanned(**kwargs, scanned=True, name='layers')(
        x, encoded, self_mask, cross_mask, positions
      )  # [B, T, D]; x is the carry
    else:
      for i in range(self.num_layers):
        x = block(**kwargs, name=f'layer_{i}')(x, encoded, self_mask, cross_mask, positions)
    if cfg.norm_placement == 'pre':  # pre-LN's residual stream was never normalised
      segments = None if self_mask is None else self_mask.q_segment_ids  # [B, T]
      x = apply_norm(cfg, 'final_norm', x, segments, deterministic)
    return x  # [B, T, D]
