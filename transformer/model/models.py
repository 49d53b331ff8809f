"""GPT, and the block and stack every family is made of: `Block`, `Stack`, the `Encoder` and
`Decoder` over them, the output heads and `CausalLM`; `build(cfg)` makes the model of any family.

A token through CausalLM, from ids to logits:

  inputs [B, T]: int token ids; ids == cfg.pad_id get segment id 0, which masks them
  Decoder
    Embedder (layers.py): the token table (x sqrt(D) where the model scales), then learned or
      sinusoidal positions where the model has them                [B, T] -> [B, T, D]
    Stack of Blocks, each one:                                      [B, T, D] -> [B, T, D]
      causal self attention (attention.MultiHeadAttention): token t sees tokens <= t
      the MLP (layers.FeedForward or GatedFeedForward), none when d_ff = 0
      each in the residual wiring that `parts` picked (pre- or post-norm, or none)
    the final norm at the end of the Stack with pre-norm wiring
  TiedHead: x @ embedding.T (layers.Embed.attend), or UntiedHead   [B, T, D] -> [B, T, V]

The 2017 encoder-decoder (encoder_decoder.py) adds cross attention in its own block; BERT
(bidirectional.py) is the Encoder plus an MLM or classifier head.
"""

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
from transformer.kernels.masks import MaskSpec
from transformer.model.attention import CacheMode, MultiHeadAttention
from transformer.model.layers import HookPoint, constrain, dense, kernel_init, residual_out_init
from transformer.model.parts import parts

Array = jax.Array


def _segments(tokens: Array, segments: Array | None, pad_id: int | None) -> Array | None:
  """Segment ids [B, T]: given ones, else 1 for real tokens and 0 for `pad_id`, else None."""
  if segments is not None or pad_id is None:
    return segments
  return (tokens != pad_id).astype(jnp.int32)


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
    p, det = self.parts, self.deterministic
    drop = functools.partial(nn.Dropout(self.cfg.dropout_rate), deterministic=det)  # one for all
    # The norm `<sub-layer>_<suffix>`; segment 0 is padding, which BatchNorm skips.
    norm = lambda name, suffix: functools.partial(
      p.norm(name=f'{name}_{suffix}'), segments=mask.q_segment_ids, deterministic=det
    )
    x = HookPoint(name='hook_resid_pre')(x)  # [B, T, D]
    x = p.block(x, self._sublayers(mask, positions, *context), p.sublayer, norm, drop)
    x = HookPoint(name='hook_resid_post')(constrain(x, ('batch', 'length', 'embed')))  # [B, T, D]
    return (x, None) if self.scanned else x

  def _sublayers(self, mask: MaskSpec, positions: Array | None) -> list:
    """[(name, f, output hook)]: self attention (causal in a decoder, not in an encoder: the
    mask says which), then the MLP if the model has one."""
    attention = self._attention('self_attention', self.parts.relative_positions)
    conv = self.parts.short_conv(name='short_conv') if self.parts.short_conv else None
    modes = dict(deterministic=self.deterministic, cache_mode=self.cache_mode)

    def mix(h):  # [B, T, D] -> [B, T, D]
      h = conv(h, mask, positions, self.cache_mode) if conv else h
      return attention(h, mask=mask, positions=positions, **modes)

    mlp = self._mlp() if self.parts.mlp else []  # none with d_ff=0: attention only
    return [('self_attention', mix, HookPoint(name='hook_attn_out'))] + mlp

  def _attention(self, name: str, relative_positions) -> nn.Module:
    cfg, p, out_init = self.cfg, self.parts, residual_out_init(self.cfg, self.num_layers)
    return MultiHeadAttention(
      cfg, p.attention, kernel_init(cfg), out_init, relative_positions, p.qk_norm, name=name
    )

  def _mlp(self) -> list:
    ffn = self.parts.mlp(self.cfg, residual_out_init(self.cfg, self.num_layers), name='mlp')
    return [('mlp', lambda h: ffn(h, self.deterministic), HookPoint(name='hook_mlp_out'))]


class Stack(nn.Module):
  """`num_layers` blocks, run as `parts` picked (a loop or a scan, each block rematerialised or
  not), then the final norm of pre-norm wiring."""

  cfg: ModelConfig
  parts: Any  # parts.Parts of cfg
  num_layers: int
  block: type[nn.Module] = Block  # encoder_decoder.CrossBlock in the 2017 decoder

  @nn.compact
  def __call__(self, x, mask: MaskSpec, positions, *context, deterministic: bool, cache_mode=None):
    """x [B, T, D] -> [B, T, D]; `context`: the block's extra arguments (CrossBlock's)."""
    p = self.parts
    block = p.remat(self.block) if p.remat else self.block
    block = functools.partial(block, self.cfg, p, self.num_layers, deterministic,
                              cache_mode=cache_mode)  # fmt: skip
    x = p.layers(block, self.num_layers, x, mask, positions, *context)  # [B, T, D]
    if p.final_norm:  # pre-norm's residual stream was never normalised
      x = p.norm(name='final_norm')(x, mask.q_segment_ids, deterministic)
    return x  # [B, T, D]


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
  below the head; the 2017 decoder passes `encoder_decoder.CrossBlock`, and the encoder's output
  as `context`."""

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
  """Whether `head_inputs=True` works for `cfg`: a tied head that predicts tokens, uncapped."""
  return cfg.tie_output and cfg.num_classes == 0 and cfg.logit_softcap is None


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


class _Softcapped:
  """A head whose logits are soft-capped to cap * tanh(logits / cap) in float32 (Gemma 2's final
  logits, cap = cfg.logit_softcap)."""

  @nn.compact
  def __call__(self, x: Array, head_inputs: bool = False) -> Array:
    logits, cap = super().__call__(x, head_inputs), self.cfg.logit_softcap
    return (cap * jnp.tanh(logits.astype(jnp.float32) / cap)).astype(logits.dtype)  # [B, T, V]


class SoftcappedTiedHead(_Softcapped, TiedHead):
  pass


class SoftcappedUntiedHead(_Softcapped, UntiedHead):
  pass


# (tie_output, soft-capped) -> CausalLM's head
HEADS = {
  (True, False): TiedHead,
  (False, False): UntiedHead,
  (True, True): SoftcappedTiedHead,
  (False, True): SoftcappedUntiedHead,
}


class CausalLM(nn.Module):
  """GPT: tokens [B, T] -> next-token logits [B, T, V]."""

  cfg: ModelConfig

  def setup(self):
    cfg, head = self.cfg, HEADS[self.cfg.tie_output, self.cfg.logit_softcap is not None]
    self.embedding = parts(cfg).embed(cfg)
    self.decoder = Decoder(cfg, self.embedding, cfg.num_layers)
    self.head = head(cfg, self.embedding)

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


def _dummy_length(cfg: ModelConfig) -> int:
  """The row length of the inputs that initialise a model: 8 tokens, or one compressed block
  (compressed attention cuts rows into whole blocks); only shapes matter."""
  return cfg.compress_block if cfg.attention == 'compressed' else 8


# family -> model class. encoder_decoder.py and bidirectional.py add theirs when the package is
# imported (transformer/model/__init__.py); a new family is one file like them and one line there.
FAMILIES: dict[str, type[nn.Module]] = {'causal_lm': CausalLM}


def build(cfg: ModelConfig) -> nn.Module:
  """The model of `cfg.family`."""
  return FAMILIES[cfg.family](cfg)


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
