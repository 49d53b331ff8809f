"""From token ids to batches: the per-family example format, buckets, packing and a resumable order.

Batches are dicts of NumPy arrays; segment ids are 1, 2, ... per packed example and 0 on padding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from transformer.data.masking import mlm_mask
from transformer.data.tokenizers import BOS_ID, EOS_ID, MASK_ID, SPECIAL_IDS

FAMILIES = ('encoder_decoder', 'causal_lm', 'bidirectional_lm')
# The fields of each stream; a stream is packed and padded as a unit. Encoder-decoder batches have
# a source stream and a target stream, LM batches a single one (its name is the empty string).
STREAMS = {
  'encoder_decoder': {'inputs': ('inputs',), 'targets': ('decoder_inputs', 'targets', 'weights')},
  'causal_lm': {'': ('inputs', 'targets', 'weights')},
  'bidirectional_lm': {'': ('inputs', 'targets', 'token_types', 'weights')},
}
_EVAL_MASK_SEED = 7  # eval masking is fixed for every run seed, so eval losses compare across runs
TOKEN_FIELDS = ('inputs', 'targets', 'decoder_inputs')  # batch fields that hold token ids


def check_token_ids(batch: dict[str, np.ndarray], vocab_size: int, where: str) -> None:
  """Raises one ValueError if a token field of `batch` holds an id outside [0, vocab_size).

  The last guard before an embedding gather, which would otherwise read garbage or NaN rows.
  """
  for key in TOKEN_FIELDS:
    ids = batch.get(key)
    if ids is None or not ids.size or (ids.min() >= 0 and ids.max() < vocab_size):
      continue
    row, column = np.argwhere((ids < 0) | (ids >= vocab_size))[0]
    raise ValueError(
      f'{where}: {key}[{row}, {column}] = {ids[row, column]} is not a token id of the '
      f'vocabulary (valid: 0..{vocab_size - 1})'
    )


def segments_key(stream: str) -> str:
  return f'{stream}_segments' if stream else 'segments'


def positions_key(stream: str) -> str:
  return f'{stream}_positions' if stream else 'positions'


class Ragged:
  """A list of variable-length token arrays, stored as one flat array plus offsets."""

  def __init__(self, flat: np.ndarray, offsets: np.ndarray):
    self.flat, self.offsets = flat, offsets

  @classmethod
  def from_lists(cls, lists: Sequence[Sequence[int]], dtype) -> Ragged:
    offsets = np.zeros(len(lists) + 1, np.int64)
    np.cumsum([len(x) for x in lists], out=offsets[1:])
    flat = np.fromiter((t for x in lists for t in x), dtype, count=int(offsets[-1]))
    return cls(flat, offsets)

  @classmethod
  def concatenate(cls, parts: Sequence[Ragged], dtype) -> Ragged:
    flat = np.concatenate([np.zeros([0], dtype)] + [p.flat for p in parts])
    sizes = np.concatenate([np.zeros([0], np.int64)] + [np.diff(p.offsets) for p in parts])
    offsets = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return cls(flat, offsets)

  def __len__(self) -> int:
    return len(self.offsets) - 1

  def __getitem__(self, i: int) -> np.ndarray:
    return self.flat[self.offsets[i] : self.offsets[i + 1]]

  def lengths(self) -> np.ndarray:
    return np.diff(self.offsets)


@dataclasses.dataclass(frozen=True)
class Examples:
  """Tokenised examples of one process: 1 part (documents) or 2 (source, target) per example."""

  parts: tuple[Ragged, ...]

  def __len__(self) -> int:
    return len(self.parts[0])

  def __getitem__(self, i: int) -> tuple[np.ndarray, ...]:
    return tuple(p[i].astype(np.int32) for p in self.parts)


def truncate(
  family: str, parts: Sequence[list[int]], max_length: int, max_source_length: int
) -> tuple[tuple[list[int], ...], bool]:
  """Cuts an example's token lists so that its formatted sequences fit; True when anything was cut.

  Encoder-decoder: source + eos <= max_source_length and target + eos <= max_length (the target
  limit). LMs: bos + doc + eos <= max_length; a (source, target) pair becomes one sequence whose
  source part is cut to max_source_length - 1 first and whose target part takes what is left.
  """
  if family == 'encoder_decoder':
    new = (parts[0][: max_source_length - 1], parts[1][: max_length - 1])
  elif len(parts) == 1:
    new = (parts[0][: max_length - (1 if family == 'causal_lm' else 2)],)
  else:
    overhead = 2 if family == 'causal_lm' else 3  # bos, eos separator(s), final eos
    source = parts[0][: min(max_source_length - 1, max_length - overhead)]
    new = (source, parts[1][: max(0, max_length - overhead - len(source))])
  return new, any(len(a) != len(b) for a, b in zip(new, parts))


def format_example(family: str, parts: tuple[np.ndarray, ...]) -> dict[str, dict[str, np.ndarray]]:
  """One example's sequences, per stream and field (see STREAMS).

  encoder_decoder: inputs = source + eos; decoder_inputs = bos + target; targets = target + eos.
  causal_lm: for a document d, inputs = bos + d and targets = d + eos (targets are inputs shifted
    left by one). A (source, target) pair becomes d = source + eos + target with weight 0 on the
    source part (a prompt), so a decoder-only model learns to translate.
  bidirectional_lm: the sequence is bos + d + eos, or bos + source + eos + target + eos with
    token_types 1 on the target part. inputs = targets = the sequence and weights are 0 here;
    `Batcher.mask` then masks whole batches.
  """
  eos, bos = np.array([EOS_ID], np.int32), np.array([BOS_ID], np.int32)
  if family == 'encoder_decoder':
    source, target = parts
    ones = np.ones(len(target) + 1, np.float32)
    return {
      'inputs': {'inputs': np.concatenate([source, eos])},
      'targets': {
        'decoder_inputs': np.concatenate([bos, target]),
        'targets': np.concatenate([target, eos]),
        'weights': ones,
      },
    }
  if family == 'causal_lm':
    doc = parts[0] if len(parts) == 1 else np.concatenate([parts[0], eos, parts[1]])
    weights = np.ones(len(doc) + 1, np.float32)
    if len(parts) == 2:
      weights[: len(parts[0]) + 1] = 0.0  # predicting the source and the separator is not scored
    inputs, targets = np.concatenate([bos, doc]), np.concatenate([doc, eos])
    return {'': {'inputs': inputs, 'targets': targets, 'weights': weights}}
  if family == 'bidirectional_lm':
    first = np.concatenate([bos, parts[0], eos])
    second = np.concatenate([parts[1], eos]) if len(parts) == 2 else np.zeros([0], np.int32)
    tokens = np.concatenate([first, second])
    token_types = np.concatenate([np.zeros(len(first), np.int32), np.ones(len(second), np.int32)])
    weights = np.zeros(len(tokens), np.float32)
    return {
      '': {'inputs': tokens, 'targets': tokens, 'token_types': token_types, 'weights': weights}
    }
  raise ValueError(f'unknown family={family!r}; choose one of {FAMILIES}')


def bucket_lengths(max_length: int, buckets) -> tuple[int, ...]:
  """The allowed padded lengths, ascending, always ending with max_length.

  Args:
    max_length: the longest allowed length.
    buckets: False = only max_length; True = 8, 16, 32, ... below max_length; or a list of lengths.
  """
  if buckets is True:
    candidates = [8 * 2**k for k in range(32) if 8 * 2**k < max_length]
  elif not buckets:
    candidates = []
  else:
    candidates = sorted({int(b) for b in buckets if int(b) < max_length})
    if candidates and candidates[0] < 1:
      raise ValueError(f'buckets={list(buckets)} must be positive lengths')
  return tuple(candidates) + (max_length,)


@dataclasses.dataclass(frozen=True)
class Batcher:
  """Formats examples of one family and lays them out into padded or packed batches.

  Attributes:
    family: one of FAMILIES.
    max_lengths: stream -> longest row length ({'inputs': S, 'targets': T} or {'': T}).
    buckets: stream -> allowed padded lengths (see bucket_lengths).
    vocab_size, mlm_prob: for bidirectional_lm masking.
    scored: causal_lm only: the target positions of each example that carry loss (weight 1; the
      rest weigh 0), e.g. the answers of a recall example; None scores every target.
  """

  family: str
  max_lengths: dict[str, int]
  buckets: dict[str, tuple[int, ...]]
  vocab_size: int
  mlm_prob: float
  scored: tuple[int, ...] | None = None

  def format(self, parts: tuple[np.ndarray, ...]) -> dict[str, dict[str, np.ndarray]]:
    example = format_example(self.family, parts)
    if self.scored is not None and self.family == 'causal_lm':
      weights = example['']['weights']
      keep = np.zeros_like(weights)
      at = np.asarray(self.scored, np.int64)
      keep[at[at < len(weights)]] = 1.0
      example['']['weights'] = weights * keep
    return example

  def mask(self, batch: dict[str, np.ndarray], seed: Sequence[int]) -> dict[str, np.ndarray]:
    """bidirectional_lm: BERT-masks the batch's inputs (weights 1 where masked); else a no-op.

    One `mlm_mask` call per batch, with a generator seeded by `seed`.
    """
    if self.family != 'bidirectional_lm':
      return batch
    batch['inputs'], _, batch['weights'] = mlm_mask(
      np.random.default_rng(list(seed)),
      batch['targets'],  # [B, T], 0 = padding
      mask_id=MASK_ID,
      vocab_size=self.vocab_size,
      special_ids=SPECIAL_IDS,
      mask_prob=self.mlm_prob,
    )
    return batch

  def empty(self, rows: int, lengths: dict[str, int]) -> dict[str, np.ndarray]:
    """An all-padding batch with `rows` rows and the given length per stream."""
    batch = {}
    for stream, fields in STREAMS[self.family].items():
      for key in (*fields, segments_key(stream), positions_key(stream)):
        dtype = np.float32 if key == 'weights' else np.int32
        batch[key] = np.zeros([rows, lengths[stream]], dtype)  # [B, L]
    return batch

  def place(self, batch, row: int, starts: Sequence[int], example, segment: int) -> None:
    """Writes one formatted example into `row` at the given start per stream."""
    for start, (stream, fields) in zip(starts, STREAMS[self.family].items()):
      size = len(example[stream][fields[0]])
      for field in fields:
        batch[field][row, start : start + size] = example[stream][field]
      batch[segments_key(stream)][row, start : start + size] = segment
      batch[positions_key(stream)][row, start : start + size] = np.arange(size)

  def sizes(self, example) -> np.ndarray:
    return np.array([len(example[s][f[0]]) for s, f in STREAMS[self.family].items()])

  def padded(self, examples: list, rows: int, fixed: bool = False) -> dict[str, np.ndarray]:
    """One example per row; length = smallest bucket >= the longest example (or max if fixed)."""
    lengths = dict(self.max_lengths)
    if not fixed and examples:
      longest = np.max([self.sizes(ex) for ex in examples], axis=0)  # [num_streams]
      for stream, n in zip(STREAMS[self.family], longest):
        lengths[stream] = next(b for b in self.buckets[stream] if b >= n)
    batch = self.empty(rows, lengths)
    for row, example in enumerate(examples):
      self.place(batch, row, [0] * len(lengths), example, segment=1)
    return batch


class Resumable:
  """Infinite training batches of one process that resume exactly: `set_state(get_state())`
  continues with the same batches. A subclass gives its position as a JSON dict (`_progress`),
  moves to a saved one (`_restore`), and names what the position is in (`_identity`: key -> (how
  errors name it, this run's value, the value of a state without the key)), which a resumed run
  must match."""

  RESUME = 'resume with the same data config'  # how to fix a mismatch

  def __iter__(self) -> Resumable:
    return self

  def get_state(self) -> dict:
    return {**self._progress(), **{k: mine for k, (_, mine, _) in self._identity().items()}}

  def set_state(self, state: dict) -> None:
    for key, (name, mine, default) in self._identity().items():
      theirs = state.get(key, default)
      if theirs != mine:
        raise ValueError(
          f'data state is for {name}={theirs!r} but this run has {mine!r}; {self.RESUME}'
        )
    self._restore(state)


class TrainIterator(Resumable):
  """Infinite, deterministic, resumable batches of one process's training examples.

  Epoch e visits the examples in the order `default_rng([seed, process, e]).permutation(n)`;
  batches run on across epoch boundaries. The state is (epoch, position in that epoch's order).
  """

  def __init__(
    self, examples: Examples, batcher: Batcher, rows: int, seed: int, pack: bool, process: int = 0
  ):
    self._examples, self._batcher = examples, batcher
    self._rows, self._seed, self._pack, self._process = rows, seed, pack, process
    self._epoch, self._position, self._order = 0, 0, None

  def _progress(self) -> dict:
    return {'epoch': self._epoch, 'position': self._position}

  def _identity(self) -> dict:
    return {'num_examples': ('num_examples', len(self._examples), None)}

  def _restore(self, state: dict) -> None:
    self._epoch, self._position, self._order = int(state['epoch']), int(state['position']), None

  def _wrap(self) -> None:
    """Starts the next epoch when this one is used up, and draws the epoch's order."""
    if self._position == len(self._examples):
      self._epoch, self._position, self._order = self._epoch + 1, 0, None
    if self._order is None:
      rng = np.random.default_rng([self._seed, self._process, self._epoch])
      self._order = rng.permutation(len(self._examples))

  def _peek(self) -> dict[str, dict[str, np.ndarray]]:
    """The formatted next example, without advancing."""
    self._wrap()
    return self._batcher.format(self._examples[self._order[self._position]])

  def __next__(self) -> dict[str, np.ndarray]:
    self._wrap()
    # MLM masks depend on where the batch starts, so they are redrawn every epoch and on resume.
    mask_seed = (self._seed, self._process, self._epoch, self._position)
    batch = self._batcher.mask(self._next_unmasked(), mask_seed)
    where = f'training batch at epoch {self._epoch}, position {self._position}'
    check_token_ids(batch, self._batcher.vocab_size, where)
    return batch

  def _next_unmasked(self) -> dict[str, np.ndarray]:
    if not self._pack:
      examples = []
      for _ in range(self._rows):
        examples.append(self._peek())
        self._position += 1
      return self._batcher.padded(examples, self._rows)
    # Packing: greedy first-fit of examples into the rows; the batch is done at the first example
    # that fits no row, and that example starts the next batch.
    batch = self._batcher.empty(self._rows, self._batcher.max_lengths)
    limits = np.array(list(self._batcher.max_lengths.values()))  # [num_streams]
    used = np.zeros([self._rows, len(limits)], np.int64)  # [B, num_streams]
    count = np.zeros(self._rows, np.int64)  # examples per row so far
    while True:
      example = self._peek()
      sizes = self._batcher.sizes(example)  # [num_streams]
      fits = np.all(used + sizes <= limits, axis=1)  # [B]
      if not fits.any():
        return batch
      row = int(np.argmax(fits))
      count[row] += 1
      self._batcher.place(batch, row, used[row], example, segment=int(count[row]))
      used[row] += sizes
      self._position += 1


def eval_batches(
  examples: Examples, batcher: Batcher, rows: int, num_batches: int
) -> list[dict[str, np.ndarray]]:
  """`num_batches` fixed-shape batches in dataset order; rows past the end are all padding."""
  batches = []
  for b in range(num_batches):
    chunk = range(b * rows, min((b + 1) * rows, len(examples)))
    batch = batcher.padded([batcher.format(examples[i]) for i in chunk], rows, fixed=True)
    batches.append(batcher.mask(batch, (_EVAL_MASK_SEED, b)))
    check_token_ids(batches[-1], batcher.vocab_size, f'eval batch {b}')
  return batches


@dataclasses.dataclass(frozen=True)
class ExampleSource:
  """The tokens of a task held in memory: tokenised examples, laid out by `batcher`.

  `rows` and `eval_rows` are this process's; every process has `num_eval_batches` eval batches.
  """

  train: Examples
  evaluation: Examples
  documents: list  # this process's raw eval examples: texts or (source, target) pairs
  batcher: Batcher
  rows: int
  eval_rows: int
  num_eval_batches: int
  seed: int
  pack: bool
  process: int

  def train_iterator(self) -> TrainIterator:
    return TrainIterator(self.train, self.batcher, self.rows, self.seed, self.pack, self.process)

  def eval_batches(self) -> list[dict[str, np.ndarray]]:
    return eval_batches(self.evaluation, self.batcher, self.eval_rows, self.num_eval_batches)

  def train_eval_batches(self, count: int) -> list[dict[str, np.ndarray]]:
    """Up to `count` eval batches of training examples, in order (fewer for a smaller set)."""
    fit = max(1, len(self.train) // self.eval_rows)  # at least 1: padded rows weigh 0
    return eval_batches(self.train, self.batcher, self.eval_rows, min(count, fit))

  def eval_documents(self, n: int, tokenizer=None) -> list[str | tuple[str, str]]:
    return self.documents[:n]
