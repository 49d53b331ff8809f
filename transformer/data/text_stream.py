"""task='text' for the language models: a text file is one running text, cut into rows.

As nanoGPT's shakespeare_char: the file (or the files of a glob, one after another, with the
document separator between them) is tokenised whole into memory, the last `data.eval_fraction` of
its tokens is the eval split unless `data.eval_path` is given, and rows are read from the token
stream by the same code as a prepared corpus (`stream`): at random offsets for training by default,
every token once in order for evaluation. A file that holds one document a line is
`data.text_format='lines'` instead (`tasks`).
"""

from __future__ import annotations

import numpy as np

from transformer.config.experiment import DataConfig
from transformer.data import sources, stream
from transformer.data.tokenizers import EOS_ID, Tokenizer

_ENCODE_CHARS = 2**16  # characters encoded at a time (cut at a newline)


def read_text(path: str, what: str) -> str:
  """The whole text of one file; one ValueError for an empty, binary or non-UTF-8 file."""
  with open(path, 'rb') as f:
    raw = f.read()
  if not raw.strip():
    raise ValueError(f'{what}: {path} is empty; give it a UTF-8 text file')
  if b'\x00' in raw[: 2**20]:
    at = raw.index(b'\x00')
    raise ValueError(f'{what}: {path} is binary (a NUL byte at offset {at}); give it UTF-8 text')
  try:
    text = raw.decode('utf-8')
  except UnicodeDecodeError as e:
    line = raw[: e.start].count(b'\n') + 1
    raise ValueError(
      f'{what}: {path} is not UTF-8 text (invalid byte 0x{raw[e.start]:02x} at offset {e.start}, '
      f'line {line}); convert it to UTF-8'
    ) from None
  return text.lstrip('\ufeff')


def read_texts(pattern: str, what: str) -> list[str]:
  """The texts of the files matching `pattern` (a path or a glob), in sorted order."""
  return [read_text(path, what) for path in sources._paths(pattern, what)]


def encode(tokenizer: Tokenizer, texts: list[str], separator: int) -> np.ndarray:
  """The token stream of `texts`: each encoded whole (in newline-cut pieces) with `separator`
  between two texts, none before the first (a single file is exactly its characters)."""
  parts = []
  for number, text in enumerate(texts):
    if number:
      parts.append(np.array([separator], np.int32))
    parts += [np.asarray(_encode(tokenizer, piece), np.int32) for piece in _pieces(text)]
  return np.concatenate(parts) if parts else np.zeros([0], np.int32)


def _encode(tokenizer: Tokenizer, text: str):
  fast = getattr(tokenizer, 'encode_array', None)
  return fast(text) if fast is not None else tokenizer.encode(text)


def _pieces(text: str) -> list[str]:
  """`text` cut after a newline about every _ENCODE_CHARS characters (pieces join to it)."""
  out, start = [], 0
  while start < len(text):
    end = text.find('\n', start + _ENCODE_CHARS)
    end = len(text) if end < 0 else end + 1
    out.append(text[start:end])
    start = end
  return out


def build(cfg: DataConfig, *, family: str, tokenizer_for) -> tuple:
  """(tokenizer, info, train stream, eval stream, separator) of a running text.
  `tokenizer_for(texts)` gives the run's tokenizer (built from the texts, or the one cached in
  the workdir)."""
  train_texts = read_texts(cfg.train_path, 'data.train_path')
  eval_texts = read_texts(cfg.eval_path, 'data.eval_path') if cfg.eval_path else []
  tokenizer = tokenizer_for(train_texts + eval_texts)
  separator = getattr(tokenizer, 'eos_id', None)
  separator = EOS_ID if separator is None else separator
  train = encode(tokenizer, train_texts, separator)
  span = cfg.max_length + (1 if family == 'causal_lm' else 0)  # tokens one row reads
  where = f'data.train_path={cfg.train_path!r}'
  if eval_texts:
    evaluation = encode(tokenizer, eval_texts, separator)
    eval_where = f'data.eval_path={cfg.eval_path!r}'
  else:
    split = int(len(train) * (1 - cfg.eval_fraction))  # as nanoGPT's prepare.py: n * 0.9
    train, evaluation = train[:split], train[split:]
    eval_where = f'the last {cfg.eval_fraction:g} of {where}'
    where = f'the first {1 - cfg.eval_fraction:g} of {where}'
  for tokens, what in ((train, where), (evaluation, eval_where)):
    if len(tokens) < span:
      raise ValueError(
        f'{what} holds {len(tokens)} tokens, fewer than one row of {span} (data.max_length='
        f'{cfg.max_length}{" + 1 target" if family == "causal_lm" else ""}); give more text or '
        'a shorter model.max_length'
      )
  info = {'text_format': 'stream'}
  return tokenizer, info, stream.ArrayStream(train), stream.ArrayStream(evaluation), separator
