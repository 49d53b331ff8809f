"""Checks of the `config.data` knobs no data source can work with: one ValueError each, raised
before any data is read, generated or written (see `check_data_config`)."""

from __future__ import annotations

import math
from typing import Any

# key -> the smallest valid value, for the integer knobs of config.data.
MIN_INT = {
  'batch_size': 1,
  'eval_batch_size': 1,
  'vocab_multiple': 1,
  'spm_train_lines': 1,
  'max_length': 2,  # room for a token and eos
  'max_source_length': 2,
  'max_target_length': 2,
  'num_train_examples': 1,
  'num_eval_examples': 1,
  'grammar_words': 1,
  'grammar_join': 1,
  'grammar_successors': 0,
  'repeat_subset': 1,
  'grammar_seed': 0,
  'vocab_size': 7,  # more than the 5 special ids + 1
  'prepare_workers': 1,
  'prepare_chunk_mb': 1,
  'eval_batches': -1,  # -1 = auto
}


def check_int(section: str, cfg: Any, key: str, minimum: int) -> None:
  """Raises one ValueError unless `cfg[key]` (when present) is an int >= `minimum`."""
  if key not in cfg:
    return
  value = cfg[key]
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f'{section}.{key}={value!r} must be an integer >= {minimum}')


def check_fraction(section: str, cfg: Any, key: str, *, low_open: bool, high_open: bool) -> None:
  """Raises one ValueError unless `cfg[key]` (when present) is a number in the given interval."""
  if key not in cfg:
    return
  value = cfg[key]
  number = isinstance(value, (int, float)) and not isinstance(value, bool)
  ok = number and math.isfinite(value)
  ok = ok and (value > 0 if low_open else value >= 0) and (value < 1 if high_open else value <= 1)
  if not ok:
    interval = ('(' if low_open else '[') + '0, 1' + (')' if high_open else ']')
    raise ValueError(f'{section}.{key}={value!r} must be a number in {interval}')


def check_data_config(cfg: Any) -> None:
  """Raises one ValueError naming the first `config.data` knob that cannot work."""
  for key, minimum in MIN_INT.items():
    if key == 'max_length' and cfg.get(key) is None:
      continue  # follows model.max_length (transformer.training.knobs.resolve_lengths)
    check_int('data', cfg, key, minimum)
  check_fraction('data', cfg, 'mlm_prob', low_open=True, high_open=False)
  check_fraction('data', cfg, 'grammar_repeat', low_open=False, high_open=False)
  check_fraction('data', cfg, 'repeat_fraction', low_open=False, high_open=True)
  check_fraction('data', cfg, 'grammar_holdout', low_open=False, high_open=True)
  if cfg.get('grammar_holdout', 0.0) and cfg.get('task') != 'grammar':
    raise ValueError(
      f'data.grammar_holdout={cfg.grammar_holdout!r} holds out transitions of the grammar '
      f"chain; data.task={cfg.get('task')!r} has none: use task='grammar' or grammar_holdout=0"
    )
  from transformer.data import stream, text_stream

  text_stream.check_config(cfg)
  if cfg.get('sampling', 'random') not in stream.SAMPLINGS:
    raise ValueError(
      f'data.sampling={cfg.sampling!r} is not valid; choose one of {stream.SAMPLINGS}'
    )
  for key in ('train_path', 'eval_path', 'prepared_dir', 'tokenizer_path'):
    if key in cfg and not isinstance(cfg[key], str):
      raise ValueError(f'data.{key}={cfg[key]!r} must be a string (a path, or a glob)')
