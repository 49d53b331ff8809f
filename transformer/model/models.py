"""The three families, thin compositions of one block: EncoderDecoder, BidirectionalLM, CausalLM."""

# A token through EncoderDecoder, from ids to logits (letters as in attention.py):
#
#   inputs [B, S], decoder_inputs [B, T]: int token ids
#   _segments: ids == cfg.pad_id get segment id 0, which masks them  [B, S], [B, T]
#   Encoder
#     Embedder: layers.Embed looks up the table (x sqrt(D) if cfg.scale_embeddings) [B, S, D]
#               layers.AddPositions adds sinusoidal/learned ones     [B, S, D]
#     layers.Stack of layers.Block, each one:                        [B, S, D] -> [B, S, D]
#       self attention over the source, not causal (attention.MultiHeadAttention)
#       feed-forward (layers.FeedForward)
#       each wrapped in residual + norm (pre- or post-LN)
#   Decoder
#     Embedder: the target embedding + positions                     [B, T] -> [B, T, D]
#     layers.Stack of layers.Block, each one:                        [B, T, D] -> [B, T, D]
#       causal self attention: token t sees decoder tokens <= t
#       cross attention: queries from the decoder, keys/values from the encoder output [B, S, D]
#       feed-forward; residual + norm around each
#     final_norm at the end of the Stack when pre-LN (post-LN blocks already end in one)
#   OutputHead: tied projection, x @ embedding.T (layers.Embed.attend) [B, T, D] -> [B, T, V]
#
# CausalLM is the Decoder alone (no cross attention); BidirectionalLM is the Encoder plus an
# MLM or classifier head.

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer.config import ModelConfig
from transformer.model.attention import CacheMode, MaskSpec
from transformer.model.blocks import Block, CrossBlock, Stack
from transformer.model.layers import ACTIVATIONS, constrain, dense
from transformer.model.parts import parts

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
  # One side without ids is one unpadded segment (id 1), so it matches segment 1 on the other.
  if q_segments is None:
    q_segments = jnp.ones((kv_segments.shape[0], q_len), jnp.int32)  # [B, T]
  if kv_segments is None:
    kv_segments = jnp.ones((q_segments.shape[0], kv_len), jnp.int32)  # [B, S]
  return MaskSpec(q_segment_ids=q_segments, kv_segment_ids=kv_segments)


class Encoder(nn.Module):
  """Embeddings and a bidirectional stack: tokens [B, S] -> hidden states [B, S, D]. The 2017
  encoder and BERT's."""

  cfg: ModelConfig
  embed: nn.Module

  @nn.compact
  def __call__(self, inputs, *, segments=None, positions=None, deterministic=True, **extra):
    """`extra`: BERT's token types, for its embedder."""
    cfg, p = self.cfg, parts(self.cfg)
    x = p.embedder(cfg, self.embed, name='embedder')(
      inputs, positions, deterministic=deterministic, segments=segments, **extra
    )  # [B, S, D]
    # Not causal: a source token sees every token of its own segment (within cfg.window, if set).
    mask = MaskSpec(q_segment_ids=segments, kv_segment_ids=segments, window=cfg.window)
    stack = Stack(cfg, p, cfg.num_layers, name='stack')
    return stack(x, mask, positions, deterministic=deterministic)  # [B, S, D]


class Decoder(nn.Module):
  """Embeddings and a causal stack: tokens [B, T] -> hidden states [B, T, D]. GPT's whole model
  below the head; the 2017 decoder passes `CrossBlock` and the encoder's output as `context`."""

  cfg: ModelConfig
  embed: nn.Module
  num_layers: int
  block: type[nn.Module] = Block

  @nn.compact
  def __call__(self, tokens, mask, *context, positions=None, deterministic=True, cache_mode=None):
    """mask: the causal self-attention MaskSpec; context: CrossBlock's (encoded, cross_mask)."""
    cfg, p = self.cfg, parts(self.cfg)
    x = p.embedder(cfg, self.embed, name='embedder')(
      tokens, positions, deterministic=deterministic, segments=mask.q_segment_ids
    )  # [B, T, D]
    stack = Stack(cfg, p, self.num_layers, self.block, name='stack')
    return stack(x, mask, positions, *context, deterministic=deterministic, cache_mode=cache_mode)


