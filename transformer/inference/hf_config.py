"""Hugging Face config.json <-> sparrow model config: which architecture a folder holds, and how
each of its fields maps onto `ModelConfig` (GPT-2, BERT and the Llama family), both ways."""

from __future__ import annotations

from typing import Any

import ml_collections

from transformer import config as config_lib
from transformer.config import ModelConfig, experiment

ARCHS = ('gpt2', 'bert', 'llama', 'qwen2', 'qwen3', 'mistral')
LLAMA_FAMILY = ('llama', 'qwen2', 'qwen3', 'mistral')
# config.json `architectures` entries -> arch, for files whose model_type is missing.
_ARCHITECTURES = {
  'GPT2LMHeadModel': 'gpt2',
  'GPT2Model': 'gpt2',
  'BertModel': 'bert',
  'BertForMaskedLM': 'bert',
  'BertForPreTraining': 'bert',
  'BertForSequenceClassification': 'bert',
  'LlamaForCausalLM': 'llama',
  'Qwen2ForCausalLM': 'qwen2',
  'Qwen3ForCausalLM': 'qwen3',
  'MistralForCausalLM': 'mistral',
}
_CAUSAL_LM = {arch: name for name, arch in _ARCHITECTURES.items() if name.endswith('ForCausalLM')}
# Config keys both ways: (sparrow model key, config.json key, Hugging Face's default for it).
_CONFIG_KEYS = {
  'gpt2': (
    ('vocab_size', 'vocab_size', 50257),
    ('d_model', 'n_embd', 768),
    ('num_heads', 'n_head', 12),
    ('d_ff', 'n_inner', None),  # None = 4 * n_embd
    ('num_layers', 'n_layer', 12),
    ('max_length', 'n_positions', 1024),
    ('norm_eps', 'layer_norm_epsilon', 1e-5),
    ('activation', 'activation_function', 'gelu_new'),
    ('dropout_rate', 'resid_pdrop', 0.1),  # sparrow's one rate drops the embeddings too
    ('attention_dropout_rate', 'attn_pdrop', 0.1),
    ('init_std', 'initializer_range', 0.02),
    ('tie_output', 'tie_word_embeddings', True),
    ('attention_scale', 'scale_attn_weights', True),
  ),
  'bert': (
    ('vocab_size', 'vocab_size', 30522),
    ('d_model', 'hidden_size', 768),
    ('num_heads', 'num_attention_heads', 12),
    ('d_ff', 'intermediate_size', 3072),
    ('num_layers', 'num_hidden_layers', 12),
    ('max_length', 'max_position_embeddings', 512),
    ('norm_eps', 'layer_norm_eps', 1e-12),
    ('activation', 'hidden_act', 'gelu'),
    ('dropout_rate', 'hidden_dropout_prob', 0.1),
    ('attention_dropout_rate', 'attention_probs_dropout_prob', 0.1),
    ('init_std', 'initializer_range', 0.02),
    ('type_vocab_size', 'type_vocab_size', 2),
    ('pad_id', 'pad_token_id', 0),
  ),
}
_LLAMA_KEYS = (
  ('vocab_size', 'vocab_size', 32000),
  ('d_model', 'hidden_size', 4096),
  ('num_heads', 'num_attention_heads', 32),
  ('num_kv_heads', 'num_key_value_heads', None),  # None = num_attention_heads
  ('head_dim', 'head_dim', None),  # None = hidden_size // num_attention_heads
  ('d_ff', 'intermediate_size', 11008),
  ('num_layers', 'num_hidden_layers', 32),
  ('max_length', 'max_position_embeddings', 2048),
  ('norm_eps', 'rms_norm_eps', 1e-6),
  ('attention_dropout_rate', 'attention_dropout', 0.0),
  ('init_std', 'initializer_range', 0.02),
  ('tie_output', 'tie_word_embeddings', False),
)
for _arch in LLAMA_FAMILY:
  _CONFIG_KEYS[_arch] = _LLAMA_KEYS
