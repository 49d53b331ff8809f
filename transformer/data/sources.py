"""Raw examples from local text/TSV files and from TFDS, with clear errors for bad input.

TensorFlow and TFDS are imported only when a TFDS task is built, with GPUs hidden from TF.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator

from absl import logging

from transformer.config.experiment import BAD_LINES


def _paths(pattern: str, what: str) -> list[str]:
  """The files matching `pattern` (a path or a glob), sorted; FileNotFoundError when none."""
  if not pattern:
    raise ValueError(f'{what} is empty; set it to a file path or a glob pattern')
  paths = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
  paths = [p for p in paths if os.path.isfile(p)]
  if not paths:
    raise FileNotFoundError(f'{what}={pattern!r}: no such file')
  return paths


MAX_LINE_BYTES = 64 * 2**20  # a longer line is a bad line: it is never read into memory whole


def _raw_lines(f, max_bytes: int) -> Iterator[bytes | None]:
  """The lines of a binary file, or None for one longer than `max_bytes` (read past in chunks)."""
  while True:
    raw = f.readline(max_bytes + 1)
    if not raw:
      return
    if len(raw) > max_bytes:
      while raw and not raw.endswith(b'\n'):
        raw = f.readline(2**20)
      yield None
    else:
      yield raw


def _parse_line(raw: bytes | None, number: int, columns: int, max_bytes: int) -> str | tuple | None:
  """The example on one line; None for a blank line; ValueError (no file name) for a bad one."""
  if raw is None:
    raise ValueError(f'line is longer than {max_bytes} bytes')
  try:
    line = raw.decode('utf-8').rstrip('\r\n').lstrip('\ufeff' if number == 1 else '')
  except UnicodeDecodeError as e:
    raise ValueError(f'invalid UTF-8 at byte {e.start} of the line') from None
  if not line.strip():
    return None
  if columns == 1:
    return line
  fields = line.split('\t')
  if len(fields) != columns or not all(x.strip() for x in fields):
    raise ValueError(
      f'expected {columns} non-empty tab-separated columns (source<TAB>target), found '
      f'{len(fields)} column(s)' + ('' if len(fields) != columns else ' with an empty one')
    )
  return tuple(fields)


def read_lines(
  pattern: str,
  what: str,
  columns: int = 1,
  *,
  bad_lines: str = 'error',
  max_line_bytes: int = MAX_LINE_BYTES,
) -> list:
  """Non-blank lines of UTF-8 files: strings (columns=1) or tuples split at tabs (columns=2).

  Blank (or whitespace-only) lines are always skipped silently. A bad line (invalid UTF-8, a
  wrong column count or an empty column, or longer than `max_line_bytes`) is an error, or with
  bad_lines='skip' is left out and counted: one warning per file gives the count and the first.

  Args:
    pattern: a file path or glob (files are read in sorted order).
    what: the config key, for error messages (e.g. 'train_path').
    columns: 1 for one document per line, 2 for `source<TAB>target` lines.
    bad_lines: 'error' or 'skip' (config.data.bad_lines).
    max_line_bytes: the longest line accepted.

  Raises:
    FileNotFoundError: no file matches. ValueError: a bad line (naming the file and line) when
    bad_lines='error', or no usable lines at all.
  """
  if bad_lines not in BAD_LINES:
    raise ValueError(f'bad_lines={bad_lines!r} is not valid; choose one of {BAD_LINES}')
  examples = []
  for path in _paths(pattern, what):
    skipped, first = 0, ''
    with open(path, 'rb') as f:
      for number, raw in enumerate(_raw_lines(f, max_line_bytes), start=1):
        try:
          example = _parse_line(raw, number, columns, max_line_bytes)
        except ValueError as e:
          if bad_lines == 'error':
            raise ValueError(
              f"{path}:{number}: {e}; fix the file or set config.data.bad_lines='skip'"
            ) from None
          skipped, first = skipped + 1, first or f'line {number}: {e}'
          continue
        if example is not None:
          examples.append(example)
    if skipped:
      logging.warning(
        '%s: skipped %d bad line(s) (bad_lines=skip); first: %s', path, skipped, first
      )
  if not examples:
    raise ValueError(f'{what}={pattern!r} has no usable lines (blank and bad lines are skipped)')
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


class DownloadFailed(ConnectionError):
  """A TFDS dataset could not be downloaded (no network, or its host is unreachable)."""


def _network_failure(error: BaseException) -> BaseException | None:
  """The network error in `error`'s chain of causes (requests, urllib, sockets, TFDS), if any."""
  import socket
  import urllib.error

  import requests
  from tensorflow_datasets.core.download import util as download_util

  kinds = (
    requests.exceptions.RequestException,  # ConnectionError, Timeout, RetryError, ...
    urllib.error.URLError,
    socket.gaierror,  # the host name does not resolve
    socket.timeout,
    ConnectionError,
    download_util.DownloadError,  # TFDS: an HTTP status other than 200
  )
  seen = set()
  while error is not None and id(error) not in seen:
    if isinstance(error, kinds):
      return error
    seen.add(id(error))
    error = error.__cause__ or error.__context__
  return None


def _first_line(error: BaseException) -> str:
  text = str(error).strip()
  return text.splitlines()[0] if text else '(no message)'


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
  name: str, split: str, data_dir: str | None, keys: tuple[str, ...], bad_lines: str = 'error'
) -> Iterator[str | tuple[str, ...]]:
  """Decoded strings of the `keys` features of a TFDS split, in the split's stored order.

  Yields a string for one key and a tuple for several. The dataset is downloaded and prepared
  under data_dir on first use (as `tfds.load` does); a download that fails for want of network
  is one `DownloadFailed` naming the dataset and `config.data.tfds_data_dir`. An example that is
  not valid UTF-8 is a ValueError naming it, or with bad_lines='skip' is left out (one warning
  gives the count).
  """
  tfds = _import_tfds()
  features = tfds_features(name, data_dir)
  missing = [k for k in keys if k not in features]
  if missing:
    raise ValueError(f'{name!r} has no feature(s) {missing}; its features are {features}')
  builder = tfds.builder(name, data_dir=data_dir or None)
  try:
    builder.download_and_prepare()  # a no-op once the dataset is prepared under data_dir
  except Exception as error:
    cause = _network_failure(error)
    if cause is None:
      raise
    raise DownloadFailed(
      f'could not download TFDS dataset {name!r} ({type(cause).__name__}: '
      f'{_first_line(cause)}); with no network, prepare it where there is one (tfds.builder('
      f'{name!r}, data_dir=DIR).download_and_prepare()), copy DIR here and pass '
      f'--config.data.tfds_data_dir=DIR (now {data_dir or "the TFDS default"!r})'
    ) from error
  dataset = builder.as_dataset(split=split, shuffle_files=False)
  skipped = 0
  for index, example in enumerate(tfds.as_numpy(dataset)):
    try:
      values = tuple(example[k].decode('utf-8') for k in keys)
    except UnicodeDecodeError as e:
      if bad_lines != 'skip':
        raise ValueError(
          f'{name!r} split {split!r} example {index}: invalid UTF-8 at byte {e.start}; set '
          "config.data.bad_lines='skip' to leave such examples out"
        ) from None
      skipped += 1
      continue
    yield values[0] if len(keys) == 1 else values
  if skipped:
    logging.warning('%s %s: skipped %d example(s) with invalid UTF-8', name, split, skipped)