class HeadInputs(NamedTuple):
  """The output head's operands: logits = hidden @ table.T + bias, never built."""

  hidden: Array  # [B, T, D] final hidden states
  table: Array  # [V, D] tied output embedding, compute dtype
  bias: Array | None  # [V] or None


def has_fused_head(cfg: ModelConfig) -> bool:
  """Whether `head_inputs=True` works for `cfg`: a tied head that predicts tokens."""
  return cfg.tie_output and cfg.num_classes == 0


class TiedHead(nn.Module):
  """Hidden states [B, T, D] -> logits [B, T, V] by the transposed input embedding."""

  cfg: ModelConfig
  embed: nn.Module

  def __call__(self, x: Array, head_inputs: bool = False) -> Array | HeadInputs:
    """`head_inputs=True` returns what `objectives.head_cross_entropy` takes, for a loss that
    never builds the [B, T, V] logits (objectives.py)."""
    if head_inputs:
      return HeadInputs(x, self.embed.table(), None)
    # Logits stay in the compute dtype here; the losses (objectives.py) cast them to float32
    # before the softmax, where bfloat16 would lose precision over V classes.
    return self.embed.attend(x)  # [B, T, V]


class UntiedHead(nn.Module):
  """Hidden states [B, T, D] -> logits [B, T, V] by its own [D, V] matrix (and bias [V], where
  weight processing put one)."""

  cfg: ModelConfig
  embed: nn.Module  # unused: the head has its own matrix

  @nn.compact
  def __call__(self, x: Array, head_inputs: bool = False) -> Array:
    cfg = self.cfg
    if head_inputs:
      raise ValueError('head_inputs=True needs tie_output=True (the head is the embedding)')
    logits = dense(cfg, cfg.vocab_size, ('embed', 'vocab'), 'logits', use_bias=cfg.output_bias)(x)
    return constrain(logits, ('batch', 'length', 'vocab'))  # [B, T, V]


def _head(cfg: ModelConfig) -> type[nn.Module]:
  return TiedHead if cfg.tie_output else UntiedHead


class EncoderDecoder(nn.Module):
  """The 2017 Transformer: source tokens [B, S] and decoder inputs [B, T] -> logits [B, T, V]."""

  cfg: ModelConfig

  def setup(self):
    cfg = self.cfg
    # One table for source, target and output (the paper's shared vocabulary), or two.
    embed = parts(cfg).embed
    if cfg.share_embeddings:
      self.embedding = embed(cfg)
      source, target = self.embedding, self.embedding
    else:
      self.source_embedding = embed(cfg)
      self.target_embedding = embed(cfg)
      source, target = self.source_embedding, self.target_embedding
    self.encoder = Encoder(cfg, source)
    self.decoder = Decoder(cfg, target, cfg.decoder_layers, CrossBlock)
    self.head = _head(cfg)(cfg, target)  # tied to the target embedding when cfg.tie_output

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
    segments = _segments(decoder_inputs, targets_segments, cfg.pad_id)  # [B, T] or None
    # Decoder token t sees decoder tokens <= t of its own segment (teacher forcing).
    self_mask = MaskSpec(
      causal=True, q_segment_ids=segments, kv_segment_ids=segments, window=cfg.window
    )
    # Decoder segment k sees all of source segment k (packed examples stay apart).
    cross_mask = _cross_mask(segments, inputs_segments, decoder_inputs.shape[1], encoded.shape[1])
    y = self.decoder(
      decoder_inputs,
      self_mask,
      encoded,  # [B, S, D]: what the cross attention reads
      cross_mask,
      positions=targets_positions,
      deterministic=deterministic,
      cache_mode=cache_mode,
    )  # [B, T, D]
    return self.head(y, head_inputs)  # [B, T, V], or HeadInputs

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
    # Computed once here: the encoder's self mask and the decoder's cross mask both need them.
    inputs_segments = _segments(inputs, inputs_segments, self.cfg.pad_id)  # [B, S] or None
    encoded = self.encode(
      inputs,
      inputs_segments=inputs_segments,
      inputs_positions=inputs_positions,
      deterministic=deterministic,
    )  # [B, S, D]
    return self.decode(
      encoded,
      inputs_segments,
      decoder_inputs,
      targets_segments=targets_segments,
      targets_positions=targets_positions,
      deterministic=deterministic,
      head_inputs=head_inputs,
    )  # [B, T, V]

  def dummy_inputs(self, batch: int = 1, length: int | None = None) -> dict[str, Any]:
    tokens = jnp.ones((batch, length or _dummy_length(self.cfg)), jnp.int32)  # only shapes matter
    return {'inputs': tokens, 'decoder_inputs': tokens}


