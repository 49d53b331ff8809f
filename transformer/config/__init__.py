"""The frozen `ModelConfig`: every architecture knob, validated once, with clear errors.

Build it from an experiment ConfigDict (`ModelConfig.from_config(config.model)`). The rest of an
experiment (data, train, optim, mesh) and its defaults live beside it, in `config.experiment`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import warnings
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

FAMILIES = ('encoder_decoder', 'bidirectional_lm', 'causal_lm')
POSITIONS = ('sinusoidal', 'learned', 'rope', 'alibi', 'none')
ROPE_SCALINGS = ('none', 'linear', 'ntk', 'yarn', 'llama3')
# rmsnorm_offset: RMSNorm whose weight w multiplies as (1 + w), starting at 0 (Gemma's)
NORMS = ('layernorm', 'rmsnorm', 'batchnorm', 'rmsnorm_offset')
NORM_PLACEMENTS = ('pre', 'post', 'sandwich')
ACTIVATIONS = ('relu', 'gelu', 'gelu_tanh', 'swiglu', 'geglu')  # geglu: gated gelu_tanh (Gemma)
# The names a config may choose; `model.attention.register_implementation` adds its own here.
ATTENTION_IMPLEMENTATIONS = [None, 'xla', 'chunked', 'pallas', 'cudnn']
# the attention itself; the implementations above are softmax's
ATTENTIONS = ('softmax', 'linear', 'compressed')
LINEAR_FEATURE_MAPS = ('elu', 'relu', 'softplus')  # phi of linear attention (elu = elu(x) + 1)
INITS = ('scaled', 'plain', 'large')
INIT_DISTRIBUTIONS = ('xavier', 'normal')
REMAT_POLICIES = ('none', 'full', 'save_matmuls')
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16, 'float16': jnp.float16}


def _derived() -> Any:
  """A field that __post_init__ computes from the knobs: not an argument, not compared."""
  return dataclasses.field(init=False, repr=False, compare=False)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of one model. Defaults are the 2017 base Transformer with a byte vocabulary."""

  family: str = 'encoder_decoder'  # one of FAMILIES
  vocab_size: int = 261  # shared source/target vocabulary (byte tokenizer: 256 + 5 specials)
  d_model: int = 512  # residual stream width
  num_heads: int = 8  # query heads
  num_kv_heads: int | None = None  # key/value heads (GQA/MQA); None = num_heads
  head_dim: int | None = None  # None = d_model // num_heads
  d_ff: int = 2048  # feed-forward hidden width; 0: attention-only layers (no MLP)
  num_layers: int = 6  # encoder layers, or the only stack of an LM
  num_decoder_layers: int | None = None  # EncoderDecoder only; None = num_layers
  max_length: int = 512  # longest sequence for learned positions
  position: str = 'sinusoidal'  # one of POSITIONS
  rope_theta: float = 10000.0  # RoPE base
  rope_dim: int | None = None  # RoPE turns each head's first rope_dim dims (NeoX: H/4); None: all
  rope_scaling: str = 'none'  # RoPE context scaling, one of ROPE_SCALINGS
  rope_scaling_factor: float = 1.0  # how much longer than the trained context to reach
  rope_original_max_length: int | None = None  # trained context (YaRN, llama3); None = max_length
  rope_low_freq_factor: float = (
    1.0  # llama3 scaling: wavelengths over context / this are interpolated
  )
  rope_high_freq_factor: float = 4.0  # llama3 scaling: wavelengths under context / this are kept
  norm: str = 'layernorm'  # one of NORMS; batchnorm: statistics over a batch's real tokens
  norm_eps: float = 1e-6  # epsilon inside the norm
  # 'post' (paper: norm after the residual add), 'pre' (+ final norm) or 'sandwich' (Gemma 2: pre,
  # and a second norm on each sub-layer's output)
  norm_placement: str = 'post'
  embedding_norm: bool = False  # a norm right after the embeddings (BERT)
  residual: bool = True  # residual connections around each sub-layer; False ablates them
  parallel_residual: bool = False  # GPT-NeoX/GPT-J: x + attn(norm1(x)) + mlp(norm2(x)), pre-norm
  activation: str = 'relu'  # one of ACTIVATIONS
  use_bias: bool = True  # biases in the attention and feed-forward projections
  norm_bias: bool = True  # Layer/BatchNorm's bias; False as nanoGPT's bias=False (RMSNorm: none)
  qkv_bias: bool | None = None  # biases on the query/key/value projections; None = use_bias (Qwen2)
  qk_norm: bool = False  # a norm (of `norm` kind) over head_dim on queries and keys (Qwen3)
  dropout_rate: float = 0.1  # embeddings and residual branches
  attention_dropout_rate: float = 0.0  # attention probabilities (forces the 'xla' path in training)
  ffn_dropout_rate: float = 0.0  # hidden layer of the feed-forward
  scale_embeddings: bool = True  # multiply token embeddings by sqrt(d_model) (paper)
  share_embeddings: bool = True  # EncoderDecoder: one table for source and target
  tie_output: bool = True  # the output projection is the transposed target embedding
  output_bias: bool = False  # a bias on the untied output projection (TransformerLens's b_U)
  attention_scale: bool = True  # scale logits by 1/sqrt(head_dim); False = the ablation
  query_pre_attn_scalar: float | None = None  # Gemma: scale by this^-0.5 instead; None = head_dim
  attention_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap); None: off
  logit_softcap: float | None = None  # Gemma 2: the same on the output logits; None: off
  attention: str = 'softmax'  # one of ATTENTIONS: softmax, or linear (Katharopoulos et al. 2020)
  linear_feature_map: str = 'elu'  # attention='linear': phi, one of LINEAR_FEATURE_MAPS
  short_conv: int = 0  # causal depthwise convolution of this many taps before self attention
  compress_block: int = 16  # attention='compressed': positions pooled per block; divides rows
  attention_impl: str | None = None  # one of ATTENTION_IMPLEMENTATIONS; None = pick for the backend
  attention_chunk_size: int = 128  # key block of the 'chunked' path
  window: tuple[int, int] | None = None  # self-attention sliding window (left, right)
  # Per-layer 'L' (local: the window) or 'G' (global: none), repeated over the layers: 'LG' is
  # Gemma 2's, 'GL' GPT-Neo's, 'LLLLLG' Gemma 3's; '' = every layer uses `window`.
  attention_layers: str = ''
  rope_local_theta: float | None = (
    None  # RoPE base of the local layers (Gemma 3); None = rope_theta
  )
  init: str = 'scaled'  # 'scaled' shrinks residual-branch outputs by 1/sqrt(2*layers); 'plain';
  # 'large' grows them by sqrt(2*layers), the deliberate opposite (an ablation)
  init_distribution: str = 'xavier'  # weight init: 'xavier' uniform or 'normal' with init_std
  init_std: float = 0.02  # std of 'normal' weights and of unscaled embeddings
  type_vocab_size: int = 0  # BidirectionalLM token types (BERT: 2)
  num_classes: int = 0  # BidirectionalLM: >0 replaces the MLM head by a classifier
  output_head: bool = True  # BidirectionalLM: False returns the final hidden states [B, T, D]
  pad_id: int | None = 0  # token id treated as padding when no segment ids are given
  dtype: str = 'float32'  # compute dtype: float32 | bfloat16 | float16
  param_dtype: str = 'float32'  # parameter storage dtype
  remat: str = 'none'  # gradient checkpointing of each block: one of REMAT_POLICIES
  scan_layers: bool = False  # nn.scan over identical blocks for fast compiles

  # Derived sizes, resolved once from the knobs above: read them, never set them (not saved).
  kv_heads: int = _derived()  # num_kv_heads or num_heads
  head_size: int = _derived()  # head_dim or d_model // num_heads
  decoder_layers: int = _derived()  # num_decoder_layers or num_layers
  compute_dtype: Any = _derived()  # the jnp dtype of `dtype`
  params_dtype: Any = _derived()  # the jnp dtype of `param_dtype`

  def __post_init__(self):
    # Lists and dicts from ConfigDicts become hashable tuples.
    if self.window is not None:
      window = self.window
      if isinstance(window, (str, bytes)) or not hasattr(window, '__iter__'):
        raise ValueError(f'window={window!r} must be a pair (left, right) of non-negative integers')
      if not all(isinstance(w, int) and not isinstance(w, bool) for w in window):
        raise ValueError(f'window={window!r} must be a pair (left, right) of non-negative integers')
      object.__setattr__(self, 'window', tuple(window))
    _check_knobs(self)
    derived = dict(
      kv_heads=self.num_kv_heads or self.num_heads,
      head_size=self.head_dim or self.d_model // self.num_heads,
      decoder_layers=self.num_layers
      if self.num_decoder_layers is None
      else self.num_decoder_layers,
      compute_dtype=DTYPES[self.dtype],
      params_dtype=DTYPES[self.param_dtype],
    )
    for name, value in derived.items():
      object.__setattr__(self, name, value)
    _check_sizes(self)
    _check_combinations(self)
    if self.position == 'sinusoidal' and not self.scale_embeddings and self.init_std < 0.1:
      warnings.warn(
        f'position=sinusoidal with scale_embeddings=False: the table (RMS 0.71) is '
        f'{math.sqrt(0.5) / self.init_std:.0f}x the token embeddings (std init_std='
        f'{self.init_std}) and drowns them; set scale_embeddings=True (the paper) or use '
        'position=learned',
        stacklevel=2,
      )

  # Constructors ------------------------------------------------------------------------------
  @classmethod
  def from_config(cls, model_config: Mapping[str, Any] | Any) -> ModelConfig:
    """Builds from a ConfigDict or mapping; an unknown key is an error that lists the valid ones."""
    items = dict(model_config.items()) if hasattr(model_config, 'items') else dict(model_config)
    names = set(KNOBS)
    unknown = sorted(set(items) - names)
    if unknown:
      raise ValueError(
        f'unknown model config key {unknown[0]!r}; valid keys are: {", ".join(sorted(names))}'
      )
    return cls(**items)

  def replace(self, **changes: Any) -> ModelConfig:
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    """The knobs (not the derived sizes): what config.json saves and `from_config` reads."""
    return {name: getattr(self, name) for name in KNOBS}

  def __getattr__(self, name: str) -> Any:
    """TransformerLens's names read sparrow's values (`cfg.n_layers` is `cfg.num_layers`); any
    other unknown name is an error that offers the closest names of both."""
    if name in TL_NAMES:
      value = TL_NAMES[name]
      return value(self) if callable(value) else getattr(self, value)
    if name.startswith('_'):  # copy, pickle and friends probe for these
      raise AttributeError(name)
    known = [*KNOBS, *_DERIVED, *TL_NAMES]
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f'; did you mean {" or ".join(close)}?' if close else ''
    raise AttributeError(
      f"'ModelConfig' has no attribute {name!r}{hint} (sparrow's names are the keys of "
      "config.json; TransformerLens's n_layers, n_heads, d_head, d_mlp, ... read them too)"
    )


