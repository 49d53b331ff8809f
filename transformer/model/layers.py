"""The pieces every model is built from, and how a block wires and stacks them.

`HookPoint` (an identity where an activation is made, which `hooks.run` reads or replaces), the
sharding constraint, the weight matmul and `dense`, the norms (LayerNorm, RMSNorm), the token
embedding and absolute positions, the MLPs, the residual wirings and the layer loops. Each variant
is its own small module or function; `parts.parts(cfg)` picks them once, when the model is built,
and the blocks call what it picked without asking the config again.
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

Array = jax.Array


# Hook points -------------------------------------------------------------------------------------
class HookPoint(nn.Module):
  """Returns its input. The module's path names the activation in TransformerLens's scheme
  (`hooks.hook_name`: .../layer_3/self_attention/hook_z -> blocks.3.attn.hook_z), and
  `hooks.run` intercepts the call to cache the value or replace it. It has no parameters, so
  declaring one changes no checkpoint."""

  @nn.compact
  def __call__(self, x: Array) -> Array:
    return x


def constrain(x: Array, logical: tuple[str | None, ...]) -> Array:
  """`nn.with_logical_constraint` on the active partitioner's mesh (`sharding.ACTIVE`); a no-op
  outside one. The mesh is passed explicitly instead of through `jax.set_mesh`, because under a
  global mesh flax also constrains DenseGeneral's flattened kernel initialisers, which fails."""
  if not sharding.ACTIVE:
    return x
  partitioner = sharding.ACTIVE[-1]
  return nn.with_logical_constraint(x, logical, rules=partitioner.rules, mesh=partitioner.mesh)


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


# The weight matmul ---------------------------------------------------------------------------
# XLA:CPU runs the autodiff transpose of a [B, T, D] x [D, ...] dot_general (a weight gradient that
# contracts B and T together) as transposed copies plus an unfused dot; flattened to
# [B*T, D] @ [D, F], with the weight gradient written as x.T @ g, the same sums run as plain matmuls
# (a char_lm step 1.4x as fast). Only on CPU: elsewhere `dense` keeps `lax.dot_general`.
@jax.custom_vjp
def _mm(x, w):  # [M, K] @ [K, N] -> [M, N]
  return x @ w


def _mm_fwd(x, w):
  return x @ w, (x, w)


def _mm_bwd(res, g):
  x, w = res
  return g @ w.T, x.T @ g  # d x [M, K], d w [K, N]


_mm.defvjp(_mm_fwd, _mm_bwd)


def cpu_matmul(lhs: Array, rhs: Array, dimension_numbers, precision=None) -> Array:
  """`lax.dot_general` of `dense`'s kernels on CPU: lhs [..., *C] x rhs [*C, ...], contracting the
  C axes (lhs's last, rhs's first; no batch axes, one dtype), as one 2-D matmul with its VJP."""
  n = len(dimension_numbers[0][0])  # the contracted axes C
  k = math.prod(rhs.shape[:n])
  out = _mm(lhs.reshape(-1, k), rhs.reshape(k, -1))
  return out.reshape(lhs.shape[: lhs.ndim - n] + rhs.shape[n:])


@functools.cache
def _settings(cfg: ModelConfig, matmul: bool) -> dict:
  """DenseGeneral's dtypes, and its matmul (None: lax.dot_general), chosen once per config."""
  dot = cpu_matmul if matmul and jax.default_backend() == 'cpu' else None
  return dict(dtype=cfg.compute_dtype, param_dtype=cfg.params_dtype, dot_general=dot)


def dense(cfg, features, axes: tuple, name: str, init=None, use_bias=True, axis=-1, matmul=False):
  """A projection of x's `axis` (an int or a tuple) to `features` (an int or a shape) in `cfg`'s
  dtypes, its kernel on the logical `axes` (initialised by `init`, default `kernel_init(cfg)`)
  and its bias on the output axes. `matmul`: the weight matmul above on CPU."""
  out_axes = axes[-1:] if isinstance(features, int) else axes[-len(features) :]
  return nn.DenseGeneral(features, axis, use_bias=use_bias, name=name, **_settings(cfg, matmul),
    kernel_init=nn.with_logical_partitioning(init or kernel_init(cfg), axes),
    bias_init=nn.with_logical_partitioning(nn.initializers.zeros, out_axes))  # fmt: skip


