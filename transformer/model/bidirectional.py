"""BERT: `BidirectionalLM`, the Encoder (models.py) with a masked-LM head, a classifier on the first
token, or no head. Its token types and embedding norm live in its embedder
(`layers.TypedEmbedder`), which only this family uses."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from transformer.config import ModelConfig
from transformer.model import models
from transformer.model.layers import ACTIVATIONS, dense
from transformer.model.models import Encoder, HeadInputs, _dummy_length, _segments, has_fused_head
from transformer.model.parts import parts


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


models.FAMILIES['bidirectional_lm'] = BidirectionalLM
