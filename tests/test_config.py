"""One config home: the library's dataclasses hold every default, and `default_configdict()` (what
configs/base.py returns) renders them as exactly the ConfigDict that runs used before; the lists of
choices are the keys of the registries that implement them."""

import dataclasses
import json
import typing

import jax.numpy as jnp
import ml_collections
import pytest
from absl import flags
from ml_collections import config_flags

from configs import base
from transformer import config
from transformer.config import ModelConfig, experiment
from transformer.model import attention, layers, remat
from transformer.training import optim


class Ref(typing.NamedTuple):
  """A FieldReference of the frozen ConfigDict: its value and its field_type."""

  value: typing.Any
  field_type: type


# configs/base.py's get_config() before the defaults moved into transformer/config/, frozen: the
# defaults every earlier run was trained with. Change it only when a default changes on purpose.
FROZEN_BASE = {
  'data': {
    'bad_lines': 'error',
    'batch_size': 64,
    'buckets': Ref(False, object),
    'eval_batch_size': 64,
    'eval_batches': -1,
    'eval_fraction': 0.1,
    'eval_path': '',
    'grammar_classes': 0,
    'grammar_holdout': 0.0,
    'grammar_join': 1,
    'grammar_repeat': 0.0,
    'grammar_seed': 0,
    'grammar_successors': 0,
    'grammar_words': 256,
    'max_length': Ref(None, int),
    'max_source_length': 256,
    'max_target_length': 256,
    'mlm_prob': 0.15,
    'num_eval_examples': 1000,
    'num_train_examples': 100_000,
    'numbers_direction': 'digits_to_words',
    'numbers_max': 999_999,
    'numbers_skip_digits': 0,
    'pack': False,
    'prepare_chunk_mb': 16,
    'prepare_workers': 0,
    'prepared_dir': '',
    'recall_disjoint': False,
    'recall_filler': 'random',
    'recall_gap': 64,
    'recall_loss': 'all',
    'recall_order': 'random',
    'recall_pairs': 16,
    'recall_queries': 8,
    'recall_seed': 0,
    'recall_vocab': 26,
    'repeat_fraction': 0.0,
    'repeat_subset': 100,
    'sampling': 'random',
    'source_lang': 'en',
    'spm_train_lines': 1_000_000,
    'target_lang': 'de',
    'task': 'numbers',
    'text_format': 'stream',
    'tfds_data_dir': '',
    'tfds_eval_split': 'test',
    'tfds_name': 'wmt14_translate/de-en',
    'tfds_text_key': 'text',
    'tfds_train_split': 'train',
    'tokenizer': 'byte',
    'tokenizer_path': '',
    'train_path': '',
    'vocab_multiple': 1,
    'vocab_size': 32000,
  },
  'mesh': {
    'rules': {
      'batch': 'data,fsdp',
      'embed': 'fsdp',
      'heads': 'tensor',
      'kv': '',
      'kv_heads': 'tensor',
      'layers': '',
      'length': '',
      'mlp': 'tensor',
      'vocab': 'tensor',
    },
    'shape': (-1, 1, 1),
  },
  'model': {
    'activation': 'relu',
    'attention': 'softmax',
    'attention_chunk_size': 128,
    'attention_dropout_rate': 0.0,
    'attention_impl': Ref(None, str),
    'attention_scale': True,
    'compress_block': 16,
    'd_ff': 2048,
    'd_model': 512,
    'dropout_rate': 0.1,
    'dtype': 'float32',
    'embedding_norm': False,
    'family': 'encoder_decoder',
    'ffn_dropout_rate': 0.0,
    'head_dim': Ref(None, int),
    'init': 'scaled',
    'init_distribution': 'xavier',
    'init_std': 0.02,
    'linear_feature_map': 'elu',
    'max_length': 512,
    'norm': 'layernorm',
    'norm_bias': True,
    'norm_eps': 1e-06,
    'norm_placement': 'post',
    'num_classes': 0,
    'num_decoder_layers': Ref(None, int),
    'num_heads': 8,
    'num_kv_heads': Ref(None, int),
    'num_layers': 6,
    'output_bias': False,
    'output_head': True,
    'pad_id': 0,
    'param_dtype': 'float32',
    'position': 'sinusoidal',
    'qk_norm': False,
    'qkv_bias': Ref(None, bool),
    'remat': 'none',
    'residual': True,
    'parallel_residual': False,
    'rope_dim': Ref(None, int),
    'query_pre_attn_scalar': Ref(None, float),
    'attention_softcap': Ref(None, float),
    'logit_softcap': Ref(None, float),
    'attention_layers': '',
    'rope_local_theta': Ref(None, float),
    'rope_high_freq_factor': 4.0,
    'rope_low_freq_factor': 1.0,
    'rope_original_max_length': Ref(None, int),
    'rope_scaling': 'none',
    'rope_scaling_factor': 1.0,
    'rope_theta': 10000.0,
    'scale_embeddings': True,
    'scan_layers': False,
    'share_embeddings': True,
    'short_conv': 0,
    'tie_output': True,
    'type_vocab_size': 0,
    'use_bias': True,
    'vocab_size': 261,
    'window': Ref(None, tuple),
  },
  'name': 'base',
  'optim': {
    'b1': 0.9,
    'b2': 0.98,
    'clip_norm': 0.0,
    'end_learning_rate_factor': 0.0,
    'eps': 1e-09,
    'learning_rate': 1.0,
    'optimizer': 'adam',
    'restart_period': 1000,
    'schedule': 'rsqrt',
    'warmup_steps': 4000,
    'weight_decay': 0.0,
  },
  'seed': 0,
  'train': {
    'checkpoint_every': 500,
    'checkpoint_every_seconds': 0.0,
    'eval_decode_examples': 256,
    'eval_every': 500,
    'eval_train_loss': True,
    'fused_loss': 'auto',
    'grad_accum_steps': 1,
    'head_entropy_every': 0,
    'induction_every': 0,
    'keep_checkpoints': 3,
    'label_smoothing': 0.1,
    'log_every': 50,
    'loss_chunk_size': 4096,
    'loss_scale': 2.0**15,
    'loss_scale_period': 2000,
    'max_decode_length': 64,
    'nonfinite': 'auto',
    'num_samples': 4,
    'spike_factor': 0.0,
    'spike_rollback': False,
    'spike_window': 100,
    'steps': 2000,
  },
}