# Norms ---------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
  """RMSNorm, with its statistics in float32 whatever the compute dtype; the base of the other
  per-token norms, which change how x is centred (`_centre`) or weighted (`_affine`)."""

  eps: float = 1e-6
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  axis_name: str = 'embed'  # logical axis of the normalised features ('kv' for q/k head norms)

  @nn.compact
  def __call__(self, x: Array, segments: Array | None = None, deterministic: bool = True) -> Array:
    """x [..., D] -> x's shape; the norm of each token alone (the other arguments are BatchNorm's,
    so that every norm has one call signature)."""
    features = x.shape[-1]
    # float32 statistics: a bfloat16 mean of squares over D features loses too many digits.
    x32 = self._centre(x.astype(jnp.float32))  # [..., D]
    # Centred, the mean of squares is the variance, so one line serves LayerNorm too.
    var = (x32 * x32).mean(-1, keepdims=True) + self.eps  # [..., 1]
    # hook_scale holds the divisor sqrt(var + eps), as in TransformerLens. The forward multiplies
    # by rsqrt (the sqrt is dead code unless a hook reads it); a hook that returns a new divisor
    # (e.g. the clean run's, to freeze the norm) hands back another array, which it divides by.
    scale = jnp.sqrt(var)
    hooked = HookPoint(name='hook_scale')(scale)
    y = x32 * jax.lax.rsqrt(var) if hooked is scale else x32 / hooked
    # hook_normalized: before the weight and bias, float32, as in TransformerLens.
    y = HookPoint(name='hook_normalized')(y)
    return HookPoint(name='hook_out')(self._affine(y, features).astype(self.dtype))

  def _centre(self, x32: Array) -> Array:
    return x32  # RMSNorm does not centre

  def _affine(self, y: Array, features: int) -> Array:
    """The normalised y times the per-feature weight, the parameter 'scale'."""
    ones = nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,))
    return y * self.param('scale', ones, (features,), self.param_dtype)


class LayerNorm(RMSNorm):
  """LayerNorm without a bias (norm_bias=False): RMSNorm of x minus its mean."""

  def _centre(self, x32: Array) -> Array:
    return x32 - x32.mean(-1, keepdims=True)


class BiasedLayerNorm(LayerNorm):
  """LayerNorm: the weighted, normalised x plus the parameter 'bias'."""

  def _affine(self, y: Array, features: int) -> Array:
    zeros = nn.with_logical_partitioning(nn.initializers.zeros, (self.axis_name,))
    return super()._affine(y, features) + self.param('bias', zeros, (features,), self.param_dtype)


class OffsetNorm(RMSNorm):
  """RMSNorm whose parameter holds the weight minus 1 (starting at 0), applied as (1 + scale) in
  float32: Gemma's, so that its checkpoints load and export as they are."""

  def _affine(self, y: Array, features: int) -> Array:
    zeros = nn.with_logical_partitioning(nn.initializers.zeros, (self.axis_name,))
    return y * (1.0 + self.param('scale', zeros, (features,), self.param_dtype).astype(jnp.float32))


# Embeddings ----------------------------------------------------------------------------------
class Embed(nn.Module):
  """Token embedding table [V, D] of `cfg`; `attend` reuses it as the tied output projection."""

  cfg: ModelConfig

  def setup(self):
    cfg, init = self.cfg, nn.with_logical_partitioning(embedding_init(self.cfg), ('vocab', 'embed'))
    self.embedding = self.param('embedding', init, (cfg.vocab_size, cfg.d_model), cfg.params_dtype)

  def __call__(self, tokens: Array) -> Array:
    # FSDP: gather the table's d_model shards first, so the lookup's rows stay batch-sharded.
    table = constrain(self.embedding, ('vocab', None))
    x = jnp.take(table, tokens, axis=0).astype(self.cfg.compute_dtype)  # [B, T] -> [B, T, D]
    return constrain(x, ('batch', 'length', 'embed'))  # [B, T, D]

  def attend(self, x: Array) -> Array:
    """Logits against every embedding: [B, T, D] -> [B, T, V]."""
    # No sqrt(D) here: the scale applies to the lookup only, as in the paper.
    table = self.embedding.astype(self.cfg.compute_dtype)  # [V, D]
    logits = jnp.einsum('btd,vd->btv', x, table)  # [B, T, V]
    return constrain(logits, ('batch', 'length', 'vocab'))

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


