"""The three families, thin compositions of one block: EncoderDecoder, BidirectionalLM, CausalLM."""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer import sharding
from transformer.config import ModelConfig
from transformer.model.attention import CacheMode, MaskSpec
from transformer.model.layers import (
  ACTIVATIONS,
  AddPositions,
  Stack,
  kernel_init,
  make_embed,
  make_norm,
)

Array = jax.Array


def _segments(tokens: Array, segments: Array | None, pad_id: int | None) -> Array | None:
  """Segment ids [B, T]: given ones, else 1 for real tokens and 0 for `pad_id`, else None."""
  if segments is not None or pad_id is None:
    return segments
  return (tokens != pad_id).astype(jnp.int32)


def _cross_mask(q_segments: Array | None, kv_segments: Array | None, q_len, kv_len) -> MaskSpec:
  """Decoder-to-encoder mask: segment k of the targets sees segment k of the inputs."""
  if q_segments is None and kv_segments is None:
    return MaskSpec()
  if q_segments is None:
    q_segments = jnp.ones((kv_segments.shape[0], q_len), jnp.int32)
  if kv_segments is None:
    kv_segments = jnp.ones((q_segments.shape[0], kv_len), jnp.int32)
  return MaskSpec(q_segment_ids=q_segments, kv_segment_ids=kv_segments)


class Embedder(nn.Module):
  """Token embedding + absolute positions (+ token types, + norm) + dropout: [B, T] -> [B, T, D]."""

  cfg: ModelConfig
  embed: nn.Module

  @nn.compact
  def __call__(self, tokens, positions=None, token_types=None, *, deterministic: bool) -> Array:
    cfg = self.cfg
    x = self.embed(tokens)  # [B, T, D]
    x = AddPositions(cfg, name='positions')(x, positions)
    if cfg.type_vocab_size:
      if token_types is None:
        token_types = jnp.zeros_like(tokens)
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
      x = x + types(token_types)
    if cfg.embedding_norm:
      x = make_norm(cfg, 'norm')(x)
    x = sharding.constrain(x, ('batch', 'length', 'embed'))
    return nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)


class Encoder(nn.Module):
  """Bidirectional stack: tokens [B, S] -> hidden states [B, S, D]."""

  cfg: ModelConfig
  embed: nn.Module

  @nn.compact
  def __call__(
    self, inputs, *, segments=None, positions=None, token_types=None, deterministic=True
  ):
    cfg = self.cfg
    x = Embedder(cfg, self.embed, name='embedder')(
      inputs, positions, token_types, deterministic=deterministic
    )
    mask = MaskSpec(q_segment_ids=segments, kv_segment_ids=segments, window=cfg.window)
    return Stack(cfg, cfg.num_layers, name='stack')(x, None, mask, None, positions, deterministic)


class Decoder(nn.Module):
  """Causal stack with optional cross attention: tokens [B, T] -> hidden states [B, T, D]."""

  cfg: ModelConfig
  embed: nn.Module
  num_layers: int
  cross_attention: bool = True

  @nn.compact
  def __call__(
    self,
    encoded,
    tokens,
    *,
    self_mask,
    cross_mask,
    positions=None,
    deterministic=True,
    cache_mode: CacheMode | None = None,
  ) -> Array:
    x = Embedder(self.cfg, self.embed, name='embedder')(
      tokens, positions, deterministic=deterministic
    )
    stack = Stack(self.cfg, self.num_layers, self.cross_attention, name='stack')
    return stack(x, encoded, self_mask, cross_mask, positions, deterministic, cache_mode)


class HeadInputs(NamedTuple):
  """The output head's operands: logits = hidden @ table.T + bias, never built."""

  hidden: Array  # [B, T, D] final hidden states
  table: Array  # [V, D] tied output embedding, compute dtype
  bias: Array | None  # [V] or None


def has_fused_head(cfg: ModelConfig) -> bool:
  """Whether `head_inputs=True` works for `cfg`: a tied head that predicts tokens."""
  return cfg.tie_output and cfg.num_classes == 0


class OutputHead(nn.Module):
  """Hidden states [B, T, D] -> logits [B, T, V]: the tied embedding or its own projection."""

  cfg: ModelConfig
  embed: nn.Module

  @nn.compact
  def __call__(self, x: Array, head_inputs: bool = False) -> Array | HeadInputs:
    """`head_inputs=True` (tied heads only) returns what `objectives.head_cross_entropy` takes."""
    cfg = self.cfg
    if head_inputs:
      if not cfg.tie_output:
        raise ValueError('head_inputs=True needs tie_output=True (the head is the embedding)')
      return HeadInputs(x, self.embed.table(), None)
    if cfg.tie_output:
      return self.embed.attend(x)
    logits = nn.Dense(
      cfg.vocab_size,
      use_bias=False,
      dtype=cfg.compute_dtype,
      param_dtype=cfg.params_dtype,
      kernel_init=nn.with_logical_partitioning(kernel_init(cfg), ('embed', 'vocab')),
      name='logits',
    )(x)  # [B, T, V]
    return sharding.constrain(logits, ('batch', 'length', 'vocab'))


