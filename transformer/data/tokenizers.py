"""Byte, character and SentencePiece tokenizers with one fixed set of special ids, and imported
HF ones.

Each saves to a directory as `tokenizer.json` (plus `spm.model` for SentencePiece); nothing is
pickled.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence

import numpy as np

PAD_ID, BOS_ID, EOS_ID, MASK_ID, UNK_ID = 0, 1, 2, 3, 4
NUM_SPECIAL = 5  # ids below this are specials in both tokenizers
SPECIAL_IDS = (PAD_ID, BOS_ID, EOS_ID, MASK_ID, UNK_ID)
MASK_PIECE = '<mask>'  # SentencePiece turns this literal text into MASK_ID
_JSON = 'tokenizer.json'
_SPM_MODEL = 'spm.model'


class _Specials:
  """The fixed special ids shared by every tokenizer."""

  pad_id = PAD_ID
  bos_id = BOS_ID
  eos_id = EOS_ID
  mask_id = MASK_ID
  unk_id = UNK_ID

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [self.encode(t) for t in texts]

  def piece(self, token_id: int) -> str:
    """One token's text, a special one by its name ('<bos>'), as TransformerLens shows it."""
    return _SPECIAL_NAMES.get(int(token_id)) or self.decode([token_id])


_SPECIAL_NAMES = {PAD_ID: '<pad>', BOS_ID: '<bos>', EOS_ID: '<eos>', MASK_ID: '<mask>'}
_SPECIAL_NAMES[UNK_ID] = '<unk>'


def _save_json(directory: str, meta: dict) -> None:
  """Writes `meta` as directory/tokenizer.json, making the directory."""
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, _JSON), 'w') as f:
    json.dump(meta, f)


def _strip(ids: Iterable[int]) -> list[int]:
  """Cuts ids at the first eos and drops pad, bos and mask."""
  out = []
  for i in ids:
    i = int(i)
    if i == EOS_ID:
      break
    if i not in (PAD_ID, BOS_ID, MASK_ID):
      out.append(i)
  return out