def _compare(got: ml_collections.ConfigDict, want: dict, path: str = 'config') -> list[str]:
  """Every key whose presence, kind (value, FieldReference, ConfigDict), type or value differs."""
  diffs = []
  if sorted(got.keys()) != sorted(want):
    return [f'{path}: keys {sorted(got.keys())} != {sorted(want)}']
  for key, expected in want.items():
    field, where = got._fields[key], f'{path}.{key}'
    if isinstance(expected, dict):
      if not isinstance(field, ml_collections.ConfigDict):
        diffs.append(f'{where}: {field!r} is not a ConfigDict')
      else:
        diffs += _compare(field, expected, where)
    elif isinstance(expected, Ref):
      if not isinstance(field, ml_collections.FieldReference):
        diffs.append(f'{where}: {field!r} is not a FieldReference')
      elif field.get_type() is not expected.field_type or field.get() != expected.value:
        diffs.append(f'{where}: {field.get()!r} of {field.get_type()} != {expected}')
    elif type(field) is not type(expected) or field != expected:
      diffs.append(f'{where}: {field!r} ({type(field).__name__}) != {expected!r}')
  return diffs


def test_default_configdict_is_the_frozen_base_config():
  assert _compare(experiment.default_configdict(), FROZEN_BASE) == []
  assert _compare(base.get_config(), FROZEN_BASE) == []


def test_default_configdict_keeps_the_key_order_of_saved_configs():
  # A run's config.json lists the keys in insertion order, as base.py used to set them.
  saved = json.loads(experiment.default_configdict().to_json_best_effort())
  assert list(saved) == ['name', 'seed', 'model', 'data', 'train', 'mesh', 'optim']
  assert list(saved['model']) == list(config.KNOBS)
  assert list(saved['model']).index('short_conv') + 1 == list(saved['model']).index(
    'compress_block'
  )
  assert list(saved['mesh']) == ['shape', 'rules']