# What each architecture fixes, whatever the default config says.
_COMMON = dict(
  position='learned',
  norm='layernorm',
  use_bias=True,
  qkv_bias=None,
  qk_norm=False,
  output_head=True,
  output_bias=False,  # no Hugging Face architecture here has a bias on its output projection
  scale_embeddings=False,
  ffn_dropout_rate=0.0,
  init_distribution='normal',
  num_kv_heads=None,
  head_dim=None,
  window=None,
  rope_scaling='none',
  rope_scaling_factor=1.0,
  rope_original_max_length=None,
)
_FIXED = {
  # GPT-2: ln_1/ln_2 before each sub-layer and ln_f at the end. It has no padding token (id 0 is
  # '!'), so pad_id=None: give padded batches their segment ids.
  'gpt2': dict(
    family='causal_lm',
    norm_placement='pre',
    embedding_norm=False,
    type_vocab_size=0,
    num_classes=0,
    pad_id=None,
    init='scaled',
  ),
  # BERT: post-LN, a LayerNorm after the embeddings, the MLM decoder tied to the embedding.
  'bert': dict(
    family='bidirectional_lm',
    norm_placement='post',
    embedding_norm=True,
    tie_output=True,
    attention_scale=True,
    init='plain',
  ),
}
# Llama and its kin: pre-RMSNorm, RoPE (rotate-half), SwiGLU, no biases, a final norm.
_FIXED['llama'] = dict(
  family='causal_lm',
  position='rope',
  norm='rmsnorm',
  norm_placement='pre',
  embedding_norm=False,
  activation='swiglu',
  use_bias=False,
  attention_scale=True,
  dropout_rate=0.0,
  type_vocab_size=0,
  num_classes=0,
  pad_id=None,
  init='plain',
)
_FIXED['mistral'] = _FIXED['llama']
_FIXED['qwen2'] = dict(_FIXED['llama'], qkv_bias=True)  # biases on q, k and v only
_FIXED['qwen3'] = dict(_FIXED['llama'], qk_norm=True)  # RMSNorm over head_dim on q and k
# config.json values that sparrow cannot express: (key, the only value it imports).
_REQUIRED = {
  'gpt2': (('add_cross_attention', False), ('scale_attn_by_inverse_layer_idx', False)),
  'bert': (
    ('add_cross_attention', False),
    ('is_decoder', False),
    ('position_embedding_type', 'absolute'),
  ),
  'llama': (('hidden_act', 'silu'), ('pretraining_tp', 1)),
  'mistral': (('hidden_act', 'silu'),),
  'qwen2': (('hidden_act', 'silu'), ('use_sliding_window', False)),
  'qwen3': (('hidden_act', 'silu'), ('use_sliding_window', False)),
}
_ACTIVATIONS = {'gelu': 'gelu', 'gelu_new': 'gelu_tanh', 'gelu_pytorch_tanh': 'gelu_tanh'}
_ACTIVATIONS['relu'] = 'relu'
_HF_ACTIVATIONS = {'gelu': 'gelu', 'gelu_tanh': 'gelu_new', 'relu': 'relu'}
ROPE_TYPES = {'default': 'none', 'linear': 'linear', 'llama3': 'llama3'}  # HF rope_type -> ours
# Model knobs that never change a forward pass's logits: training, initialisation and compute
# choices. An export compares every other knob with what the arch expresses, so a knob added
# later is refused until the export maps it (opt-out, not opt-in).
_NEUTRAL_KEYS = frozenset(
  (
    'dropout_rate attention_dropout_rate ffn_dropout_rate init init_distribution init_std '
    'attention_impl attention_chunk_size dtype param_dtype remat scan_layers pad_id'
  ).split()
)


def check_arch(arch: str) -> None:
  if arch not in ARCHS:
    raise ValueError(f'arch={arch!r} is not supported; choose one of {", ".join(ARCHS)}')