class ByteTokenizer(_Specials):
  """UTF-8 bytes: byte b is id b + 5, so vocab_size = 261."""

  kind = 'byte'
  vocab_size = 256 + NUM_SPECIAL

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`, without bos/eos."""
    return (np.frombuffer(text.encode('utf-8'), np.uint8).astype(np.int32) + NUM_SPECIAL).tolist()

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids`: stops at eos, skips pad/bos/mask; unk becomes U+FFFD."""
    data = bytes(
      i - NUM_SPECIAL if NUM_SPECIAL <= i < self.vocab_size else 0xFF for i in _strip(ids)
    )
    return data.decode('utf-8', errors='replace')

  def save(self, directory: str) -> None:
    _save_json(directory, {'kind': self.kind, 'vocab_size': self.vocab_size})


class CharTokenizer(_Specials):
  """The characters of a text, as nanoGPT's shakespeare_char: character i of the sorted set is id
  i + 5, so vocab_size = 5 + the number of distinct characters (65 for tiny-shakespeare)."""

  kind = 'char'

  def __init__(self, chars: str):
    if not chars or len(set(chars)) != len(chars) or list(chars) != sorted(chars):
      raise ValueError('a char vocabulary is a non-empty string of distinct characters, sorted')
    self.chars = chars
    self.vocab_size = NUM_SPECIAL + len(chars)
    self._points = np.array([ord(c) for c in chars], np.int64)  # sorted code points

  @classmethod
  def from_texts(cls, texts: Iterable[str]) -> CharTokenizer:
    """The vocabulary of every character in `texts`."""
    seen = set()
    for text in texts:
      seen.update(text)
    if not seen:
      raise ValueError('cannot build a char vocabulary from an empty text')
    return cls(''.join(sorted(seen)))

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`, without bos/eos; ValueError naming the first unknown character."""
    return self.encode_array(text).tolist()

  def encode_array(self, text: str) -> np.ndarray:
    """`encode` as an int32 array: a megabyte of text in a few milliseconds."""
    points = np.frombuffer(text.encode('utf-32-le'), np.uint32).astype(np.int64)
    index = np.searchsorted(self._points, points)
    index = np.minimum(index, len(self._points) - 1)
    unknown = self._points[index] != points
    if unknown.any():
      at = int(np.flatnonzero(unknown)[0])
      raise ValueError(
        f'character {text[at]!r} (U+{ord(text[at]):04X}) at position {at} is not in the char '
        f'vocabulary: the {len(self.chars)} characters of the training text '
        f'({_shown(self.chars)})'
      )
    return (index + NUM_SPECIAL).astype(np.int32)

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids`: stops at eos, skips pad/bos/mask; unk and unknown ids become U+FFFD."""
    n = len(self.chars)
    return ''.join(
      self.chars[i - NUM_SPECIAL] if NUM_SPECIAL <= i < NUM_SPECIAL + n else '\ufffd'
      for i in _strip(ids)
    )

  def save(self, directory: str) -> None:
    _save_json(directory, {'kind': self.kind, 'vocab_size': self.vocab_size, 'chars': self.chars})


def _shown(chars: str, limit: int = 40) -> str:
  """A short printable view of a character set for error messages."""
  text = repr(chars[:limit])
  return text + (f' and {len(chars) - limit} more' if len(chars) > limit else '')


class SentencePieceTokenizer(_Specials):
  """A trained SentencePiece model whose specials sit at our fixed ids."""

  kind = 'sentencepiece'

  def __init__(self, model_proto: bytes, requested_vocab_size: int | None = None):
    import sentencepiece as spm

    self.model_proto = model_proto
    self.requested_vocab_size = requested_vocab_size
    self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
    found = (self._sp.pad_id(), self._sp.bos_id(), self._sp.eos_id(), self._sp.unk_id())
    if found != (PAD_ID, BOS_ID, EOS_ID, UNK_ID) or self._sp.piece_to_id(MASK_PIECE) != MASK_ID:
      raise ValueError(
        f'SentencePiece model has special ids pad/bos/eos/unk={found}; expected '
        f'{(PAD_ID, BOS_ID, EOS_ID, UNK_ID)} and {MASK_PIECE}={MASK_ID}'
      )
    self.vocab_size = self._sp.get_piece_size()

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`, without bos/eos."""
    return self._sp.encode(text, out_type=int)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return self._sp.encode(list(texts), out_type=int)

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids`: stops at eos, skips pad/bos/mask."""
    return self._sp.decode(_strip(ids))

  def save(self, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, _SPM_MODEL), 'wb') as f:
      f.write(self.model_proto)
    meta = {
      'kind': self.kind,
      'vocab_size': self.vocab_size,
      'requested_vocab_size': self.requested_vocab_size,
      'model_file': _SPM_MODEL,
    }
    _save_json(directory, meta)