class EncoderDecoder(nn.Module):
  """The 2017 Transformer: source tokens [B, S] and decoder inputs [B, T] -> logits [B, T, V]."""

  cfg: ModelConfig

  def setup(self):
    cfg = self.cfg
    if cfg.share_embeddings:
      self.embedding = make_embed(cfg)
      source, target = self.embedding, self.embedding
    else:
      self.source_embedding = make_embed(cfg)
      self.target_embedding = make_embed(cfg)
      source, target = self.source_embedding, self.target_embedding
    self.encoder = Encoder(cfg, source)
    self.decoder = Decoder(cfg, target, cfg.decoder_layers)
    self.head = OutputHead(cfg, target)

  def encode(self, inputs, *, inputs_segments=None, inputs_positions=None, deterministic=True):
    """Source tokens [B, S] -> encoded [B, S, D]."""
    segments = _segments(inputs, inputs_segments, self.cfg.pad_id)
    return self.encoder(
      inputs, segments=segments, positions=inputs_positions, deterministic=deterministic
    )

  def decode(
    self,
    encoded,
    inputs_segments,
    decoder_inputs,
    *,
    targets_segments=None,
    targets_positions=None,
    deterministic=True,
    cache_mode: CacheMode | None = None,
    head_inputs: bool = False,
  ):
    """Encoded [B, S, D] and decoder inputs [B, T] -> logits [B, T, V] (or HeadInputs).

    `cache_mode` decodes with a KV cache (model.decode); the 'step' phase takes one token
    per row at `targets_positions` [B, 1].
    """
    cfg = self.cfg
    segments = _segments(decoder_inputs, targets_segments, cfg.pad_id)
    self_mask = MaskSpec(
      causal=True, q_segment_ids=segments, kv_segment_ids=segments, window=cfg.window
    )
    cross_mask = _cross_mask(segments, inputs_segments, decoder_inputs.shape[1], encoded.shape[1])
    y = self.decoder(
      encoded,
      decoder_inputs,
      self_mask=self_mask,
      cross_mask=cross_mask,
      positions=targets_positions,
      deterministic=deterministic,
      cache_mode=cache_mode,
    )
    return self.head(y, head_inputs)

  def __call__(
    self,
    inputs,
    decoder_inputs,
    *,
    inputs_segments=None,
    targets_segments=None,
    inputs_positions=None,
    targets_positions=None,
    deterministic=True,
    head_inputs: bool = False,
  ):
    """`head_inputs=True` returns the head's HeadInputs instead of the logits [B, T, V]."""
    inputs_segments = _segments(inputs, inputs_segments, self.cfg.pad_id)
    encoded = self.encode(
      inputs,
      inputs_segments=inputs_segments,
      inputs_positions=inputs_positions,
      deterministic=deterministic,
    )
    return self.decode(
      encoded,
      inputs_segments,
      decoder_inputs,
      targets_segments=targets_segments,
      targets_positions=targets_positions,
      deterministic=deterministic,
      head_inputs=head_inputs,
    )

  def dummy_inputs(self, batch: int = 1, length: int = 8) -> dict[str, Any]:
    tokens = jnp.ones((batch, length), jnp.int32)
    return {'inputs': tokens, 'decoder_inputs': tokens}


class CausalLM(nn.Module):
  """GPT: tokens [B, T] -> next-token logits [B, T, V]."""

  cfg: ModelConfig

  def setup(self):
    self.embedding = make_embed(self.cfg)
    self.decoder = Decoder(self.cfg, self.embedding, self.cfg.num_layers, cross_attention=False)
    self.head = OutputHead(self.cfg, self.embedding)

  def __call__(
    self,
    inputs,
    *,
    segments=None,
    positions=None,
    deterministic=True,
    cache_mode: CacheMode | None = None,
    head_inputs: bool = False,
  ):
    """`cache_mode` decodes with a KV cache (model.decode): 'step' takes inputs [B, 1].

    `head_inputs=True` returns the head's HeadInputs instead of the logits [B, T, V].
    """
    cfg = self.cfg
    segments = _segments(inputs, segments, cfg.pad_id)
    mask = MaskSpec(causal=True, q_segment_ids=segments, kv_segment_ids=segments, window=cfg.window)
    y = self.decoder(
      None,
      inputs,
      self_mask=mask,
      cross_mask=None,
      positions=positions,
      deterministic=deterministic,
      cache_mode=cache_mode,
    )
    return self.head(y, head_inputs)

  def dummy_inputs(self, batch: int = 1, length: int = 8) -> dict[str, Any]:
    return {'inputs': jnp.ones((batch, length), jnp.int32)}


