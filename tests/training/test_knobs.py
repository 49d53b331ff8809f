"""Knobs of config.train and config.data that cannot work are one ValueError naming them."""

import re

import ml_collections
import numpy as np
import pytest

from configs import base
from transformer.config.experiment import Config

# Written out here, not read from the module: a knob and the values it must refuse.
_REFUSED = {
  'train.steps': [0, -1, 2.5, True, 'ten', None],
  'train.eval_every': [0, -500, 1.0, False],
  'train.log_every': [0, -1],
  'train.checkpoint_every': [0, -1],
  'train.keep_checkpoints': [0],
  'train.grad_accum_steps': [0, -2],
  'train.loss_chunk_size': [0],
  'train.max_decode_length': [0],
  'train.loss_scale_period': [0],
  'train.head_entropy_every': [-1],
  'train.induction_every': [-1, 2.5],
  'train.num_samples': [-1],
  'train.eval_decode_examples': [-3],
  'train.label_smoothing': [1.0, -0.1, float('nan')],
  'train.loss_scale': [0.0, -1.0, float('inf')],
  'data.batch_size': [0, -64, 8.0],
  'data.eval_batch_size': [0],
  'data.max_length': [0, 1],
  'data.max_source_length': [1],
  'data.max_target_length': [0],
  'data.vocab_multiple': [0],
  'data.spm_train_lines': [0],
  'data.num_train_examples': [0, -1],
  'data.num_eval_examples': [0],
  'data.grammar_join': [0],
  'data.grammar_successors': [-1],
  'data.repeat_fraction': [1.0, -0.1, float('nan')],
  'data.repeat_subset': [0],
  'data.grammar_repeat': [-0.1, 1.5, float('nan'), '0.5'],
  'data.vocab_size': [0, 6],
  'data.mlm_prob': [0.0, 1.5, float('nan')],
  'data.prepare_workers': [-1],
  'data.prepare_chunk_mb': [0],
  'data.eval_batches': [-2],
}
_ACCEPTED = {  # the smallest values that work
  'train.steps': 1,
  'train.eval_every': 1,
  'train.head_entropy_every': 0,
  'train.induction_every': 0,
  'data.grammar_repeat': 1.0,
  'train.num_samples': 0,
  'train.label_smoothing': 0.0,
  'data.batch_size': 1,
  'data.max_length': 2,
  'data.mlm_prob': 1.0,
  'data.eval_batches': -1,
  'data.prepare_workers': 0,  # one per core
}


def _with(key: str, value):
  """The base config with one knob set, past ConfigDict's type checks (as code may set it)."""
  config = ml_collections.ConfigDict(base.get_config().to_dict(), type_safe=False)
  section, name = key.split('.')
  config[section][name] = value
  return config


def test_base_config_passes():
  Config.from_configdict(base.get_config())


@pytest.mark.parametrize('key, value', [(k, v) for k, vs in _REFUSED.items() for v in vs])
def test_refused_knob_is_one_error_naming_it(key, value):
  with pytest.raises(ValueError, match='^' + re.escape(f'{key}={value!r} must be')):
    Config.from_configdict(_with(key, value))


@pytest.mark.parametrize('key, value', sorted(_ACCEPTED.items()))
def test_smallest_working_value_passes(key, value):
  Config.from_configdict(_with(key, value))


def test_fuzz_train_and_data_knobs():
  """Random values in random knobs: either accepted or one ValueError that names the knob."""
  rng = np.random.default_rng(0)
  values = [-(2**40), -1, 0, 1, 2, 7, 0.5, -0.5, float('nan'), True, '', 'x', None, [1], 2**40]
  keys = list(_REFUSED)
  outcomes = {'accepted': 0, 'refused': 0}
  for _ in range(300):
    key, value = keys[rng.integers(len(keys))], values[rng.integers(len(values))]
    try:
      Config.from_configdict(_with(key, value))
      outcomes['accepted'] += 1
    except ValueError as e:
      assert str(e).startswith(f'{key}='), (key, value, str(e))
      assert '\n' not in str(e)
      outcomes['refused'] += 1
  assert outcomes['accepted'] > 20 and outcomes['refused'] > 100, outcomes


def test_the_context_is_set_once_and_a_conflict_is_one_error():
  config = base.get_config()
  config.model.family, config.model.max_length = 'causal_lm', 64
  assert Config.from_configdict(config).data.max_length == 64  # data follows the model
  config = base.get_config()
  config.model.family, config.model.max_length, config.data.max_length = 'causal_lm', 256, 64
  assert Config.from_configdict(config).data.max_length == 64  # shorter rows train below it
  config.data.max_length = 300
  with pytest.raises(ValueError, match='data.max_length=300 is longer than the context model'):
    Config.from_configdict(config)
  config.model.family = 'encoder_decoder'  # which ignores data.max_length
  Config.from_configdict(config)


def test_induction_telemetry_needs_a_causal_lm():
  config = _with('train.induction_every', 5)
  config.model.family = 'bidirectional_lm'
  with pytest.raises(ValueError, match="induction_every=5 .* needs model.family='causal_lm'"):
    Config.from_configdict(config)
  config.model.family = 'causal_lm'
  Config.from_configdict(config)