# The settable fields, in declaration order; the rest are derived in __post_init__.
KNOBS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.init)
_DERIVED = tuple(f.name for f in dataclasses.fields(ModelConfig) if not f.init)
# TransformerLens's HookedTransformerConfig names -> sparrow's field, or how to compute the value.
_TL_ACTIVATIONS = {'relu': 'relu', 'gelu': 'gelu', 'gelu_tanh': 'gelu_new', 'swiglu': 'silu',
                   'geglu': 'gelu_pytorch_tanh'}  # fmt: skip
TL_NAMES: dict[str, Any] = {
  'n_layers': 'num_layers',
  'n_heads': 'num_heads',
  'n_key_value_heads': 'kv_heads',
  'd_head': 'head_size',
  'd_mlp': 'd_ff',
  'd_vocab': 'vocab_size',
  'd_vocab_out': 'vocab_size',
  'n_ctx': 'max_length',
  'eps': 'norm_eps',
  'act_fn': lambda c: _TL_ACTIVATIONS[c.activation],
  'gated_mlp': lambda c: c.activation in ('swiglu', 'geglu'),
  'normalization_type': lambda c: {
    'layernorm': 'LN',
    'rmsnorm': 'RMS',
    'rmsnorm_offset': 'RMS',
  }.get(c.norm, c.norm),
  'attn_scores_soft_cap': lambda c: c.attention_softcap or -1.0,
  'output_logits_soft_cap': lambda c: c.logit_softcap or -1.0,
  'use_attn_scale': 'attention_scale',
  'attn_scale': lambda c: math.sqrt(c.query_pre_attn_scalar or c.head_size),
  'rotary_base_local': 'rope_local_theta',
  'parallel_attn_mlp': 'parallel_residual',
  'rotary_dim': lambda c: c.rope_dim or c.head_size,
  'use_normalization_before_and_after': lambda c: c.norm_placement == 'sandwich',
  'positional_embedding_type': lambda c: {'learned': 'standard', 'rope': 'rotary'}.get(
    c.position, c.position
  ),
}