class HFTokenizer:
  """A Hugging Face `tokenizers` tokenizer.json (of an imported GPT-2 or BERT), with its own ids.

  Special ids come from tokenizer_config.json beside it (None when absent). Needs `tokenizers`.
  """

  kind = 'hf'

  def __init__(self, directory: str):
    try:
      import tokenizers
    except ImportError as e:
      raise ImportError(
        f'{directory!r} holds a Hugging Face tokenizer; pip install tokenizers'
      ) from e
    self._tok = tokenizers.Tokenizer.from_file(os.path.join(directory, _JSON))
    # Padding and truncation are the batcher's job (some hub tokenizer.json files pad to 128).
    self._tok.no_padding()
    self._tok.no_truncation()
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    config, path = {}, os.path.join(directory, 'tokenizer_config.json')
    if os.path.exists(path):
      with open(path) as f:
        config = json.load(f)
    for name in ('pad', 'bos', 'eos', 'mask', 'unk'):
      token = config.get(f'{name}_token')
      token = token.get('content') if isinstance(token, dict) else token
      setattr(self, f'{name}_id', self._tok.token_to_id(token) if isinstance(token, str) else None)
    self._config = config

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of `text`; `add_special_tokens` adds those of its post-processor ([CLS] ...)."""
    return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids`, special tokens skipped."""
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

  def piece(self, token_id: int) -> str:
    """One token's text, a special one by its name ('<|endoftext|>', '[CLS]')."""
    return self._tok.decode([int(token_id)], skip_special_tokens=False)

  def token(self, token_id: int) -> str | None:
    """The vocabulary entry of one id, special tokens included ('[CLS]'); None if out of range."""
    return self._tok.id_to_token(int(token_id))

  def save(self, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    self._tok.save(os.path.join(directory, _JSON))
    if self._config:
      with open(os.path.join(directory, 'tokenizer_config.json'), 'w') as f:
        json.dump(self._config, f)


class IdsTokenizer:
  """Token ids with no text behind them: llm.c shards read without their tokenizer.json.

  Decoding writes the ids out ('15496 11 995'); there is no encoding.
  """

  kind = 'ids'
  pad_id = bos_id = mask_id = unk_id = None

  def __init__(self, vocab_size: int, eos_id: int):
    self.vocab_size, self.eos_id = int(vocab_size), int(eos_id)

  def encode(self, text: str) -> list[int]:
    raise ValueError(
      'token-id shards have no tokenizer to encode text with; pass the one that made them '
      "(config.data.tokenizer_path, e.g. GPT-2's tokenizer.json)"
    )

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [self.encode(t) for t in texts]

  def decode(self, ids: Iterable[int]) -> str:
    return ' '.join(str(int(i)) for i in ids)

  def piece(self, token_id: int) -> str:
    return str(int(token_id))

  def save(self, directory: str) -> None:
    _save_json(directory, {'kind': self.kind, 'vocab_size': self.vocab_size, 'eos_id': self.eos_id})


Tokenizer = ByteTokenizer | CharTokenizer | SentencePieceTokenizer | HFTokenizer | IdsTokenizer


def tokenizer_from_file(path: str) -> Tokenizer:
  """An existing tokenizer: a SentencePiece `.model` file, a Hugging Face `tokenizer.json` (such
  as GPT-2's), or a directory holding either (or one that sparrow saved)."""
  if os.path.isdir(path):
    if os.path.exists(os.path.join(path, _JSON)):
      return load_tokenizer(path)
    models = sorted(n for n in os.listdir(path) if n.endswith('.model'))
    if not models:
      raise FileNotFoundError(f'tokenizer_path={path!r} holds no tokenizer.json and no .model file')
    path = os.path.join(path, models[0])
  if not os.path.isfile(path):
    raise FileNotFoundError(f'tokenizer_path={path!r}: no such file or directory')
  if path.endswith('.json'):
    return load_tokenizer(os.path.dirname(os.path.abspath(path)))
  with open(path, 'rb') as f:
    proto = f.read()
  try:
    return SentencePieceTokenizer(proto)
  except (RuntimeError, TypeError) as e:
    raise ValueError(f'tokenizer_path={path!r} is not a SentencePiece model: {e}') from None


def train_sentencepiece(lines: Iterable[str], vocab_size: int) -> SentencePieceTokenizer:
  """Trains a unigram SentencePiece model with our special ids (digits split one per piece).

  The vocabulary may come out smaller than `vocab_size` when the corpus is tiny.
  """
  import sentencepiece as spm

  if vocab_size <= NUM_SPECIAL + 1:
    raise ValueError(f'vocab_size={vocab_size} is too small; use more than {NUM_SPECIAL + 1}')
  model = io.BytesIO()
  lines = [line for line in lines if line.strip()]
  if not lines:
    raise ValueError('cannot train SentencePiece on an empty corpus')
  # minloglevel silences its log; its logstream would point this process's stderr (fd 2) at
  # that stream while it trains, hiding every other thread's lines (preparation's progress).
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(lines),
    model_writer=model,
    vocab_size=vocab_size,
    hard_vocab_limit=False,  # tiny corpora give a smaller vocabulary instead of an error
    pad_id=PAD_ID,
    bos_id=BOS_ID,
    eos_id=EOS_ID,
    unk_id=UNK_ID,
    user_defined_symbols=[MASK_PIECE],  # lands on the free id 3 = MASK_ID
    split_digits=True,
    num_threads=1,  # single-threaded training is reproducible across machines
    minloglevel=2,
  )
  return SentencePieceTokenizer(model.getvalue(), requested_vocab_size=vocab_size)


