"""Hugging Face config.json <-> sparrow model config: which architecture a folder holds, and how
each of its fields maps onto `ModelConfig` (GPT-2, BERT, the Llama family, GPT-NeoX), both ways."""

from __future__ import annotations

from typing import Any

import ml_collections

from transformer import config as config_lib
from transformer.config import ModelConfig, experiment

ARCHS = ('gpt2', 'bert', 'llama', 'qwen2', 'qwen3', 'mistral', 'gpt_neox', 'gpt_neo', 'gemma2',
         'gemma3_text')  # fmt: skip
GEMMA = ('gemma2', 'gemma3_text')
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
  'GPTNeoXForCausalLM': 'gpt_neox',
  'GPTNeoForCausalLM': 'gpt_neo',
  'Gemma2ForCausalLM': 'gemma2',
  'Gemma3ForCausalLM': 'gemma3_text',
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
_CONFIG_KEYS['gpt_neox'] = (  # Pythia
  ('vocab_size', 'vocab_size', 50432),
  ('d_model', 'hidden_size', 6144),
  ('num_heads', 'num_attention_heads', 64),
  ('d_ff', 'intermediate_size', 24576),
  ('num_layers', 'num_hidden_layers', 44),
  ('max_length', 'max_position_embeddings', 2048),
  ('norm_eps', 'layer_norm_eps', 1e-5),
  ('activation', 'hidden_act', 'gelu'),
  ('dropout_rate', 'hidden_dropout', 0.0),
  ('attention_dropout_rate', 'attention_dropout', 0.0),
  ('init_std', 'initializer_range', 0.02),
  ('tie_output', 'tie_word_embeddings', False),
  ('parallel_residual', 'use_parallel_residual', True),
)
_CONFIG_KEYS['gpt_neo'] = (  # TinyStories, GPT-Neo 125M
  ('vocab_size', 'vocab_size', 50257),
  ('d_model', 'hidden_size', 2048),
  ('num_heads', 'num_heads', 16),
  ('d_ff', 'intermediate_size', None),  # None = 4 * hidden_size
  ('num_layers', 'num_layers', 24),
  ('max_length', 'max_position_embeddings', 2048),
  ('norm_eps', 'layer_norm_epsilon', 1e-5),
  ('activation', 'activation_function', 'gelu_new'),
  ('dropout_rate', 'resid_dropout', 0.0),
  ('attention_dropout_rate', 'attention_dropout', 0.0),
  ('init_std', 'initializer_range', 0.02),
  ('tie_output', 'tie_word_embeddings', True),
)
_GEMMA_KEYS = (
  *(k for k in _LLAMA_KEYS if k[0] not in ('norm_eps', 'tie_output', 'head_dim')),
  ('head_dim', 'head_dim', 256),
  ('norm_eps', 'rms_norm_eps', 1e-6),
  ('tie_output', 'tie_word_embeddings', True),
  ('query_pre_attn_scalar', 'query_pre_attn_scalar', 256),
  ('attention_softcap', 'attn_logit_softcapping', None),
  ('logit_softcap', 'final_logit_softcapping', None),
)
for _arch in GEMMA:
  _CONFIG_KEYS[_arch] = _GEMMA_KEYS
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
# GPT-NeoX: pre-LayerNorm, biases everywhere, RoPE on the first rope_dim dims of each head, and
# (Pythia) the parallel residual.
_FIXED['gpt_neox'] = dict(
  family='causal_lm',
  position='rope',
  norm_placement='pre',
  embedding_norm=False,
  attention_scale=True,
  type_vocab_size=0,
  num_classes=0,
  pad_id=None,
  init='plain',
)
# GPT-NeoX-era GPT-Neo: GPT-2's layout with Linear layers, no q/k/v biases, unscaled logits, and
# local (windowed) and global layers alternating.
_FIXED['gpt_neo'] = dict(_FIXED['gpt2'], qkv_bias=False, attention_scale=False, init='plain')
# Gemma 2 and 3: sandwich RMSNorms with (1 + w), GeGLU, embeddings x sqrt(d_model), sliding and
# global layers; Gemma 3 adds q/k norms.
_FIXED['gemma2'] = dict(
  _FIXED['llama'], norm='rmsnorm_offset', norm_placement='sandwich', activation='geglu',
  scale_embeddings=True,
)  # fmt: skip
_FIXED['gemma3_text'] = dict(_FIXED['gemma2'], qk_norm=True)
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
  'gpt_neox': (('attention_bias', True),),  # False drops attention's biases but not the MLP's
  'gpt_neo': (),
  'gemma2': (('hidden_activation', 'gelu_pytorch_tanh'), ('attention_bias', False)),
  'gemma3_text': (
    ('hidden_activation', 'gelu_pytorch_tanh'),
    ('attention_bias', False),
    ('use_bidirectional_attention', False),
  ),
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