def _choice(name: str, value: Any, valid: tuple) -> None:
  if value not in valid:
    shown = ', '.join(repr(v) for v in valid)
    raise ValueError(f'{name}={value!r} is not valid; choose one of {shown}')


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


# What each single knob must be, in the order they are checked (the first bad value raises):
# a tuple of choices (or a function returning them), or a kind below; 'optional' allows None.
_RULES: dict[str, Any] = {
  'family': FAMILIES,
  'position': POSITIONS,
  'rope_scaling': ROPE_SCALINGS,
  'norm': NORMS,
  'norm_placement': NORM_PLACEMENTS,
  'activation': ACTIVATIONS,
  'attention_impl': lambda: ATTENTION_IMPLEMENTATIONS,  # read when checked: it can grow
  'attention': ATTENTIONS,
  'linear_feature_map': LINEAR_FEATURE_MAPS,
  'init': INITS,
  'init_distribution': INIT_DISTRIBUTIONS,
  'remat': REMAT_POLICIES,
  'dtype': tuple(DTYPES),
  'param_dtype': tuple(DTYPES),
  **dict.fromkeys(('embedding_norm', 'use_bias', 'scale_embeddings', 'share_embeddings'), 'bool'),
  **dict.fromkeys(('tie_output', 'attention_scale', 'scan_layers', 'qk_norm'), 'bool'),
  **dict.fromkeys(('output_head', 'norm_bias', 'output_bias', 'parallel_residual'), 'bool'),
  **dict.fromkeys(('rope_theta', 'norm_eps', 'init_std'), 'positive number'),
  **dict.fromkeys(
    ('query_pre_attn_scalar', 'attention_softcap', 'logit_softcap', 'rope_local_theta'),
    'optional positive number',
  ),
  'rope_scaling_factor': 'at least 1',
  **dict.fromkeys(('dropout_rate', 'attention_dropout_rate', 'ffn_dropout_rate'), 'rate'),
  **dict.fromkeys(('rope_low_freq_factor', 'rope_high_freq_factor'), 'finite'),
  **dict.fromkeys(('type_vocab_size', 'num_classes', 'short_conv'), 'count'),
  'd_ff': 'count',  # 0: attention-only layers
  **dict.fromkeys(('pad_id', 'num_decoder_layers'), 'optional count'),
  **dict.fromkeys(('vocab_size', 'd_model', 'num_heads', 'num_layers', 'max_length'), 'positive'),
  'attention_chunk_size': 'positive',
  'attention_layers': 'string',
  **dict.fromkeys(('num_kv_heads', 'head_dim', 'rope_original_max_length'), 'optional positive'),
  'rope_dim': 'optional positive',
}


