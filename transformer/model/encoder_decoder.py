"""The 2017 Transformer for translation: `EncoderDecoder`, and `CrossBlock`, the decoder's layer
with cross attention (the other families never see it).

A token through EncoderDecoder, from ids to logits:

  inputs [B, S], decoder_inputs [B, T]: int token ids; ids == cfg.pad_id get segment id 0
  Encoder (models.py): embeddings, then a Stack of Blocks, self attention not causal
                                                                   [B, S] -> [B, S, D]
  Decoder (models.py): the target embeddings, then a Stack of CrossBlocks, each one:
    causal self attention: token t sees decoder tokens <= t
    cross attention: queries from the decoder, keys/values from the encoder output [B, S, D]
    the MLP; the residual wiring around each                       [B, T] -> [B, T, D]
  the head: tied to the target embedding, or its own matrix       [B, T, D] -> [B, T, V]
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.config import ModelConfig
from transformer.kernels.masks import MaskSpec
from transformer.model import models
from transformer.model.attention import CacheMode
from transformer.model.layers import HookPoint
from transformer.model.models import Block, Decoder, Encoder, _dummy_length, _segments
from transformer.model.parts import parts

Array = jax.Array


class CrossBlock(Block):
  """A layer of the 2017 decoder: causal self attention, cross attention to the encoder output,
  then the MLP. Called as (x, self_mask, positions, encoded [B, S, D], cross_mask)."""

  def _sublayers(self, mask, positions, encoded, cross_mask) -> list:
    """Self attention, cross attention, the MLP. RoPE and ALiBi act in self attention only:
    decoder and encoder positions index different sequences, so their distance means nothing.
    Queries from x [B, T, D], keys/values from the encoder output [B, S, D]."""
    attention, modes = (
      self._attention('cross_attention', None),
      dict(deterministic=self.deterministic, cache_mode=self.cache_mode),
    )
    cross = lambda h: attention(h, encoded, mask=cross_mask, **modes)
    self_attention, *mlp = super()._sublayers(mask, positions)
    return [self_attention, ('cross_attention', cross, HookPoint(name='hook_cross_attn_out'))] + mlp


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
    head = models.TiedHead if cfg.tie_output else models.UntiedHead
    self.head = head(cfg, target)  # tied to the target embedding when cfg.tie_output

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


models.FAMILIES['encoder_decoder'] = EncoderDecoder