def detect_arch(hf: dict, where: str = 'config.json') -> str:
  """The arch of a config.json dict, from its model_type or else its architectures."""
  model_type = hf.get('model_type')
  if model_type in ARCHS:
    return model_type
  named = [_ARCHITECTURES[a] for a in hf.get('architectures') or [] if a in _ARCHITECTURES]
  if model_type is None and named:
    return named[0]
  shown = f'model_type={model_type!r}' if model_type else 'no model_type'
  architectures = hf.get('architectures')
  if architectures:
    shown += f' (architectures={architectures})'
  raise ValueError(
    f'{where} has {shown}, which sparrow does not import; supported: {", ".join(ARCHS)} '
    f'({", ".join(sorted(_ARCHITECTURES))})'
  )


def _num_classes(hf: dict) -> int:
  """Classes of a *ForSequenceClassification checkpoint; 0 for an LM."""
  if not any(a.endswith('ForSequenceClassification') for a in hf.get('architectures') or []):
    return 0
  return len(hf['id2label']) if hf.get('id2label') else int(hf.get('num_labels', 2))


def _rope_fields(hf: dict, where: str) -> dict[str, Any]:
  """rope_theta and the scaling of `rope_parameters` (transformers 5) or `rope_scaling` (older)."""
  key = 'rope_parameters' if hf.get('rope_parameters') else 'rope_scaling'
  params = hf.get(key) or {}
  if not isinstance(params, dict):
    raise ValueError(f'{where}: {key}={params!r} must be an object with a rope_type')
  theta = params.get('rope_theta', hf.get('rope_theta', 10000.0))
  kind = params.get('rope_type', params.get('type', 'default'))
  if kind not in ROPE_TYPES:
    raise ValueError(
      f'{where}: {key}.rope_type={kind!r} is not supported; sparrow imports rope_type '
      f'{", ".join(ROPE_TYPES)}'
    )
  partial = params.get('partial_rotary_factor', hf.get('partial_rotary_factor', 1.0))
  if partial != 1.0:
    raise ValueError(
      f'{where}: partial_rotary_factor={partial} is not supported; sparrow rotates all'
    )
  fields = dict(rope_theta=float(theta), rope_scaling=ROPE_TYPES[kind])
  if kind != 'default':
    fields['rope_scaling_factor'] = float(params['factor'])
  if kind == 'llama3':
    fields['rope_original_max_length'] = int(params['original_max_position_embeddings'])
    fields['rope_low_freq_factor'] = float(params['low_freq_factor'])
    fields['rope_high_freq_factor'] = float(params['high_freq_factor'])
  return fields


def _llama_fields(arch: str, hf: dict, fields: dict, where: str) -> None:
  """Fills in what the Llama family adds: rope, biases, the sliding window."""
  fields.update(_rope_fields(hf, where))
  if arch == 'qwen3' and hf.get('head_dim') is None:
    fields['head_dim'] = 128  # Qwen3Config's default
  for key in ('attention_bias', 'mlp_bias'):
    if hf.get(key):
      if arch == 'qwen2' or not (hf.get('attention_bias') and hf.get('mlp_bias', False)):
        raise ValueError(
          f'{where} has {key}=true; sparrow imports {arch} with attention_bias and mlp_bias both '
          'false, or (llama) both true'
        )
      fields['use_bias'] = True
  if arch == 'mistral' and hf.get('sliding_window'):
    window = int(hf['sliding_window'])  # HF: key j visible from query i iff i - window < j <= i
    if window < fields['max_length']:
      fields['window'] = (window - 1, 0)
  if fields['head_dim'] is None and fields['d_model'] % fields['num_heads']:
    raise ValueError(
      f'{where}: num_attention_heads={fields["num_heads"]} does not divide '
      f'hidden_size={fields["d_model"]} and no head_dim is given'
    )