def load_tokenizer(directory: str) -> Tokenizer:
  """Restores a tokenizer written by `tokenizer.save(directory)`."""
  path = os.path.join(directory, _JSON)
  if not os.path.exists(path):
    raise FileNotFoundError(f'no tokenizer in {directory!r}: {path!r} does not exist')
  try:
    with open(path, 'rb') as f:
      meta = json.loads(f.read().decode())
  except (OSError, ValueError) as e:  # ValueError: not UTF-8 or not JSON
    raise ValueError(f'the tokenizer file {path!r} is unreadable: {e}; restore or remove it') from e
  if not isinstance(meta, dict):
    raise ValueError(f'the tokenizer file {path!r} must hold a JSON object; got {meta!r:.80}')
  if 'kind' not in meta and 'model' in meta:  # a Hugging Face tokenizer.json (inference.hf)
    return HFTokenizer(directory)
  if 'kind' not in meta:
    raise ValueError(
      f'the tokenizer file {path!r} has no "kind"; valid: byte, char, sentencepiece, hf, ids'
    )
  if meta['kind'] == 'byte':
    return ByteTokenizer()
  if meta['kind'] == 'char':
    chars = meta.get('chars')
    if not isinstance(chars, str):
      raise ValueError(f'the char tokenizer file {path!r} has no "chars" string; restore it')
    return CharTokenizer(chars)
  if meta['kind'] == 'ids':
    return IdsTokenizer(meta['vocab_size'], meta['eos_id'])
  if meta['kind'] == 'sentencepiece':
    model_file = os.path.join(directory, str(meta.get('model_file')))
    try:
      with open(model_file, 'rb') as f:
        return SentencePieceTokenizer(f.read(), meta.get('requested_vocab_size'))
    except (OSError, RuntimeError) as e:  # RuntimeError: SentencePiece cannot parse it
      raise ValueError(f'the SentencePiece model {model_file!r} is unreadable: {e}') from e
  raise ValueError(
    f'unknown tokenizer kind={meta["kind"]!r} in {path!r}; valid: byte, char, sentencepiece, '
    'hf, ids'
  )


def save_whole(tokenizer: Tokenizer, cache: str) -> bool:
  """Saves into a temp directory beside `cache`, then renames it to `cache`: never half a tokenizer.

  Returns False (saving nothing) when `cache` appeared meanwhile, e.g. from a concurrent run.
  """
  parent = os.path.dirname(cache)
  os.makedirs(parent, exist_ok=True)
  prefix = f'.{os.path.basename(cache)}.tmp-'
  for name in os.listdir(parent):  # left by a save that was cut short
    if name.startswith(prefix):
      shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
  tmp = tempfile.mkdtemp(dir=parent, prefix=prefix)
  try:
    tokenizer.save(tmp)
    for name in os.listdir(tmp):  # on disk before the rename makes them visible
      with open(os.path.join(tmp, name), 'rb+') as f:
        os.fsync(f.fileno())
    os.rename(tmp, cache)  # fails if `cache` is a non-empty directory by now
  except OSError:
    shutil.rmtree(tmp, ignore_errors=True)
    if os.path.exists(cache):
      return False
    raise
  return True
