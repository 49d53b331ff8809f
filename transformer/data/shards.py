"""Token shards in llm.c's layout: a 256 x int32 header, then the tokens; mapped, never read whole.

Header ints: magic, version, token count (and here the document count). Magic 20240520 version 1
holds uint16 tokens (GPT-2's; how llm.c and modded-nanogpt ship FineWeb), magic 20240801 version
7 uint32 tokens (llm.c's Llama 3 shards). Every document starts with its separator token, so a
shard is a run of whole documents and shards concatenate into one token stream.
"""

from __future__ import annotations

import os

import numpy as np

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
# (magic, version) -> token dtype
FORMATS = {(20240520, 1): np.uint16, (20240801, 7): np.uint32}
# The document separator of llm.c's shards, by token dtype: GPT-2's <|endoftext|>, and Llama 3's
# <|begin_of_text|> (llm.c's fineweb.py puts it before every document).
LLMC_SEPARATOR = {np.uint16: 50256, np.uint32: 128000}


def token_dtype(vocab_size: int) -> type:
  """uint16 for a vocabulary of at most 65,536 ids, else uint32."""
  return np.uint16 if vocab_size <= 2**16 else np.uint32


def header(dtype: type, tokens: int, documents: int) -> np.ndarray:
  """The 256 x int32 header of a shard of `tokens` tokens of `dtype`."""
  ((magic, version),) = [k for k, v in FORMATS.items() if v == dtype]
  out = np.zeros(HEADER_INTS, '<i4')
  out[:4] = magic, version, tokens, documents
  return out


class ShardWriter:
  """Writes one shard as `path + '.tmp'`, renamed to `path` by `close()`: never half a shard.

  Tokens are appended in pieces (memory stays bounded); the header's counts are filled in last.
  """

  def __init__(self, path: str, vocab_size: int):
    self.path, self.dtype = path, token_dtype(vocab_size)
    self.tokens = self.documents = 0
    self._file = open(path + '.tmp', 'wb')
    try:
      self._file.write(header(self.dtype, 0, 0).tobytes())
    except BaseException:
      self.abort()
      raise

  def add(self, ids: np.ndarray, documents: int) -> None:
    """Appends token ids (already range-checked) holding `documents` whole documents."""
    self._file.write(np.asarray(ids, self.dtype).tobytes())
    self.tokens += len(ids)
    self.documents += documents

  def close(self) -> None:
    if self.tokens >= 2**31:
      raise ValueError(
        f'{self.path}: {self.tokens} tokens do not fit an llm.c header; use smaller '
        'shards (config.data.prepare_chunk_mb)'
      )
    self._file.seek(0)
    self._file.write(header(self.dtype, self.tokens, self.documents).tobytes())
    self._file.flush()
    os.fsync(self._file.fileno())
    self._file.close()
    os.replace(self.path + '.tmp', self.path)

  def abort(self) -> None:
    """Removes the temp file. On a full disk closing fails too (the buffer cannot be flushed),
    so that error is dropped: the caller is already handling the one that stopped the writing."""
    try:
      self._file.close()
    except OSError:
      pass
    if os.path.exists(self.path + '.tmp'):
      os.remove(self.path + '.tmp')


def read_header(path: str) -> tuple[type, int, int]:
  """(token dtype, token count, document count) of a shard; one ValueError for a bad one."""
  size = os.path.getsize(path)
  if size < HEADER_BYTES:
    raise ValueError(
      f'{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte llm.c header; the shard is '
      'truncated: prepare it again'
    )
  ints = np.fromfile(path, '<i4', count=HEADER_INTS)
  magic, version, tokens = (int(x) for x in ints[:3])
  dtype = FORMATS.get((magic, version))
  if dtype is None:
    valid = ', '.join(f'{m} version {v}' for m, v in FORMATS)
    raise ValueError(
      f'{path}: header has magic {magic} version {version}; not a token shard (valid: {valid})'
    )
  expected = HEADER_BYTES + tokens * np.dtype(dtype).itemsize
  if tokens < 0 or size != expected:
    raise ValueError(
      f'{path}: is {size} bytes but its header promises {tokens} tokens ({expected} bytes); the '
      'shard is truncated or corrupt: prepare (or download) it again'
    )
  return dtype, tokens, int(ints[3])


def open_shard(path: str) -> np.ndarray:
  """The tokens of a shard as a read-only memory map, shape [tokens] (nothing read yet)."""
  dtype, tokens, _ = read_header(path)
  if not tokens:
    return np.zeros([0], dtype)
  return np.memmap(path, dtype, mode='r', offset=HEADER_BYTES, shape=(tokens,))