def model_fields(arch: str, hf: dict, where: str = 'config.json') -> dict[str, Any]:
  """The sparrow `config.model` fields of a Hugging Face config.json dict of `arch`."""
  check_arch(arch)
  model_type = hf.get('model_type')
  if model_type is not None and model_type != arch:
    valid = f'--arch={model_type}' if model_type in ARCHS else f'one of {", ".join(ARCHS)}'
    raise ValueError(f'{where} has model_type={model_type!r} but arch={arch!r}; use {valid}')
  for key, only in _REQUIRED[arch]:
    if hf.get(key) not in (None, only):
      raise ValueError(
        f'{where} has {key}={hf[key]!r}; sparrow imports {arch} with {key}={only!r} only'
      )
  fields = {**_COMMON, **_FIXED[arch]}
  for key, hf_key, default in _CONFIG_KEYS[arch]:
    fields[key] = hf[hf_key] if hf.get(hf_key) is not None else default
  if arch == 'gpt2':
    fields['d_ff'] = fields['d_ff'] or 4 * fields['d_model']
  for key in ('vocab_size', 'd_model', 'num_heads', 'd_ff', 'num_layers'):
    value = fields[key]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
      hf_key = dict((k, h) for k, h, _ in _CONFIG_KEYS[arch])[key]
      raise ValueError(f'{where}: {hf_key}={value!r} must be a positive integer')
  if arch in LLAMA_FAMILY:
    _llama_fields(arch, hf, fields, where)
    return fields
  act_key = dict((k, h) for k, h, _ in _CONFIG_KEYS[arch])['activation']
  if fields['activation'] not in _ACTIVATIONS:
    raise ValueError(
      f'{where} has {act_key}={fields["activation"]!r}, which sparrow does not implement; '
      f'supported: {", ".join(_ACTIVATIONS)}'
    )
  fields['activation'] = _ACTIVATIONS[fields['activation']]
  if arch == 'bert':
    fields['num_classes'] = _num_classes(hf)
    fields['output_head'] = 'BertModel' not in (hf.get('architectures') or [])
  if fields['d_model'] % fields['num_heads']:
    heads_key = dict((k, h) for k, h, _ in _CONFIG_KEYS[arch])['num_heads']
    raise ValueError(
      f'{where}: {heads_key}={fields["num_heads"]} does not divide d_model={fields["d_model"]}'
    )
  return fields


