"""Raw examples from local text/TSV files and from TFDS, with clear errors for bad input.

TensorFlow and TFDS are imported only when a TFDS task is built, with GPUs hidden from TF.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator


def _paths(pattern: str, what: str) -> list[str]:
  """The files matching `pattern` (a path or a glob), sorted; FileNotFoundError when none."""
  if not pattern:
    raise ValueError(f'{what} is empty; set it to a file path or a glob pattern')
  paths = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
  paths = [p for p in paths if os.path.isfile(p)]
  if not paths:
    raise FileNotFoundError(f'{what}={pattern!r}: no such file')
  return paths


def read_lines(pattern: str, what: str, columns: int = 1) -> list:
  """Non-blank lines of UTF-8 files: strings (columns=1) or tuples split at tabs (columns=2).

  Args:
    pattern: a file path or glob (files are read in sorted order).
    what: the config key, for error messages (e.g. 'train_path').
    columns: 1 for one document per line, 2 for `source<TAB>target` lines.

  Raises:
    FileNotFoundError: no file matches. ValueError: invalid UTF-8, a wrong column count or an empty
    column (naming the file and line), or no usable lines at all.
  """
  examples = []
  for path in _paths(pattern, what):
    with open(path, 'rb') as f:
      for number, raw in enumerate(f, start=1):
        try:
          line = raw.decode('utf-8').rstrip('\r\n').lstrip('\ufeff' if number == 1 else '')
        except UnicodeDecodeError as e:
          raise ValueError(
            f'{path}:{number}: invalid UTF-8 at byte {e.start} of the line'
          ) from None
        if not line.strip():
          continue  # blank lines are skipped
        if columns == 1:
          examples.append(line)
          continue
        fields = line.split('\t')
        if len(fields) != columns or not all(x.strip() for x in fields):
          raise ValueError(
            f'{path}:{number}: expected {columns} non-empty tab-separated columns '
            f'(source<TAB>target), found {len(fields)} column(s)'
            + ('' if len(fields) != columns else ' with an empty one')
          )
        examples.append(tuple(fields))
  if not examples:
    raise ValueError(f'{what}={pattern!r} has no usable lines (blank lines are skipped)')
  return examples


def _import_tfds():
  """Imports TFDS with every GPU hidden from TensorFlow (JAX owns the accelerators)."""
  import tensorflow as tf

  try:
    tf.config.set_visible_devices([], 'GPU')
  except RuntimeError:
    pass  # TF was initialised already; its device list can no longer change
  import tensorflow_datasets as tfds

  return tfds


def tfds_features(name: str, data_dir: str | None) -> list[str]:
  """The top-level feature names of a TFDS dataset; ValueError for an unknown name."""
  tfds = _import_tfds()
  try:
    builder = tfds.builder(name, data_dir=data_dir or None)
  except tfds.core.registered.DatasetNotFoundError:
    raise ValueError(
      f"unknown tfds_name={name!r}; use a TFDS name such as 'wmt14_translate/de-en' or 'lm1b'"
    ) from None
  return list(builder.info.features.keys())


def tfds_examples(
  name: str, split: str, data_dir: str | None, keys: tuple[str, ...]
) -> Iterator[str | tuple[str, ...]]:
  """Decoded strings of the `keys` features of a TFDS split, in the split's stored order.

  Yields a string for one key and a tuple for several. The dataset is downloaded and prepared
  under data_dir on first use (as `tfds.load` does).
  """
  tfds = _import_tfds()
  features = tfds_features(name, data_dir)
  missing = [k for k in keys if k not in features]
  if missing:
    raise ValueError(f'{name!r} has no feature(s) {missing}; its features are {features}')
  dataset = tfds.load(name, split=split, data_dir=data_dir or None, shuffle_files=False)
  for example in tfds.as_numpy(dataset):
    values = tuple(example[k].decode('utf-8') for k in keys)
    yield values[0] if len(keys) == 1 else values