class CausalLM(nn.Module):
  """GPT: tokens [B, T] -> next-token logits [B, T, V]."""

  cfg: ModelConfig

  def setup(self):
    cfg = self.cfg
    self.embedding = parts(cfg).embed(cfg)
    self.decoder = Decoder(cfg, self.embedding, cfg.num_layers)
    self.head = _head(cfg)(cfg, self.embedding)

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
    segments = _segments(inputs, segments, cfg.pad_id)  # [B, T] or None
    # Token t sees tokens <= t of its own segment: packed documents do not see each other.
    mask = MaskSpec(causal=True, q_segment_ids=segments, kv_segment_ids=segments, window=cfg.window)
    y = self.decoder(
      inputs, mask, positions=positions, deterministic=deterministic, cache_mode=cache_mode
    )  # [B, T, D]
    return self.head(y, head_inputs)  # [B, T, V], or HeadInputs

  def dummy_inputs(self, batch: int = 1, length: int | None = None) -> dict[str, Any]:
    return {'inputs': jnp.ones((batch, length or _dummy_length(self.cfg)), jnp.int32)}


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
    segments = _segments(inputs, segments, cfg.pad_id)  # [B, T] or None
    embedding = parts(cfg).embed(cfg, name='embedding')  # also the MLM head's output matrix
    x = Encoder(cfg, embedding, name='encoder')(
      inputs,
      segments=segments,
      positions=positions,
      token_types=token_types,
      deterministic=deterministic,
    )  # [B, T, D]
    return _bert_head(cfg)(self, x, embedding, segments, deterministic, head_inputs)

  def dummy_inputs(self, batch: int = 1, length: int | None = None) -> dict[str, Any]:
    return {'inputs': jnp.ones((batch, length or _dummy_length(self.cfg)), jnp.int32)}


# BERT's heads, called inside BidirectionalLM (their parameters sit at its top level) as
# head(model, x [B, T, D], embedding, segments, deterministic, head_inputs).
def _bert_dense(model, features: int, name: str) -> nn.Dense:
  return dense(model.cfg, features, ('embed', None), name)


def _hidden_states(model, x, embedding, segments, deterministic, head_inputs):
  """No head (HF's BertModel): the final hidden states [B, T, D]."""
  return x


def _classifier(model, x, embedding, segments, deterministic, head_inputs):
  """A pooler on the first token, then a classifier: [B, C]."""
  cfg = model.cfg
  # x[:, 0] is BERT's [CLS]: the one position trained to summarise the whole input.
  pooled = jnp.tanh(_bert_dense(model, cfg.d_model, 'pooler')(x[:, 0]))  # [B, D]
  pooled = nn.Dropout(cfg.dropout_rate)(pooled, deterministic=deterministic)
  return _bert_dense(model, cfg.num_classes, 'classifier')(pooled)  # [B, C]