def experiment_config(
  arch: str,
  hf: dict,
  name: str,
  param_dtype: str = 'float32',
  where: str = 'config.json',
) -> ml_collections.ConfigDict:
  """A full sparrow experiment config (the defaults, as configs/base.py gives them) for a Hugging
  Face config.json dict.

  `param_dtype` (float32 | bfloat16 | float16) is also the compute dtype when not float32.
  """
  config = experiment.default_configdict()
  config.name = name
  for key, value in model_fields(arch, hf, where).items():
    setattr(config.model, key, value)
  config.model.param_dtype = param_dtype
  config.model.dtype = param_dtype
  # Fine-tuning rows of 256 tokens (at most the context), and eval prompts (half a row) plus their
  # continuation, fit the positions.
  config.data.max_length = min(256, config.model.max_length)
  room = config.model.max_length - (config.data.max_length // 2 + 1)
  config.train.max_decode_length = max(1, min(config.train.max_decode_length, room))
  try:
    ModelConfig.from_config(config.model)  # a bad size fails here, before anything is written
  except ValueError as e:
    named = [f'{hf_key} -> {k}' for k, hf_key, _ in _CONFIG_KEYS[arch] if f'{k}=' in str(e)]
    note = f' (config.json keys: {", ".join(named)})' if named else ''
    raise ValueError(f'{where} does not describe a model sparrow can build: {e}{note}') from e
  return config


def _head_name(arch: str, cfg: ModelConfig) -> str:
  if arch == 'gpt2':
    return 'GPT2LMHeadModel'
  if arch == 'bert':
    if cfg.num_classes:
      return 'BertForSequenceClassification'
    return 'BertForMaskedLM' if cfg.output_head else 'BertModel'
  return _CAUSAL_LM[arch]


def hf_config(arch: str, cfg: ModelConfig, original: dict | None = None) -> dict[str, Any]:
  """The Hugging Face config.json of a sparrow model, over `original` (the imported one)."""
  check_arch(arch)
  hf = dict(original or {})
  hf.update(model_type=arch, architectures=[_head_name(arch, cfg)], **dict(_REQUIRED[arch]))
  for key, hf_key, _ in _CONFIG_KEYS[arch]:
    hf[hf_key] = getattr(cfg, key)
    if key == 'activation':
      hf[hf_key] = _HF_ACTIVATIONS.get(cfg.activation, cfg.activation)
  if arch == 'gpt2':
    hf['embd_pdrop'] = cfg.dropout_rate
  elif arch == 'bert':
    hf['tie_word_embeddings'] = True
  else:
    hf['num_key_value_heads'] = cfg.kv_heads
    hf['head_dim'] = cfg.head_size
    rope = {'rope_theta': cfg.rope_theta, 'rope_type': 'default'}
    if cfg.rope_scaling != 'none':
      rope.update(rope_type=cfg.rope_scaling, factor=cfg.rope_scaling_factor)
    if cfg.rope_scaling == 'llama3':
      rope.update(
        original_max_position_embeddings=cfg.rope_original_max_length or cfg.max_length,
        low_freq_factor=cfg.rope_low_freq_factor,
        high_freq_factor=cfg.rope_high_freq_factor,
      )
    hf.pop('rope_scaling', None)
    hf.pop('rope_theta', None)
    hf['rope_parameters'] = rope
    if arch == 'llama':
      hf['attention_bias'] = hf['mlp_bias'] = cfg.use_bias
    if arch == 'mistral':
      hf['sliding_window'] = None if cfg.window is None else cfg.window[0] + 1
  if cfg.num_classes and len(hf.get('id2label') or {}) != cfg.num_classes:
    hf['id2label'] = {str(i): f'LABEL_{i}' for i in range(cfg.num_classes)}
    hf['label2id'] = {f'LABEL_{i}': i for i in range(cfg.num_classes)}
  return hf


def _resolved(cfg: ModelConfig, key: str) -> Any:
  """A knob's value as the model uses it: None resolved where it stands for another value."""
  value = getattr(cfg, key)
  if value is not None:
    return value
  fallback = {
    'num_kv_heads': cfg.kv_heads,
    'head_dim': cfg.head_size,
    'num_decoder_layers': cfg.decoder_layers,
    'rope_original_max_length': cfg.max_length,
    'qkv_bias': cfg.use_bias,
  }
  return fallback.get(key)


def check_exportable(arch: str, cfg: ModelConfig) -> None:
  """Raises one ValueError naming the first model field that `arch` cannot express."""
  check_arch(arch)
  if arch in ('gpt2', 'bert') and cfg.activation not in _HF_ACTIVATIONS:
    valid = ', '.join(_HF_ACTIVATIONS)
    raise ValueError(
      f'cannot export activation={cfg.activation!r} as {arch}; it needs one of {valid}'
    )
  if not cfg.d_ff:
    raise ValueError(
      f'cannot export an attention-only model (d_ff=0) as {arch}: its layers have MLPs'
    )
  if arch == 'bert' and cfg.type_vocab_size < 1:
    raise ValueError('cannot export this model as bert: BERT needs token types, model has none')
  # The model that config.json describes: what the arch sets, every other knob at its default.
  neutral = {key: getattr(cfg, key) for key in _NEUTRAL_KEYS}
  try:
    back = ModelConfig.from_config({**neutral, **model_fields(arch, hf_config(arch, cfg))})
  except ValueError as e:
    raise ValueError(f'cannot export this model as {arch}: {e}') from e
  skip = _NEUTRAL_KEYS | ({'tie_output'} if arch == 'bert' else set())  # BERT's MLM head is tied
  for key in (k for k in config_lib.KNOBS if k not in skip):
    mine, theirs = _resolved(cfg, key), _resolved(back, key)
    if mine != theirs:
      raise ValueError(
        f'cannot export this model as {arch}: model.{key} is {mine!r}, but {arch} has {theirs!r}'
      )
