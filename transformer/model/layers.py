"""Building blocks: embeddings, positions, feed-forward, the residual blocks and the stack.

Each variant is its own small module or function; `parts.parts(cfg)` picks them once, when the
model is built, and the blocks call what it picked without asking the config again.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer import sharding
from transformer.config import ModelConfig
from transformer.model import positions as positions_lib
from transformer.model.attention import MaskSpec
from transformer.model.primitives import HookPoint, dot_general

Array = jax.Array


# Initialisation ------------------------------------------------------------------------------
# Each initialiser is made once per config (the config is frozen), not again at every apply.
@functools.cache
def kernel_init(cfg: ModelConfig) -> Callable:
  """The weight initialiser of every projection: Xavier uniform (paper) or normal(init_std)."""
  if cfg.init_distribution == 'normal':
    return nn.initializers.normal(cfg.init_std)  # GPT-2 / BERT: std 0.02
  # Xavier scales by fan-in + fan-out, keeping activation variance about constant per layer.
  return nn.initializers.xavier_uniform()


@functools.cache
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


@functools.cache
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
    return sharding.constrain(x, ('batch', 'length', 'embed'))  # [B, T, D]

  def attend(self, x: Array) -> Array:
    """Logits against every embedding: [B, T, D] -> [B, T, V]."""
    # No sqrt(D) here: the scale applies to the lookup only, as in the paper.
    logits = jnp.einsum('btd,vd->btv', x, self.table())  # [B, T, V]
    return sharding.constrain(logits, ('batch', 'length', 'vocab'))

  def table(self) -> Array:
    """The [V, D] table in the compute dtype, as `attend` multiplies by it."""
    return self.embedding.astype(self.cfg.compute_dtype)


class ScaledEmbed(Embed):
  """`Embed` whose lookups are multiplied by sqrt(d_model) (the paper's); the tied output
  projection uses the table unscaled."""

  def __call__(self, tokens: Array) -> Array:
    x = super().__call__(tokens)  # [B, T, D]
    # x sqrt(D): brings entries of std D^-0.5 (see embedding_init) up to the positions' scale.
    return x * jnp.asarray(math.sqrt(self.cfg.d_model), x.dtype)  # [B, T, D]


def _hook_pos_embed(table: Array, x: Array) -> Array:
  """hook_pos_embed: what is added, [B, T, D] like x (TransformerLens repeats it per row)."""
  return HookPoint(name='hook_pos_embed')(jnp.broadcast_to(table, x.shape))


class AddSinusoidal(nn.Module):
  """x [B, T, D] + the paper's sinusoids of `positions` [B or 1, T]."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x: Array, positions: Array) -> Array:
    table = positions_lib.sinusoidal(positions, self.cfg.d_model).astype(x.dtype)
    return x + _hook_pos_embed(table, x)  # [B, T, D]


class AddLearned(nn.Module):
  """x [B, T, D] + a learned [max_length, D] table at `positions` [B or 1, T] (GPT-2, BERT)."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x: Array, positions: Array) -> Array:
    cfg = self.cfg
    table = positions_lib.LearnedPositions(
      cfg.max_length,
      cfg.d_model,
      embedding_init=nn.with_logical_partitioning(
        nn.initializers.normal(cfg.init_std), (None, 'embed')
      ),
      param_dtype=cfg.params_dtype,
      name='positions',
    )
    return x + _hook_pos_embed(table(positions).astype(x.dtype), x)  # [B, T, D]


class Embedder(nn.Module):
  """Token embedding + absolute positions (if the model has them) + dropout: [B, T] -> [B, T, D]."""

  cfg: ModelConfig
  embed: nn.Module  # the token table (shared with a tied output head)
  positions: Callable | None = None  # parts.absolute_positions: AddLearned, AddSinusoidal or None

  @nn.compact
  def __call__(self, tokens, positions=None, *, deterministic: bool, segments=None, **extra):
    """tokens [B, T]; positions [B or 1, T] or None (0, 1, ...); segments [B, T] (0 = padding)
    for BatchNorm's statistics; `extra`: TypedEmbedder's token types."""
    x = HookPoint(name='hook_embed')(self.embed(tokens))  # [B, T, D]
    if self.positions is not None:  # learned or sinusoidal; RoPE and ALiBi act in attention
      positions = jnp.arange(x.shape[1])[None] if positions is None else positions  # [1, T]
      x = self.positions(self.cfg, name='positions')(x, positions)  # [B, T, D]
    x = self._more(x, tokens, segments, deterministic, **extra)
    # Logical axis names; config.mesh.rules map them to mesh axes (see transformer/sharding.py).
    x = sharding.constrain(x, ('batch', 'length', 'embed'))
    return nn.Dropout(self.cfg.dropout_rate)(x, deterministic=deterministic)  # [B, T, D]

  def _more(self, x: Array, tokens: Array, segments, deterministic: bool) -> Array:
    return x


class TypedEmbedder(Embedder):
  """BERT's embedder: also sentence A/B token types (type_vocab_size > 0) and a norm over the
  summed embeddings (`norm`, when embedding_norm)."""

  norm: Callable | None = None  # parts.norm, or None

  def _more(self, x, tokens, segments, deterministic, token_types=None):
    cfg = self.cfg
    if cfg.type_vocab_size:  # BERT's sentence A/B embedding
      token_types = jnp.zeros_like(tokens) if token_types is None else token_types  # [B, T]
      types = nn.Embed(
        cfg.type_vocab_size,
        cfg.d_model,
        embedding_init=nn.with_logical_partitioning(
          nn.initializers.normal(cfg.init_std), (None, 'embed')
        ),
        param_dtype=cfg.params_dtype,
        dtype=cfg.compute_dtype,
        name='token_types',
      )
      x = x + HookPoint(name='hook_token_type_embed')(types(token_types))  # [B, T, D]
    if self.norm is not None:  # BERT normalises the summed embeddings
      x = self.norm(name='norm')(x, segments, deterministic)
    return x


# Feed-forward --------------------------------------------------------------------------------
ACTIVATIONS = {
  'relu': nn.relu,
  # Exact GELU, x * Phi(x), in erf form: XLA:CPU runs it faster than nn.gelu's erfc form.
  'gelu': lambda x: 0.5 * x * (1.0 + jax.lax.erf(x * (1.0 / math.sqrt(2.0)))),
  'gelu_tanh': lambda x: nn.gelu(x, approximate=True),
}


class FeedForward(nn.Module):
  """Position-wise MLP: D -> d_ff -> D with ReLU or GELU (exact or tanh) between."""

  cfg: ModelConfig
  out_init: Callable = nn.initializers.xavier_uniform()

  def _proj(self, features: int, name: str, axes: tuple, init=None) -> nn.Dense:
    return dense(self.cfg, features, axes, name, init, self.cfg.use_bias, dot_general)

  @nn.compact
  def __call__(self, x: Array, deterministic: bool) -> Array:
    cfg = self.cfg
    h = ACTIVATIONS[cfg.activation](HookPoint(name='hook_pre')(self._up(x)))  # [B, T, F]
    return self._down(h, deterministic)

  def _up(self, x: Array, name: str = 'wi') -> Array:
    """x [B, T, D] -> [B, T, F] by the up projection `name` (logical axes embed, mlp)."""
    return self._proj(self.cfg.d_ff, name, ('embed', 'mlp'))(x)

  def _down(self, h: Array, deterministic: bool) -> Array:
    """The hidden h [B, T, F] -> [B, T, D], after the hidden dropout and hook_post."""
    h = sharding.constrain(h, ('batch', 'length', 'mlp'))
    h = nn.Dropout(self.cfg.ffn_dropout_rate)(h, deterministic=deterministic)
    h = HookPoint(name='hook_post')(h)  # [B, T, F]
    # 'wo' writes into the residual stream, so it takes the block's (maybe scaled) out_init.
    return self._proj(self.cfg.d_model, 'wo', ('mlp', 'embed'), self.out_init)(h)  # [B, T, D]


class GatedFeedForward(FeedForward):
  """SwiGLU: silu(x W_gate) * (x W_in), a gated unit with two up projections (LLaMA)."""

  @nn.compact
  def __call__(self, x: Array, deterministic: bool) -> Array:
    pre = HookPoint(name='hook_pre')(self._up(x, 'gate'))  # [B, T, F]
    linear = HookPoint(name='hook_pre_linear')(self._up(x, 'wi'))  # [B, T, F]
    return self._down(nn.silu(pre) * linear, deterministic)


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