def _number(test):
  return lambda v: (
    isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and test(v)
  )


_KINDS = {  # kind: (test, what the message says the value must be)
  'bool': (lambda v: isinstance(v, bool), 'be True or False'),
  'finite': (_number(lambda v: True), 'be a finite number'),
  'positive number': (_number(lambda v: v > 0), 'be a finite number > 0'),
  'at least 1': (_number(lambda v: v >= 1), 'be a finite number >= 1.0'),
  'rate': (_number(lambda v: 0 <= v < 1), 'be in [0, 1)'),
  'count': (lambda v: _is_int(v) and v >= 0, 'be an integer >= 0'),
  'string': (lambda v: isinstance(v, str), 'be a string'),
  'positive': (lambda v: _is_int(v) and v > 0, 'be a positive integer'),
}


def _check_knobs(c: ModelConfig) -> None:
  """Raises one ValueError that names the first bad value and what would be valid."""
  for name, rule in _RULES.items():
    value = getattr(c, name)
    rule = rule() if callable(rule) else rule
    if isinstance(rule, tuple | list):
      _choice(name, value, tuple(rule))
    elif not (rule.startswith('optional') and value is None):
      test, must = _KINDS[rule.removeprefix('optional ')]
      if not test(value):
        raise ValueError(f'{name}={value!r} must {must}')