def test_none_able_knobs_parse_from_flags():
  argv = ['train', '--config.model.num_kv_heads=4', '--config.model.qkv_bias=False']
  argv += ['--config.model.attention_impl=chunked', '--config.data.max_length=64']
  values = flags.FlagValues()
  default = experiment.default_configdict()
  config_flags.DEFINE_config_dict('config', default, flag_values=values, sys_argv=argv)
  values(argv)
  model = values.config.model
  assert (model.num_kv_heads, model.qkv_bias, model.attention_impl) == (4, False, 'chunked')
  assert values.config.data.max_length == 64
  with pytest.raises(TypeError):
    experiment.default_configdict().model.num_kv_heads = 'four'


def test_model_defaults_are_the_base_config():
  model = base.get_config().model
  fields = {f.name: f.default for f in dataclasses.fields(config.ModelConfig) if f.init}
  assert sorted(model.keys()) == sorted(fields)  # every field once in base.py, nothing else
  different = {k: (v, model[k]) for k, v in fields.items() if model[k] != v}
  assert different == {}, 'ModelConfig default != configs/base.py (field: (default, base))'


def test_choice_lists_are_the_registries():
  # swiglu and geglu gate a pair of projections, not an elementwise function: GatedFeedForward's.
  assert sorted(config.ACTIVATIONS) == sorted([*layers.ACTIVATIONS, *layers.GATES])
  assert sorted(config.REMAT_POLICIES) == sorted(['none', *remat.REMAT_POLICIES])
  assert sorted(config.ATTENTION_IMPLEMENTATIONS[1:]) == sorted(attention.registered())
  assert sorted(experiment.SCHEDULES) == sorted(optim.SCHEDULE_BUILDERS)


def test_from_configdict_types_every_section():
  cd = experiment.default_configdict()
  # The one change: the context is set once, data.max_length follows model.max_length.
  resolved = experiment.DataConfig(max_length=experiment.ModelConfig().max_length)
  assert experiment.Config.from_configdict(cd) == experiment.Config(data=resolved)
  cd.train.steps, cd.mesh.rules.mlp, cd.model.num_kv_heads = 7, '', 4
  typed = experiment.Config.from_configdict(json.loads(cd.to_json()))  # as a run saves it
  assert (typed.train.steps, typed.mesh.rules.mlp, typed.model.kv_heads) == (7, '', 4)
  assert typed.mesh.shape == (-1, 1, 1)  # JSON's list back as the tuple
  partial = experiment.Config.from_configdict({'train': {'steps': 3}, 'model': {}})
  assert partial.train == experiment.TrainConfig(steps=3) and partial.data == resolved


def test_from_configdict_names_an_unknown_key_and_the_valid_ones():
  cd = experiment.default_configdict().to_dict()
  cd['train']['stpes'] = 3
  with pytest.raises(ValueError, match="unknown config.train key 'stpes'; valid keys are: .*steps"):
    experiment.Config.from_configdict(cd)
  cd = experiment.default_configdict().to_dict()
  cd['mesh']['rules']['vocabulary'] = 'tensor'
  with pytest.raises(ValueError, match="unknown config.mesh.rules key 'vocabulary'"):
    experiment.Config.from_configdict(cd)
  with pytest.raises(ValueError, match="unknown model config key 'nmu_heads'"):
    experiment.Config.from_configdict({'model': {'nmu_heads': 4}})


# The model section of config.json as a run of configs/gpt_tiny.py saved it before the derived
# sizes (head_size, kv_heads, decoder_layers, compute_dtype, params_dtype) became fields.
_SAVED_GPT_TINY = {
  'family': 'causal_lm',
  'vocab_size': 50257,
  'd_model': 64,
  'num_heads': 4,
  'num_kv_heads': None,
  'head_dim': None,
  'd_ff': 256,
  'num_layers': 2,
  'num_decoder_layers': None,
  'max_length': 128,
  'position': 'learned',
  'rope_theta': 10000.0,
  'rope_scaling': 'none',
  'rope_scaling_factor': 1.0,
  'rope_original_max_length': None,
  'rope_low_freq_factor': 1.0,
  'rope_high_freq_factor': 4.0,
  'norm': 'layernorm',
  'norm_eps': 1e-05,
  'norm_placement': 'pre',
  'embedding_norm': False,
  'residual': True,
  'activation': 'gelu_tanh',
  'use_bias': True,
  'norm_bias': True,
  'qkv_bias': None,
  'qk_norm': False,
  'dropout_rate': 0.0,
  'attention_dropout_rate': 0.0,
  'ffn_dropout_rate': 0.0,
  'scale_embeddings': False,
  'share_embeddings': True,
  'tie_output': True,
  'output_bias': False,
  'attention_scale': True,
  'attention': 'softmax',
  'linear_feature_map': 'elu',
  'short_conv': 0,
  'compress_block': 16,
  'attention_impl': None,
  'attention_chunk_size': 128,
  'window': None,
  'init': 'scaled',
  'init_distribution': 'normal',
  'init_std': 0.02,
  'type_vocab_size': 0,
  'num_classes': 0,
  'output_head': True,
  'pad_id': 0,
  'dtype': 'float32',
  'param_dtype': 'float32',
  'remat': 'none',
  'scan_layers': False,
}