def _rope_fields(hf: dict, where: str, head_size: int | None = None) -> dict[str, Any]:
  """rope_theta and the scaling of `rope_parameters` (transformers 5) or `rope_scaling` (older);
  with `head_size`, the rotated dims of a partial rotary factor too (GPT-NeoX)."""
  key = 'rope_parameters' if hf.get('rope_parameters') else 'rope_scaling'
  params = hf.get(key) or {}
  if not isinstance(params, dict):
    raise ValueError(f'{where}: {key}={params!r} must be an object with a rope_type')
  # GPT-NeoX files before transformers 5 say rotary_emb_base and rotary_pct.
  theta = params.get('rope_theta', hf.get('rope_theta', hf.get('rotary_emb_base', 10000.0)))
  kind = params.get('rope_type', params.get('type', 'default'))
  if kind not in ROPE_TYPES:
    raise ValueError(
      f'{where}: {key}.rope_type={kind!r} is not supported; sparrow imports rope_type '
      f'{", ".join(ROPE_TYPES)}'
    )
  partial = params.get(
    'partial_rotary_factor', hf.get('partial_rotary_factor', hf.get('rotary_pct'))
  )
  partial = 1.0 if partial is None else partial
  if partial != 1.0 and head_size is None:
    raise ValueError(
      f'{where}: partial_rotary_factor={partial} is not supported here; sparrow rotates all'
    )
  fields = dict(rope_theta=float(theta), rope_scaling=ROPE_TYPES[kind])
  if partial != 1.0:
    if not 0 < partial <= 1:
      raise ValueError(f'{where}: partial_rotary_factor={partial} must be in (0, 1]')
    fields['rope_dim'] = int(head_size * partial)  # as transformers rounds it
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


def _layer_pattern(types: list, local: str) -> str:
  """'L'/'G' per layer from config.json's list of layer types ('' when every layer is global)."""
  pattern = ''.join('L' if t == local else 'G' for t in types)
  return pattern if 'L' in pattern else ''


def _gpt_neo_fields(hf: dict, fields: dict, where: str) -> None:
  layers = hf.get('attention_layers') or [
    kind
    for kinds, repeat in hf.get('attention_types') or []
    for _ in range(repeat)
    for kind in kinds
  ]
  if len(layers) != fields['num_layers'] or set(layers) - {'global', 'local'}:
    raise ValueError(
      f"{where}: attention_layers={layers!r} must give 'global' or 'local' for each of its "
      f'num_layers={fields["num_layers"]} layers'
    )
  fields['attention_layers'] = _layer_pattern(layers, 'local')
  if fields['attention_layers']:  # HF: key j visible from query i iff 0 <= i - j < window_size
    fields['window'] = (int(hf.get('window_size', 256)) - 1, 0)