def _check_sizes(c: ModelConfig) -> None:
  """A head layout that divides evenly, even widths where positions pair up dimensions."""
  if c.head_dim is None and c.d_model % c.num_heads:
    divisors = [n for n in range(1, c.d_model + 1) if c.d_model % n == 0 and n <= 64]
    raise ValueError(
      f'num_heads={c.num_heads} does not divide d_model={c.d_model}; '
      f'choose a divisor of {c.d_model} such as {divisors[-4:]} or set head_dim'
    )
  if c.num_heads % c.kv_heads:
    raise ValueError(
      f'num_kv_heads={c.kv_heads} does not divide num_heads={c.num_heads}; '
      f'choose a divisor of {c.num_heads}'
    )
  if c.position == 'rope' and c.head_size % 2:
    raise ValueError(f'position=rope needs an even head dimension, got head_dim={c.head_size}')
  if c.rope_dim is not None and (
    c.position != 'rope' or c.rope_dim % 2 or c.rope_dim > c.head_size
  ):
    raise ValueError(
      f'rope_dim={c.rope_dim} must be an even number of dims, at most the head size '
      f'{c.head_size}, with position=rope (this config: position={c.position!r}); or None (all)'
    )
  if c.position == 'sinusoidal' and c.d_model % 2:
    raise ValueError(f'position=sinusoidal needs an even d_model, got d_model={c.d_model}')
  if c.window is not None and (len(c.window) != 2 or min(c.window) < 0):
    raise ValueError(f'window={c.window} must be a pair (left, right) of non-negative integers')


def _check_combinations(c: ModelConfig) -> None:
  """Knobs that only some families, attention kinds, norms or kernels accept."""
  if c.attention_dropout_rate > 0 and c.attention_impl not in (None, 'xla'):
    raise ValueError(
      f'attention_dropout_rate={c.attention_dropout_rate} needs the materialised probabilities of '
      f"attention_impl='xla' (or None), not {c.attention_impl!r}; set attention_dropout_rate=0"
    )
  if c.parallel_residual and (
    c.norm_placement != 'pre' or not c.residual or c.family not in ('causal_lm', 'bidirectional_lm')
  ):
    raise ValueError(
      f'parallel_residual=True adds attention and MLP, each after its own norm, to one residual '
      f"stream: it needs norm_placement='pre', residual=True and a causal_lm or bidirectional_lm; "
      f'this config has norm_placement={c.norm_placement!r}, residual={c.residual}, '
      f'family={c.family!r}'
    )
  if c.short_conv and c.family != 'causal_lm':
    raise ValueError(
      f'short_conv={c.short_conv} is a causal convolution for a decoder-only model '
      f"(family='causal_lm'), not family={c.family!r}; set short_conv=0"
    )
  if c.attention == 'linear':
    _check_linear(c)
  if c.attention == 'compressed':
    _check_compressed(c)
  if c.family == 'encoder_decoder' and c.type_vocab_size:
    raise ValueError('type_vocab_size is for family=bidirectional_lm only; set it to 0')
  if c.num_classes and c.family != 'bidirectional_lm':
    raise ValueError(f'num_classes={c.num_classes} is for family=bidirectional_lm only')
  if c.qkv_bias is not None and not isinstance(c.qkv_bias, bool):
    raise ValueError(f'qkv_bias={c.qkv_bias!r} must be True, False or None (= use_bias)')
  if c.output_bias and (c.tie_output or c.family == 'bidirectional_lm'):
    raise ValueError(
      f'output_bias=True is a bias on the untied output projection of a causal_lm or '
      f'encoder_decoder; this config has tie_output={c.tie_output}, family={c.family!r}'
    )
  if not c.output_head and (c.family != 'bidirectional_lm' or c.num_classes):
    raise ValueError(
      'output_head=False (hidden states out) is for family=bidirectional_lm with num_classes=0'
    )
  if c.norm == 'batchnorm' and c.qk_norm:
    raise ValueError(
      "qk_norm=True normalises each head's queries and keys with the norm of model.norm, and "
      "norm='batchnorm' has no per-head form; use qk_norm=False, or norm='layernorm' or 'rmsnorm'"
    )
  _check_gemma(c)
  if c.rope_scaling == 'llama3' and not 0 < c.rope_low_freq_factor < c.rope_high_freq_factor:
    raise ValueError(
      f'rope_low_freq_factor={c.rope_low_freq_factor} and rope_high_freq_factor='
      f'{c.rope_high_freq_factor} must satisfy 0 < low < high for rope_scaling=llama3'
    )