def _masked_lm(model, x, embedding, segments, deterministic, head_inputs):
  """BERT's MLM transform (dense, activation, norm), then the tied projection plus a bias."""
  cfg = model.cfg
  # SwiGLU needs two projections, so this one-matrix head falls back to GELU.
  activation = 'gelu' if cfg.activation == 'swiglu' else cfg.activation
  h = ACTIVATIONS[activation](_bert_dense(model, cfg.d_model, 'mlm_dense')(x))  # [B, T, D]
  h = parts(cfg).norm(name='mlm_norm')(h, segments, deterministic)
  zeros = nn.with_logical_partitioning(nn.initializers.zeros, ('vocab',))
  bias = model.param('mlm_bias', zeros, (cfg.vocab_size,), cfg.params_dtype)  # [V]
  if head_inputs:
    return HeadInputs(h, embedding.table(), bias)
  return embedding.attend(h) + bias.astype(h.dtype)  # [B, T, V]


def _bert_head(cfg: ModelConfig):
  if not cfg.output_head:
    return _hidden_states
  return _classifier if cfg.num_classes else _masked_lm


def _dummy_length(cfg: ModelConfig) -> int:
  """The row length of the inputs that initialise a model: 8 tokens, or one compressed block
  (compressed attention cuts rows into whole blocks); only shapes matter."""
  return cfg.compress_block if cfg.attention == 'compressed' else 8


_FAMILIES = {
  'encoder_decoder': EncoderDecoder,
  'bidirectional_lm': BidirectionalLM,
  'causal_lm': CausalLM,
}


def build(cfg: ModelConfig) -> nn.Module:
  """The model of `cfg.family`."""
  return _FAMILIES[cfg.family](cfg)


def init_variables(model: nn.Module, rng: Array, *, boxed: bool = False) -> dict[str, Any]:
  """Fresh {'params': ...} of `model`, plus {'batch_stats': ...} (running mean 0, variance 1)
  when model.norm='batchnorm'; plain arrays, or with `boxed`, with their logical axes."""
  init = model.init(rng, **model.dummy_inputs())  # shapes do not depend on B or T
  out = {k: init[k] for k in ('params', 'batch_stats') if k in init}
  return out if boxed else nn.meta.unbox(out)


def init_params(model: nn.Module, rng: Array, *, boxed: bool = False) -> Any:
  """Fresh parameters of `model`, as plain arrays (or, with `boxed`, with their logical axes)."""
  return init_variables(model, rng, boxed=boxed)['params']


def variables(weights: Any) -> dict[str, Any]:
  """The flax variables to apply a model with: a parameter tree becomes {'params': weights}; a
  variables dict (one with a 'params' entry, such as a batchnorm model's {'params': ...,
  'batch_stats': ...} from `training.state.weights`) is used as it is."""
  if isinstance(weights, Mapping) and 'params' in weights:  # no module is named 'params'
    return dict(weights)
  return {'params': weights}


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
    # Embedding lookups are gathers, not matmuls; biases and norm scales are 1D.
    if leaf.ndim >= 2 and 'embedding' not in name and not name.endswith("['bias']"):
      matmul_params += math.prod(leaf.shape)
  if cfg.tie_output and cfg.num_classes == 0:  # the tied head is a matmul with the embedding
    matmul_params += cfg.vocab_size * cfg.d_model
  attn_width = cfg.num_heads * cfg.head_size
  layers = cfg.num_layers
  if cfg.family == 'encoder_decoder':
    layers += 2 * cfg.decoder_layers  # decoder self + cross attention
  attention = 2 * 2 * seq_len * attn_width * layers  # q.k logits and probs.v, 2 FLOPs per MAC
  forward = 2 * matmul_params + attention
  return {'forward': float(forward), 'train': float(3 * forward), 'matmul_params': matmul_params}