@functools.cache
def _table_init(cfg: ModelConfig) -> Callable:
  """Learned positions' and token types' tables: normal(init_std), rows unsharded."""
  return nn.with_logical_partitioning(nn.initializers.normal(cfg.init_std), (None, 'embed'))


class AddSinusoidal(nn.Module):
  """x [B, T, D] + the paper's sinusoids of `positions` [B or 1, T]."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x: Array, positions: Array) -> Array:
    table = positions_lib.sinusoidal(positions, self.cfg.d_model).astype(x.dtype)  # [B or 1, T, D]
    # hook_pos_embed: what is added, [B, T, D] like x (TransformerLens repeats it per row).
    return x + HookPoint(name='hook_pos_embed')(jnp.broadcast_to(table, x.shape))  # [B, T, D]


class AddLearned(nn.Module):
  """x [B, T, D] + a learned [max_length, D] table at `positions` [B or 1, T] (GPT-2, BERT)."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x: Array, positions: Array) -> Array:
    cfg, length = self.cfg, positions.shape[-1]  # static, unlike the traced position values
    if length > cfg.max_length:
      raise ValueError(
        f'sequence length {length} exceeds max_length={cfg.max_length} of learned positions; '
        "use a shorter sequence or position='rope'/'sinusoidal'"
      )
    table = nn.Embed(cfg.max_length, cfg.d_model, embedding_init=_table_init(cfg),
                     param_dtype=cfg.params_dtype, name='positions')  # fmt: skip
    table = table(positions).astype(x.dtype)  # [B or 1, T, D]
    return x + HookPoint(name='hook_pos_embed')(jnp.broadcast_to(table, x.shape))  # [B, T, D]


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
    x = constrain(x, ('batch', 'length', 'embed'))
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
        embedding_init=_table_init(cfg),
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

  @nn.compact
  def __call__(self, x: Array, deterministic: bool) -> Array:
    """x [B, T, D] -> [B, T, D]: up, the hidden [B, T, F], its dropout and hook_post, down."""
    cfg, bias = self.cfg, self.cfg.use_bias
    up = functools.partial(dense, cfg, cfg.d_ff, ('embed', 'mlp'), use_bias=bias, matmul=True)
    h = constrain(self._hidden(up, x), ('batch', 'length', 'mlp'))  # [B, T, F]
    h = nn.Dropout(cfg.ffn_dropout_rate)(h, deterministic=deterministic)
    h = HookPoint(name='hook_post')(h)  # [B, T, F]
    # 'wo' writes into the residual stream, so it takes the block's (maybe scaled) out_init.
    wo = dense(cfg, cfg.d_model, ('mlp', 'embed'), 'wo', self.out_init, bias, matmul=True)
    return wo(h)  # [B, T, D]

  def _hidden(self, up: Callable, x: Array) -> Array:
    """The activation of the up projection up(name) [B, T, D] -> [B, T, F]."""
    return ACTIVATIONS[self.cfg.activation](HookPoint(name='hook_pre')(up('wi')(x)))


# The gated units' activations on the gate: SwiGLU (LLaMA) and GeGLU (Gemma).
GATES = {'swiglu': nn.silu, 'geglu': ACTIVATIONS['gelu_tanh']}