def _check_gemma(c: ModelConfig) -> None:
  """The knobs that Gemma and GPT-Neo brought: per-layer windows, soft-capping, the query scale."""
  pattern = c.attention_layers
  if not isinstance(pattern, str) or set(pattern) - {'L', 'G'}:
    raise ValueError(
      f"attention_layers={pattern!r} must be a string of 'L' (local) and 'G' (global), e.g. 'LG'"
    )
  if pattern and ('L' not in pattern or c.window is None or c.scan_layers):
    raise ValueError(
      f'attention_layers={pattern!r} gives its local layers the sliding window and its global '
      f'layers none: it needs an L, a window and scan_layers=False (this config: '
      f'window={c.window}, scan_layers={c.scan_layers})'
    )
  if c.rope_local_theta is not None and (c.position != 'rope' or 'L' not in pattern):
    raise ValueError(
      f'rope_local_theta={c.rope_local_theta} is the RoPE base of the local layers: it needs '
      f"position='rope' and local layers in attention_layers (this config: {c.position!r}, "
      f'{pattern!r})'
    )
  if c.attention_softcap is not None and (
    c.attention != 'softmax' or c.position == 'alibi' or c.attention_impl in ('pallas', 'cudnn')
  ):
    raise ValueError(
      f'attention_softcap={c.attention_softcap} caps softmax logits on the xla and chunked paths, '
      f'before the mask and without ALiBi; this config has attention={c.attention!r}, '
      f'position={c.position!r}, attention_impl={c.attention_impl!r}'
    )
  if c.logit_softcap is not None and c.family != 'causal_lm':
    raise ValueError(
      f'logit_softcap={c.logit_softcap} caps the next-token logits of a causal_lm (Gemma 2), not '
      f'family={c.family!r}; set logit_softcap=None'
    )
  if c.query_pre_attn_scalar is not None and not c.attention_scale:
    raise ValueError(
      f'query_pre_attn_scalar={c.query_pre_attn_scalar} sets the logits scale, which '
      'attention_scale=False turns off; keep one of them'
    )


def _check_compressed(c: ModelConfig) -> None:
  """attention='compressed' pools keys over blocks of self attention: no window, ALiBi, softmax
  kernel, probability dropout or cross attention, and a block that divides the context."""
  block = c.compress_block
  if isinstance(block, bool) or not isinstance(block, int) or block < 1:
    raise ValueError(f'compress_block={block!r} must be a positive integer')
  if c.max_length % block:
    raise ValueError(
      f'compress_block={block} does not divide max_length={c.max_length}: every row is cut into '
      'whole blocks; choose a divisor of it'
    )
  if c.window is not None:
    raise ValueError(
      f"window={c.window} does not combine with attention='compressed', whose own block is "
      'already its local window; set window=None'
    )
  if c.position == 'alibi':
    raise ValueError(
      "position='alibi' biases each key by its distance, which a pooled block does not have; "
      "with attention='compressed' use rope, learned or sinusoidal"
    )
  if c.attention_impl is not None:
    raise ValueError(
      f"attention_impl={c.attention_impl!r} picks a softmax kernel; attention='compressed' has "
      'its own path, so leave attention_impl=None'
    )
  if c.attention_dropout_rate > 0:
    raise ValueError(
      f'attention_dropout_rate={c.attention_dropout_rate} is not available with '
      "attention='compressed'; set it to 0"
    )
  if c.family == 'encoder_decoder':
    raise ValueError(
      "attention='compressed' pools the keys of self attention; the encoder-decoder's cross "
      "attention cannot use it. Use family='causal_lm' or 'bidirectional_lm'"
    )


def _check_linear(c: ModelConfig) -> None:
  """attention='linear' folds all visible keys into one state: no window, bias or probabilities."""
  if c.window is not None:
    raise ValueError(
      f"window={c.window} needs attention='softmax': linear attention folds every visible key "
      'into one state, so a sliding window does not apply; set window=None'
    )
  if c.position == 'alibi':
    raise ValueError("position='alibi' biases softmax logits; with attention='linear' use rope")
  if c.attention_impl is not None:
    raise ValueError(
      f"attention_impl={c.attention_impl!r} picks a softmax kernel; attention='linear' has its "
      'own path, so leave attention_impl=None'
    )
  if c.attention_dropout_rate > 0:
    raise ValueError(
      f'attention_dropout_rate={c.attention_dropout_rate} drops softmax probabilities, which '
      "attention='linear' never forms; set it to 0"
    )
