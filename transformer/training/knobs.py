"""Checks of the `config.train` and `config.data` knobs that cannot work (zero intervals, negative
counts, a model norm the data layout cannot serve, ...): one ValueError each, before any data work
and before anything is written."""

from __future__ import annotations

import math

import ml_collections

from transformer.data.knobs import check_data_config, check_fraction, check_int
from transformer.training import faults

# key -> the smallest valid value, for the integer knobs of config.train.
MIN_INT = {
  'steps': 1,
  'grad_accum_steps': 1,
  'loss_chunk_size': 1,
  'log_every': 1,
  'head_entropy_every': 0,  # 0 = off
  'induction_every': 0,  # 0 = off
  'eval_every': 1,
  'checkpoint_every': 1,
  'keep_checkpoints': 1,
  'num_samples': 0,
  'eval_decode_examples': 0,
  'max_decode_length': 1,
  'loss_scale_period': 1,
}


def resolve_lengths(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Sets the context once: data.max_length (an LM's row) follows model.max_length unless given.

  A row longer than the model's context is one ValueError; a shorter one trains below it (the
  long-context sweeps do). Returns `config`, changed in place.
  """
  model, data = config.model, config.data
  if data.get('max_length') is None:
    data.max_length = model.max_length
  elif (
    model.get('family') != 'encoder_decoder'
    and isinstance(data.max_length, int)
    and isinstance(model.max_length, int)
    and data.max_length > model.max_length
  ):
    raise ValueError(
      f'data.max_length={data.max_length} is longer than the context model.max_length='
      f'{model.max_length}; set the context once, as model.max_length (data.max_length follows '
      'it), or train on rows no longer than it'
    )
  block = model.get('compress_block')
  if model.get('attention') == 'compressed' and isinstance(data.max_length, int) and block:
    if data.max_length % block:
      raise ValueError(
        f'model.compress_block={block} does not divide the row length data.max_length='
        f'{data.max_length}; choose a block that divides it'
      )
  return config


def check_norm_data(config: ml_collections.ConfigDict) -> None:
  """model.norm='batchnorm' takes its statistics over whole examples: no packed rows."""
  if config.model.get('norm') == 'batchnorm' and config.data.get('pack'):
    raise ValueError(
      "data.pack=True puts several examples in one row, and model.norm='batchnorm' would then "
      'take its statistics over a mix of examples; use data.pack=False with batchnorm, or '
      "model.norm='layernorm' or 'rmsnorm' with packing"
    )


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises one ValueError naming the first bad `train.*` or `data.*` knob of `config`."""
  resolve_lengths(config)
  tcfg = config.train
  for key, minimum in MIN_INT.items():
    check_int('train', tcfg, key, minimum)
  check_fraction('train', tcfg, 'label_smoothing', low_open=False, high_open=True)
  scale = tcfg.get('loss_scale', 1.0)
  if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
    raise ValueError(f'train.loss_scale={scale!r} must be a finite number > 0')
  if scale <= 0:
    raise ValueError(f'train.loss_scale={scale!r} must be a finite number > 0')
  if tcfg.get('induction_every', 0) and config.model.get('family') != 'causal_lm':
    raise ValueError(
      f'train.induction_every={tcfg.induction_every} probes next-token heads; it needs '
      f"model.family='causal_lm', not {config.model.get('family')!r}"
    )
  check_norm_data(config)
  faults.check_config(tcfg)
  check_data_config(config.data)