class GatedFeedForward(FeedForward):
  """SwiGLU or GeGLU: act(x W_gate) * (x W_in), a gated unit with two up projections."""

  def _hidden(self, up: Callable, x: Array) -> Array:
    pre = HookPoint(name='hook_pre')(up('gate')(x))  # [B, T, F]
    linear = HookPoint(name='hook_pre_linear')(up('wi')(x))  # [B, T, F]
    return GATES[self.cfg.activation](pre) * linear


# Residual wiring of one sub-layer: sublayer(x, f, out, norm, drop) -> [B, T, D], for the
# sub-layer f, its output hook point `out`, norm(suffix) (the sub-layer's norm `<name>_<suffix>`)
# and the residual dropout. Pre-norm leaves the residual stream un-normalised (stable deep stacks;
# needs a final norm); post-norm normalises the sum, as in the 2017 paper; sandwich (Gemma 2) is
# pre-norm with a second norm on the sub-layer's output, before its hook. Without the residual the
# sub-layer's output replaces x (an ablation).
def pre_norm(x: Array, f: Callable, out: Callable, norm: Callable, drop: Callable) -> Array:
  return x + drop(out(f(norm('norm')(x))))


def post_norm(x: Array, f: Callable, out: Callable, norm: Callable, drop: Callable) -> Array:
  return norm('norm')(x + drop(out(f(x))))


def sandwich_norm(x: Array, f: Callable, out: Callable, norm: Callable, drop: Callable) -> Array:
  return x + drop(out(norm('post_norm')(f(norm('norm')(x)))))


def pre_norm_no_residual(x, f: Callable, out: Callable, norm: Callable, drop: Callable) -> Array:
  return drop(out(f(norm('norm')(x))))


def post_norm_no_residual(x, f: Callable, out: Callable, norm: Callable, drop: Callable) -> Array:
  return norm('norm')(drop(out(f(x))))


def sandwich_norm_no_residual(x, f: Callable, out: Callable, norm: Callable, drop) -> Array:
  return drop(out(norm('post_norm')(f(norm('norm')(x)))))


# How a block composes its sub-layers [(name, f, out)]: block(x, sublayers, sublayer, norm, drop)
# -> [B, T, D], with norm(name, suffix) and `sublayer` the wiring above.
def sequential(x: Array, sublayers: list, sublayer: Callable, norm: Callable, drop) -> Array:
  """One sub-layer after the other; hook_resid_mid is the stream after the first, where more
  follow (TransformerLens's, which attention-only layers lack)."""
  for i, (name, f, out) in enumerate(sublayers):
    x = HookPoint(name='hook_resid_mid')(x) if i == 1 else x
    x = sublayer(x, f, out, functools.partial(norm, name), drop)
  return x  # [B, T, D]


def parallel(x: Array, sublayers: list, sublayer: Callable, norm: Callable, drop) -> Array:
  """GPT-NeoX's and GPT-J's parallel residual: every sub-layer reads the same x through its own
  pre-norm, and their outputs add to it, x + attn(ln1(x)) + mlp(ln2(x))."""
  y = x
  for name, f, out in sublayers:
    y = y + drop(out(f(norm(name, 'norm')(x))))
  return y  # [B, T, D]


# The layer loops: layers(block, num_layers, x, *args) -> [B, T, D].
def loop(block: Callable, num_layers: int, x: Array, *args) -> Array:
  """Blocks layer_0 ... layer_{L-1}, one after the other: L modules, compiled one by one."""
  for i in range(num_layers):
    x = block(name=f'layer_{i}')(x, *args)
  return x


def patterned(block: Callable, num_layers: int, x: Array, mask, positions, *args, layers) -> Array:
  """`loop` over layers that differ by `cfg.attention_layers`: `layers` holds each layer's config
  and parts (`parts.layer_configs`), so a local layer ('L') attends within the sliding window
  (and turns RoPE by the local base), a global one ('G') sees every key."""
  _, _, *rest = block.args  # the stack's config and parts, then its own arguments
  for i, (cfg, p) in enumerate(layers[:num_layers]):
    layer = block.func(cfg, p, *rest, **block.keywords, name=f'layer_{i}')
    x = layer(x, mask.replace(window=cfg.window), positions, *args)
  return x  # [B, T, D]
