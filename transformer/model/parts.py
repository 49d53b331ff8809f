"""The parts of a model, chosen once per frozen config: the one table of variants.

`parts(cfg)` picks every variant of `cfg` (its norm, residual wiring, positions, MLP, embedder,
qk-norm, short convolution, remat and layer loop) as a small module or function, and is
memoised per config. The blocks and families call what it picked and never ask the config which
option it holds, so a forward runs only the code of the parts its model has. A new variant is
one part (a module or function beside its kind) and one line in a table here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.config import ModelConfig
from transformer.model import attention_paths, layers, remat, scan
from transformer.model import compressed_attention as compressed
from transformer.model import linear_attention as linear
from transformer.model import positions as positions_lib
from transformer.model.attention import Kind, softmax_attend
from transformer.model.layers import BiasedLayerNorm, HookPoint, LayerNorm, OffsetNorm, RMSNorm
from transformer.model.norms import BatchNorm
from transformer.model.short_conv import ShortConv

Array = jax.Array


# (norm_placement, residual) -> the residual wiring of a sub-layer (`layers.pre_norm`, ...), and
# whether the stack ends in a final norm.
WIRINGS = {
  ('pre', True): (layers.pre_norm, True),
  ('post', True): (layers.post_norm, False),
  ('sandwich', True): (layers.sandwich_norm, True),
  ('pre', False): (layers.pre_norm_no_residual, True),
  ('post', False): (layers.post_norm_no_residual, False),
  ('sandwich', False): (layers.sandwich_norm_no_residual, True),
}
# parallel_residual -> how a block composes its sub-layers.
BLOCKS = {False: layers.sequential, True: layers.parallel}


# Norms: a module class with cfg's settings bound, made as norm(name=...) and called as
# norm(x [..., D], segments [...] or None, deterministic) -> x's shape in the compute dtype.
def _norm(cfg: ModelConfig, module: type[nn.Module]) -> Callable[..., nn.Module]:
  return functools.partial(module, cfg.norm_eps, cfg.compute_dtype, cfg.params_dtype)


NORMS: dict[str, Callable[[ModelConfig], Callable[..., nn.Module]]] = {
  'layernorm': lambda cfg: _norm(cfg, BiasedLayerNorm if cfg.norm_bias else LayerNorm),
  'rmsnorm': lambda cfg: _norm(cfg, RMSNorm),  # never a bias
  'rmsnorm_offset': lambda cfg: _norm(cfg, OffsetNorm),  # Gemma's (1 + w)
  'batchnorm': lambda cfg: functools.partial(
    BatchNorm, cfg.norm_eps, cfg.compute_dtype, cfg.params_dtype, use_bias=cfg.norm_bias
  ),
}


def qk_norm(cfg: ModelConfig) -> Callable[..., nn.Module] | None:
  """Qwen3's norm of each head's queries and keys over head_dim (logical axis 'kv'): the model's
  own norm kind and settings (its bias too), or None."""
  if not cfg.qk_norm:
    return None
  return functools.partial(NORMS[cfg.norm](cfg), axis_name='kv')


# Relative positions, in self attention: fn(cfg, q [B, T, N, H], k [B, S, K, H], positions [B or
# 1, T]) -> (q, k, ALiBi slopes [N] or None); called inside the attention module, whose hook
# points (hook_rot_q, hook_rot_k) they declare.
def _rope_frequencies(cfg: ModelConfig, dims: int):
  return positions_lib.rope_frequencies(
    dims,
    theta=cfg.rope_theta,
    scaling=cfg.rope_scaling,
    factor=cfg.rope_scaling_factor,
    original_max_length=cfg.rope_original_max_length or cfg.max_length,
    low_freq_factor=cfg.rope_low_freq_factor,
    high_freq_factor=cfg.rope_high_freq_factor,
  )


def rope(cfg: ModelConfig, q: Array, k: Array, positions: Array):
  """Rotates q and k by their positions, so that q.k depends on the offset i - j only."""
  inv_freq, mscale = _rope_frequencies(cfg, cfg.head_size)
  q = HookPoint(name='hook_rot_q')(positions_lib.apply_rope(q, positions, inv_freq, mscale))
  k = HookPoint(name='hook_rot_k')(positions_lib.apply_rope(k, positions, inv_freq, mscale))
  return q, k, None  # q [B, T, N, H], k [B, S, K, H]


def partial_rope(cfg: ModelConfig, q: Array, k: Array, positions: Array):
  """GPT-NeoX's RoPE on the first `rope_dim` dims of each head; the others pass as they are."""
  d = cfg.rope_dim
  inv_freq, mscale = _rope_frequencies(cfg, d)
  rotate = lambda x: jnp.concatenate(
    [positions_lib.apply_rope(x[..., :d], positions, inv_freq, mscale), x[..., d:]], axis=-1
  )
  q, k = HookPoint(name='hook_rot_q')(rotate(q)), HookPoint(name='hook_rot_k')(rotate(k))
  return q, k, None  # q [B, T, N, H], k [B, S, K, H]


def alibi(cfg: ModelConfig, q: Array, k: Array, positions: Array):
  """Leaves q and k alone; the slopes [N] bias the logits by distance."""
  return q, k, positions_lib.alibi_slopes(cfg.num_heads)


# others: none in attention; 'partial_rope' is position='rope' with a rope_dim under the head size
RELATIVE_POSITIONS = {'rope': rope, 'partial_rope': partial_rope, 'alibi': alibi}
# Absolute positions, added to the token embeddings: module(cfg, name='positions')(x, positions).
ABSOLUTE_POSITIONS = {'sinusoidal': layers.AddSinusoidal, 'learned': layers.AddLearned}


