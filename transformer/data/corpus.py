"""The documents of a corpus, read in pieces that workers prepare side by side.

Inputs: text (a document per line), `.jsonl`, `.jsonl.gz` and `.jsonl.zst` with a `text` field,
Parquet with a `text` column (how FineWeb ships), and a TFDS split's text feature. A piece
("unit") is a byte range of a plain file (cut at line starts), a whole compressed file, one
Parquet row group, or a whole TFDS split.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import os
from collections.abc import Iterator

import numpy as np

from transformer.data import sources

TEXT_KEY = 'text'
_JSONL = ('.jsonl', '.jsonl.gz', '.jsonl.zst', '.json.gz', '.json.zst')
SAMPLE_PIECES = 64  # pieces a tokenizer's sample is drawn from: bounds what `sample` opens


def kind(path: str) -> str:
  """'llmc' (token shards), 'parquet', 'jsonl' or 'text', from the file name."""
  name = path.lower()
  if name.endswith('.bin'):
    return 'llmc'
  if name.endswith('.parquet'):
    return 'parquet'
  if name.endswith(_JSONL):
    return 'jsonl'
  return 'text'


@dataclasses.dataclass(frozen=True)
class Unit:
  """One piece of work: bytes [start, end) of a plain file (lines that start there), a whole
  compressed file (start=end=0), Parquet row group `start`, or a TFDS split: `tfds` = (name,
  split, data_dir, text feature)."""

  path: str
  start: int = 0
  end: int = 0
  tfds: tuple = ()

  def describe(self) -> str:
    return f'{self.path} [{self.start}:{self.end}]' if self.end else self.path


def units(paths: list[str], chunk_bytes: int) -> list[Unit]:
  """The units of `paths` in order: plain files cut into ~chunk_bytes ranges."""
  out = []
  for path in paths:
    size = os.path.getsize(path)
    if kind(path) == 'parquet':
      import pyarrow.parquet as pq

      try:
        groups = pq.ParquetFile(path).num_row_groups
      except Exception as e:  # pyarrow raises its own ArrowInvalid for a file that is not Parquet
        raise ValueError(f'{path}: not a readable Parquet file ({type(e).__name__}: {e})') from None
      out += [Unit(path, g) for g in range(groups)]
    elif path.endswith(('.gz', '.zst')):
      out.append(Unit(path))
    else:
      out += [Unit(path, s, min(s + chunk_bytes, size)) for s in range(0, size, chunk_bytes)]
  return out


def tfds_unit(name: str, split: str, data_dir: str, key: str) -> Unit:
  return Unit(f'tfds:{name}:{split}', tfds=(name, split, data_dir, key))


def unit_bytes(unit: Unit) -> int:
  """Input bytes of a unit (a compressed file or a row group: its share of the file; TFDS: 0,
  unknown before it is read)."""
  if unit.tfds:
    return 0
  if unit.end:
    return unit.end - unit.start
  if kind(unit.path) == 'parquet':
    import pyarrow.parquet as pq

    return pq.ParquetFile(unit.path).metadata.row_group(unit.start).total_byte_size
  return os.path.getsize(unit.path)


def _open(path: str):
  if path.endswith('.gz'):
    return gzip.open(path, 'rb')
  if path.endswith('.zst'):
    import zstandard

    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, 'rb')))
  return open(path, 'rb')


def _lines(unit: Unit) -> Iterator[tuple[str, bytes]]:
  """(where, raw line) for the lines of a unit: those of a plain file that start in its range."""
  with _open(unit.path) as f:
    if unit.end:
      if unit.start:
        f.seek(unit.start - 1)
        f.readline()  # the rest of the line that starts before this range
      number = 0
      while f.tell() < unit.end:
        offset, raw, number = f.tell(), f.readline(), number + 1
        if not raw:
          return
        yield (f'{unit.path}:{number}' if not unit.start else f'{unit.path} at byte {offset}'), raw
    else:
      for number, raw in enumerate(f, start=1):
        yield f'{unit.path}:{number}', raw


def documents(unit: Unit) -> Iterator[str]:
  """The documents of one unit; blank ones are skipped. One ValueError for a bad line."""
  if unit.tfds:
    name, split, data_dir, key = unit.tfds
    for text in sources.tfds_examples(name, split, data_dir or None, (key,)):
      if text.strip():
        yield text
    return
  if kind(unit.path) == 'parquet':
    yield from _parquet(unit)
    return
  jsonl = kind(unit.path) == 'jsonl'
  try:
    for where, raw in _lines(unit):
      try:
        line = raw.decode('utf-8')
      except UnicodeDecodeError as e:
        raise ValueError(f'{where}: invalid UTF-8 at byte {e.start} of the line') from None
      if not line.strip():
        continue
      if jsonl:
        line = _json_text(line, where)
      else:
        line = line.rstrip('\r\n')
      if line.strip():
        yield line
  except (OSError, EOFError) as e:  # a damaged .gz or .zst
    if isinstance(e, FileNotFoundError):
      raise
    raise ValueError(f'{unit.path}: unreadable ({type(e).__name__}: {e})') from None
  except Exception as e:
    if type(e).__name__ != 'ZstdError':
      raise
    raise ValueError(f'{unit.path}: unreadable zstd data ({e})') from None


def sample(
  pieces: list[Unit], budget: int, *, max_documents: int, cut: int, seed: int = 0
) -> tuple[list[str], int]:
  """A bounded sample to train a tokenizer on: (documents, their UTF-8 bytes).

  Up to `budget` bytes and `max_documents` documents, each cut to `cut` characters, taken from the
  start of pieces drawn with `seed`; each drawn piece gives an equal share of what is left, so the
  sample spans the corpus and reads little more of it than it keeps (a Parquet row group is read
  whole, a compressed file from its start). At most 64 pieces are drawn.
  """
  rng = np.random.default_rng(seed)
  drawn = sorted(rng.choice(len(pieces), min(len(pieces), SAMPLE_PIECES), replace=False))
  texts, total = [], 0
  for left, index in zip(range(len(drawn), 0, -1), drawn):
    share, taken = (budget - total) // left, 0
    for text in documents(pieces[index]):
      if taken >= share or len(texts) >= max_documents:
        break
      texts.append(text[:cut])
      taken += len(texts[-1].encode('utf-8'))
    total += taken
  return texts, total


def _json_text(line: str, where: str) -> str:
  try:
    record = json.loads(line)
  except ValueError as e:
    raise ValueError(f'{where}: not a JSON object ({e})') from None
  text = record.get(TEXT_KEY) if isinstance(record, dict) else None
  if not isinstance(text, str):
    keys = sorted(record)[:8] if isinstance(record, dict) else type(record).__name__
    raise ValueError(f'{where}: no string {TEXT_KEY!r} field (found {keys}); each line needs one')
  return text


def _parquet(unit: Unit) -> Iterator[str]:
  import pyarrow.parquet as pq

  table = pq.ParquetFile(unit.path).read_row_group(unit.start)
  if TEXT_KEY not in table.column_names:
    raise ValueError(
      f'{unit.path}: no {TEXT_KEY!r} column (columns: {table.column_names[:8]}); FineWeb-style '
      'Parquet holds the documents there'
    )
  for text in table.column(TEXT_KEY).to_pylist():
    if isinstance(text, str) and text.strip():
      yield text