def _gemma_fields(arch: str, hf: dict, fields: dict, where: str) -> None:
  types = hf.get('layer_types') or []
  if len(types) != fields['num_layers'] or set(types) - {'sliding_attention', 'full_attention'}:
    raise ValueError(
      f"{where}: layer_types={types!r} must give 'sliding_attention' or 'full_attention' for "
      f'each of its num_hidden_layers={fields["num_layers"]} layers'
    )
  fields['attention_layers'] = _layer_pattern(types, 'sliding_attention')
  if fields['attention_layers']:  # HF: key j visible from query i iff i - window < j <= i
    fields['window'] = (int(hf['sliding_window']) - 1, 0)
  rope = hf.get('rope_parameters') or {}
  if arch == 'gemma3_text' and 'full_attention' in rope:  # one RoPE per layer type
    full, local = rope['full_attention'], rope.get('sliding_attention', rope['full_attention'])
    for kind, params in (('full_attention', full), ('sliding_attention', local)):
      if params.get('rope_type', 'default') != 'default':
        raise ValueError(
          f'{where}: rope_parameters.{kind}.rope_type={params["rope_type"]!r} is not supported; '
          "sparrow imports Gemma 3 with rope_type 'default' for both layer types"
        )
    fields['rope_theta'] = float(full.get('rope_theta', 1e6))
    if fields['attention_layers']:
      fields['rope_local_theta'] = float(local.get('rope_theta', 1e4))
  else:
    fields.update(_rope_fields(hf, where))


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
  if arch in ('gpt2', 'gpt_neo'):
    fields['d_ff'] = fields['d_ff'] or 4 * fields['d_model']
  for key in ('vocab_size', 'd_model', 'num_heads', 'd_ff', 'num_layers'):
    value = fields[key]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
      hf_key = dict((k, h) for k, h, _ in _CONFIG_KEYS[arch])[key]
      raise ValueError(f'{where}: {hf_key}={value!r} must be a positive integer')
  if arch in LLAMA_FAMILY:
    _llama_fields(arch, hf, fields, where)
    return fields
  if arch in GEMMA:
    _gemma_fields(arch, hf, fields, where)
    return fields
  if arch == 'gpt_neo':
    _gpt_neo_fields(hf, fields, where)
  if arch == 'gpt_neox':
    fields.update(_rope_fields(hf, where, head_size=fields['d_model'] // fields['num_heads']))
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
  elif arch == 'gpt_neox':
    hf.pop('rotary_pct', None)
    hf.pop('rotary_emb_base', None)
    partial = (cfg.rope_dim or cfg.head_size) / cfg.head_size
    hf['rope_parameters'] = dict(
      rope_theta=cfg.rope_theta, rope_type='default', partial_rotary_factor=partial
    )
  elif arch == 'bert':
    hf['tie_word_embeddings'] = True
  elif arch == 'gpt_neo':
    layers = _layer_types(cfg, 'local', 'global')
    hf.update(attention_layers=layers, attention_types=[[layers, 1]])
    hf['window_size'] = 256 if cfg.window is None else cfg.window[0] + 1
  if arch in GEMMA:
    hf.update(num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_size)
    hf['query_pre_attn_scalar'] = cfg.query_pre_attn_scalar or cfg.head_size
    hf['layer_types'] = _layer_types(cfg, 'sliding_attention', 'full_attention')
    hf['sliding_window'] = 4096 if cfg.window is None else cfg.window[0] + 1
    rope = {'rope_type': 'default', 'rope_theta': cfg.rope_theta}
    local = {'rope_type': 'default', 'rope_theta': cfg.rope_local_theta or cfg.rope_theta}
    hf.pop('rope_scaling', None)
    hf['rope_parameters'] = (
      rope if arch == 'gemma2' else {'full_attention': rope, 'sliding_attention': local}
    )
  elif arch in LLAMA_FAMILY:
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


def _layer_types(cfg: ModelConfig, local: str, full: str) -> list[str]:
  """config.json's per-layer list of `cfg.attention_layers` ('' : every layer global)."""
  pattern = cfg.attention_layers or 'G'
  return [local if pattern[i % len(pattern)] == 'L' else full for i in range(cfg.num_layers)]


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
    'rope_dim': cfg.head_size,
    'query_pre_attn_scalar': cfg.head_size,
    'rope_local_theta': cfg.rope_theta,
  }
  return fallback.get(key)


def check_exportable(arch: str, cfg: ModelConfig) -> None:
  """Raises one ValueError naming the first model field that `arch` cannot express."""
  check_arch(arch)
  if arch in ('gpt2', 'bert', 'gpt_neox', 'gpt_neo') and cfg.activation not in _HF_ACTIVATIONS:
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