def embedder(cfg: ModelConfig) -> Callable[..., nn.Module]:
  """embedder(cfg, embed, name=...): tokens, absolute positions (if any), then BERT's token
  types and embedding norm where the model has them."""
  positions = ABSOLUTE_POSITIONS.get(cfg.position)
  if not (cfg.family == 'bidirectional_lm' or cfg.type_vocab_size or cfg.embedding_norm):
    return functools.partial(layers.Embedder, positions=positions)
  norm = NORMS[cfg.norm](cfg) if cfg.embedding_norm else None
  return functools.partial(layers.TypedEmbedder, positions=positions, norm=norm)


def mlp(cfg: ModelConfig) -> type[nn.Module] | None:
  """The feed-forward sub-layer: dense, gated (SwiGLU, GeGLU), or none (d_ff=0: attention only)."""
  if not cfg.d_ff:
    return None
  return layers.GatedFeedForward if cfg.activation in layers.GATES else layers.FeedForward


def rematerialise(cfg: ModelConfig) -> Callable[[type[nn.Module]], type[nn.Module]] | None:
  """The block class rematerialised under the named policy, or None (the block as it is)."""
  if cfg.remat == 'none':
    return None
  return functools.partial(remat.remat, policy=remat.REMAT_POLICIES[cfg.remat])


# The attention kinds (`ModelConfig.attention`): a new kind is three functions and a line here
# (and its name in config.ATTENTIONS); linear_attention.py and compressed_attention.py are the
# examples.
KINDS: dict[str, Kind] = {
  'softmax': Kind(softmax_attend, attention_paths.kv_cache, attention_paths.softmax_step),
  'linear': Kind(linear.attend, linear.cache, linear.step),
  'compressed': Kind(compressed.attend, attention_paths.kv_cache, compressed.step),
}


class Parts(NamedTuple):
  """What `parts(cfg)` picked; None where the model has no such part."""

  norm: Callable[..., nn.Module]  # norm(name=...)(x, segments, deterministic)
  sublayer: Callable  # a sub-layer's residual wiring: sublayer(x, f, out, norm, drop)
  block: Callable  # the sub-layers composed: block(x, sublayers, sublayer, norm, drop)
  final_norm: bool  # the stack ends in a norm (pre-norm wiring)
  embed: type[nn.Module]  # the token table: layers.Embed, or ScaledEmbed (x sqrt(d_model))
  embedder: Callable[..., nn.Module]  # embedder(cfg, embed, name=...)(tokens, positions, ...)
  relative_positions: Callable | None  # fn(cfg, q, k, positions) in self attention
  attention: Kind  # the attention kind: attend, cache, step
  qk_norm: Callable[..., nn.Module] | None  # norm(name=...)(q or k) over head_dim
  short_conv: Callable[..., nn.Module] | None  # conv(name=...)(x, mask, positions, cache_mode)
  mlp: type[nn.Module] | None  # mlp(cfg, out_init, name=...)(x, deterministic)
  remat: Callable[[type[nn.Module]], type[nn.Module]] | None  # block class -> block class
  layers: Callable  # layers(block, num_layers, x, *args): layers.loop or .patterned, scan.scan


def _relative_kind(cfg: ModelConfig) -> str:
  partial = cfg.position == 'rope' and cfg.rope_dim not in (None, cfg.head_size)
  return 'partial_rope' if partial else cfg.position


@functools.lru_cache(maxsize=256)
def layer_configs(cfg: ModelConfig) -> tuple[ModelConfig, ...]:
  """Each layer's config under `cfg.attention_layers`, repeated over the deepest stack: a local
  layer keeps the window (and takes rope_local_theta), a global one has none."""
  pattern, depth = cfg.attention_layers, max(cfg.num_layers, cfg.decoder_layers)
  local = cfg.replace(attention_layers='', rope_theta=cfg.rope_local_theta or cfg.rope_theta,
                      rope_local_theta=None)  # fmt: skip
  full = cfg.replace(attention_layers='', window=None, rope_local_theta=None)
  return tuple(local if pattern[i % len(pattern)] == 'L' else full for i in range(depth))


def _layers(cfg: ModelConfig) -> Callable:
  """The layer loop: a scan, a loop, or (attention_layers) a loop of per-layer configs."""
  if cfg.attention_layers:
    configs = tuple((c, parts(c)) for c in layer_configs(cfg))
    return functools.partial(layers.patterned, layers=configs)
  return scan.scan if cfg.scan_layers else layers.loop


@functools.lru_cache(maxsize=256)
def parts(cfg: ModelConfig) -> Parts:
  """The parts of `cfg`'s model, chosen once (the config is frozen and hashable)."""
  sublayer, final_norm = WIRINGS[cfg.norm_placement, cfg.residual]
  short_conv = None
  if cfg.short_conv:
    short_conv = functools.partial(ShortConv, cfg.short_conv, param_dtype=cfg.params_dtype)
  return Parts(
    norm=NORMS[cfg.norm](cfg),
    sublayer=sublayer,
    block=BLOCKS[cfg.parallel_residual],
    final_norm=final_norm,
    embed=layers.ScaledEmbed if cfg.scale_embeddings else layers.Embed,
    embedder=embedder(cfg),
    relative_positions=RELATIVE_POSITIONS.get(_relative_kind(cfg)),
    attention=KINDS[cfg.attention],
    qk_norm=qk_norm(cfg),
    short_conv=short_conv,
    mlp=mlp(cfg),
    remat=rematerialise(cfg),
    layers=_layers(cfg),
  )