# Knobs added after that save: a config saved without them reads back with their defaults (off).
_ADDED_SINCE = {
  'parallel_residual': False,
  'rope_dim': None,
  'query_pre_attn_scalar': None,
  'attention_softcap': None,
  'logit_softcap': None,
  'attention_layers': '',
  'rope_local_theta': None,
}


def test_saved_model_configs_read_back_and_write_the_same_keys():
  cfg = ModelConfig.from_config(_SAVED_GPT_TINY)
  saved = json.loads(json.dumps(cfg.to_dict()))  # what config.json saves
  assert saved == {**_SAVED_GPT_TINY, **_ADDED_SINCE}
  assert [k for k in saved if k not in _ADDED_SINCE] == list(_SAVED_GPT_TINY)  # the same order
  assert (cfg.head_size, cfg.kv_heads, cfg.decoder_layers) == (16, 4, 2)
  assert cfg.compute_dtype == jnp.float32 and cfg.params_dtype == jnp.float32
  other = cfg.replace(num_heads=8, num_kv_heads=2, dtype='bfloat16')  # derived again, not copied
  assert (other.head_size, other.kv_heads, other.compute_dtype) == (8, 2, jnp.bfloat16)
  with pytest.raises(ValueError, match="unknown model config key 'head_size'"):
    ModelConfig.from_config({**_SAVED_GPT_TINY, 'head_size': 16})  # derived, never set
  with pytest.raises(TypeError):
    ModelConfig(head_size=16)


def test_transformer_lens_names_read_the_same_values():
  cfg = ModelConfig(
    num_layers=3, num_heads=6, num_kv_heads=2, head_dim=6, d_model=24, d_ff=40, vocab_size=97,
    max_length=33, norm='rmsnorm', activation='swiglu', position='rope', norm_eps=1e-6,
  )  # fmt: skip
  tl = {name: getattr(cfg, name) for name in config.TL_NAMES}
  assert tl == {
    'n_layers': 3, 'n_heads': 6, 'n_key_value_heads': 2, 'd_head': 6, 'd_mlp': 40, 'd_vocab': 97,
    'd_vocab_out': 97, 'n_ctx': 33, 'eps': 1e-6, 'act_fn': 'silu', 'gated_mlp': True,
    'normalization_type': 'RMS', 'positional_embedding_type': 'rotary',
    'parallel_attn_mlp': False, 'use_normalization_before_and_after': False, 'rotary_dim': 6,
    'attn_scores_soft_cap': -1.0, 'output_logits_soft_cap': -1.0, 'use_attn_scale': True,
    'attn_scale': 6**0.5, 'rotary_base_local': None,
  }  # fmt: skip
  gpt2_like = ModelConfig(activation='gelu_tanh', position='learned')
  assert (gpt2_like.act_fn, gpt2_like.normalization_type) == ('gelu_new', 'LN')
  assert gpt2_like.positional_embedding_type == 'standard' and gpt2_like.d_model == 512
  assert 'n_layers' not in cfg.to_dict()  # read-only names, never saved
  with pytest.raises(AttributeError, match="'n_layer'; did you mean n_layers or num_layers"):
    cfg.n_layer  # noqa: B018
  with pytest.raises(AttributeError, match="no attribute 'nonsense' \\(sparrow's names"):
    cfg.nonsense  # noqa: B018