class BidirectionalLM(nn.Module):
  """BERT: tokens [B, T] -> MLM logits [B, T, V], or class logits [B, C] when num_classes > 0,
  or the final hidden states [B, T, D] when output_head=False."""

  cfg: ModelConfig

  @nn.compact
  def __call__(
    self,
    inputs,
    *,
    token_types=None,
    segments=None,
    positions=None,
    deterministic=True,
    head_inputs: bool = False,
  ):
    """`head_inputs=True` (MLM only) returns the head's HeadInputs instead of the logits."""
    cfg = self.cfg
    if head_inputs and not has_fused_head(cfg):
      raise ValueError('head_inputs=True needs the tied MLM head (tie_output, num_classes=0)')
    segments = _segments(inputs, segments, cfg.pad_id)
    embedding = make_embed(cfg, name='embedding')
    x = Encoder(cfg, embedding, name='encoder')(
      inputs,
      segments=segments,
      positions=positions,
      token_types=token_types,
      deterministic=deterministic,
    )  # [B, T, D]
    if not cfg.output_head:  # an encoder without a head (HF BertModel): the hidden states
      return x
    dense = lambda features, name: nn.Dense(
      features,
      dtype=cfg.compute_dtype,
      param_dtype=cfg.params_dtype,
      kernel_init=nn.with_logical_partitioning(kernel_init(cfg), ('embed', None)),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
      name=name,
    )
    if cfg.num_classes:  # pooler on the first token, then a classifier
      pooled = jnp.tanh(dense(cfg.d_model, 'pooler')(x[:, 0]))  # [B, D]
      pooled = nn.Dropout(cfg.dropout_rate)(pooled, deterministic=deterministic)
      return dense(cfg.num_classes, 'classifier')(pooled)  # [B, C]
    activation = 'gelu' if cfg.activation == 'swiglu' else cfg.activation
    h = ACTIVATIONS[activation](dense(cfg.d_model, 'mlm_dense')(x))
    h = make_norm(cfg, 'mlm_norm')(h)
    zeros = nn.with_logical_partitioning(nn.initializers.zeros, ('vocab',))
    bias = self.param('mlm_bias', zeros, (cfg.vocab_size,), cfg.params_dtype)
    if head_inputs:
      return HeadInputs(h, embedding.table(), bias)
    return embedding.attend(h) + bias.astype(h.dtype)  # [B, T, V]

  def dummy_inputs(self, batch: int = 1, length: int = 8) -> dict[str, Any]:
    return {'inputs': jnp.ones((batch, length), jnp.int32)}


_FAMILIES = {
  'encoder_decoder': EncoderDecoder,
  'bidirectional_lm': BidirectionalLM,
  'causal_lm': CausalLM,
}


def build(cfg: ModelConfig) -> nn.Module:
  """The model of `cfg.family`."""
  return _FAMILIES[cfg.family](cfg)


def init_params(model: nn.Module, rng: Array, *, boxed: bool = False) -> Any:
  """Fresh parameters of `model`, as plain arrays (or, with `boxed`, with their logical axes)."""
  params = model.init(rng, **model.dummy_inputs())['params']
  return params if boxed else nn.meta.unbox(params)


def param_shapes(cfg: ModelConfig) -> Any:
  """Parameter ShapeDtypeStructs, without allocating them."""
  return jax.eval_shape(functools.partial(init_params, build(cfg)), jax.random.PRNGKey(0))


def count_params(cfg: ModelConfig) -> int:
  """Exact number of parameters."""
  return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(param_shapes(cfg))))


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
  """Training FLOPs per token (forward + backward = 3 x forward), counting matmuls only.

  Weight matmuls cost 2 FLOPs per weight per token forward; attention scores and the weighted sum
  cost 2 * 2 * seq_len * N * H per layer per token (full, unmasked matrices, as XLA computes them).
  For EncoderDecoder, source and target lengths are both `seq_len` and tokens are target tokens.
  """
  shapes = param_shapes(cfg)
  flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
  matmul_params = 0
  for path, leaf in flat:
    name = jax.tree_util.keystr(path)
    if leaf.ndim >= 2 and 'embedding' not in name and not name.endswith("['bias']"):
      matmul_params += math.prod(leaf.shape)
  if cfg.tie_output and cfg.num_classes == 0:  # the tied head is a matmul with the embedding
    matmul_params += cfg.vocab_size * cfg.d_model
  attn_width = cfg.num_heads * cfg.head_size
  layers = cfg.num_layers
  if cfg.family == 'encoder_decoder':
    layers += 2 * cfg.decoder_layers  # decoder self + cross attention
  attention = 2 * 2 * seq_len * attn_width * layers
  forward = 2 * matmul_params + attention
  return {'forward': float(forward), 'train': float(3 * forward), 'matmul_params': matmul_params}
