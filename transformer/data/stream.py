"""Batches streamed from a token sequence: documents run on, separated, and are cut into rows.

The tokens are a prepared corpus's shards read through memory maps (`TokenStream`: host memory
and start-up do not grow with the corpus) or a text held in memory (`ArrayStream`). A row of a
causal LM is tokens [o, o + T] (inputs and targets one apart), of an MLM tokens [o, o + T).
Training rows start at random offsets o, drawn for each global batch from (seed, batch number),
as nanoGPT samples them (`sampling='random'`), or at o = r*T for global row r
(`sampling='sequential'`: every token is a target once per epoch, none is dropped, and epochs run
on without a seam). Global batch b is rows [b*B, (b+1)*B); process p of P reads B/P of them from
b*B + p*B/P, so the data position is one global row count: it resumes under any number of
processes. Evaluation reads rows r*T in order, once.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from transformer.config.experiment import SAMPLINGS
from transformer.data import batching, masking, shards
from transformer.data.tokenizers import MASK_ID, PAD_ID, Tokenizer

_EVAL_MASK_SEED = 7  # eval masks are the same for every run seed, so eval losses compare
_EXAMPLE_CHUNK = 2**16  # eval tokens read at a time for the decoded examples
AUTO_EVAL_TOKENS = 2**22  # eval_batches=-1 scores a split of up to this many tokens whole
AUTO_EVAL_BATCHES = 20  # and the first this many batches of a larger one


class TokenStream:
  """The tokens of some shards, in order, as one sequence; only what is read is paged in."""

  def __init__(self, paths: list[str]):
    self.paths = list(paths)
    self._maps = [shards.open_shard(p) for p in self.paths]
    sizes = np.array([len(m) for m in self._maps], np.int64)
    self.ends = np.cumsum(sizes)  # [shards]
    self.dtype = self._maps[0].dtype if self._maps else np.uint16

  def __len__(self) -> int:
    return int(self.ends[-1]) if len(self.ends) else 0

  def read(self, start: int, count: int) -> np.ndarray:
    """Tokens [start, start + count) as int32, wrapping around the end; start may be any int."""
    total = len(self)
    out = np.empty(count, np.int32)
    done, position = 0, start % total
    while done < count:
      shard = int(np.searchsorted(self.ends, position, side='right'))
      begin = int(self.ends[shard - 1]) if shard else 0
      n = min(count - done, int(self.ends[shard]) - position)
      out[done : done + n] = self._maps[shard][position - begin : position - begin + n]
      done, position = done + n, (position + n) % total
    return out


class ArrayStream:
  """Tokens held in memory (a text read whole) behind the `TokenStream` interface."""

  def __init__(self, tokens: np.ndarray):
    self.tokens = np.asarray(tokens, np.int32)  # [N]
    self.paths: list[str] = []

  def __len__(self) -> int:
    return len(self.tokens)

  def read(self, start: int, count: int) -> np.ndarray:
    """Tokens [start, start + count), wrapping around the end; start may be any int."""
    start %= len(self.tokens)
    if start + count <= len(self.tokens):
      return self.tokens[start : start + count]
    return np.take(self.tokens, np.arange(start, start + count), mode='wrap')


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one process cuts rows from a token stream and formats them.

  Attributes:
    family: 'causal_lm' or 'bidirectional_lm' (BERT-masked rows).
    length: T, the tokens of a row.
    separator: the document separator; `pack` starts a segment at each.
    pack: each document gets its own segment (attention stays inside it) and positions.
    vocab_size: every id is checked to lie below it (MLM draws random tokens below it).
    process, process_count: this process reads rows [p*B/P, (p+1)*B/P) of a global batch of B.
    mlm_prob, mask_id, special: MLM: the share of tokens masked, the mask id, ids never masked.
  """

  family: str
  length: int
  separator: int
  pack: bool
  vocab_size: int
  process: int = 0
  process_count: int = 1
  mlm_prob: float = 0.15
  mask_id: int = MASK_ID
  special: tuple[int, ...] = ()

  @property
  def span(self) -> int:
    """Tokens read for one row: a causal LM's targets run one past its inputs."""
    return self.length + 1 if self.family == 'causal_lm' else self.length


def _segments(inputs: np.ndarray, separator: int) -> tuple[np.ndarray, np.ndarray]:
  """Segment ids (1, 2, ... per document) and positions (0 at each document start) of [B, T]
  rows; a document starts at its separator token, and the first token of a row starts one."""
  column = np.arange(inputs.shape[1])
  starts = inputs == separator  # [B, T]
  starts[:, 0] = True
  segments = np.cumsum(starts, axis=1).astype(np.int32)  # [B, T]
  last_start = np.maximum.accumulate(np.where(starts, column, 0), axis=1)
  return segments, (column - last_start).astype(np.int32)


def rows(stream, starts: np.ndarray, layout: Layout, real=None) -> dict[str, np.ndarray]:
  """One unmasked batch whose row i reads the stream from token starts[i] ([len(starts), T]).

  Rows where `real` (bool [len(starts)]) is False, eval rows past the end of the split, are all
  padding, weight 0.
  """
  count, length = len(starts), layout.length
  windows = np.zeros([count, layout.span], np.int32)  # [B, span]
  real = np.ones(count, bool) if real is None else np.asarray(real, bool)
  for i in range(count):
    if real[i]:
      windows[i] = stream.read(int(starts[i]), layout.span)
  inputs = windows[:, :length]  # [B, T]
  if layout.pack:
    segments, positions = _segments(inputs, layout.separator)
  else:
    segments = np.ones_like(inputs)
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), inputs.shape).copy()
  segments[~real], positions[~real] = 0, 0
  weights = np.broadcast_to(real[:, None], inputs.shape).astype(np.float32)
  if layout.family == 'causal_lm':
    return {
      'inputs': inputs,
      'targets': windows[:, 1:],
      'weights': weights,
      'segments': segments,
      'positions': positions,
    }
  inputs = np.where(real[:, None], inputs, PAD_ID)
  return {
    'inputs': inputs.copy(),
    'targets': inputs.copy(),
    'token_types': np.zeros_like(inputs),
    'weights': np.zeros_like(weights),  # set by `mask_rows`
    'segments': segments,
    'positions': positions,
  }


def row_starts(
  tokens: int, span: int, length: int, first: int, count: int, global_rows: int, seed: int,
  sampling: str,
) -> np.ndarray:  # fmt: skip
  """Token offsets of global training rows first .. first + count - 1 (int64 [count]).

  'sequential': row r starts at r * length. 'random': the rows of global batch b start at
  offsets drawn uniformly from [0, tokens - span] by `default_rng([seed, b])` (all B of them, so
  each process takes its slice of the same draw: the rows do not depend on the process count).
  """
  if sampling == 'sequential':
    return np.arange(first, first + count, dtype=np.int64) * length
  out = np.empty(count, np.int64)
  done = 0
  while done < count:
    row = first + done
    batch, within = divmod(row, global_rows)
    drawn = np.random.default_rng([seed, batch]).integers(0, max(tokens - span, 0) + 1, global_rows)
    n = min(count - done, global_rows - within)
    out[done : done + n] = drawn[within : within + n]
    done += n
  return out


def mask_rows(batch: dict, first: int, seed: int, layout: Layout) -> dict:
  """BERT-masks each real row of an MLM batch with its own generator, seeded by its global row
  number (so masks do not depend on the number of processes); weights are 1 where a token is to
  be predicted. Any other family's batch is returned as it is."""
  if layout.family != 'bidirectional_lm':
    return batch
  for i in range(len(batch['inputs'])):
    if not batch['segments'][i, 0]:
      continue  # a padding row
    rng = np.random.default_rng([seed, first + i])
    inputs, _, weights = masking.mlm_mask(
      rng,
      batch['targets'][i : i + 1],  # [1, T]
      mask_id=layout.mask_id,
      vocab_size=layout.vocab_size,
      special_ids=layout.special,
      mask_prob=layout.mlm_prob,
    )
    batch['inputs'][i], batch['weights'][i] = inputs[0], weights[0]
  return batch


class StreamIterator(batching.Resumable):
  """Infinite, resumable training batches of one process, read from a token stream.

  The state is {'row': global rows consumed, 'tokens': the split's size, 'sampling'}: the same on
  every process, so a run resumes exactly also with another number of processes.
  """

  RESUME = 'resume with the same corpus (data.train_path) and data.sampling'

  def __init__(self, stream, layout: Layout, global_rows: int, seed: int, sampling='sequential'):
    if sampling not in SAMPLINGS:
      raise ValueError(f'data.sampling={sampling!r} is not valid; choose one of {SAMPLINGS}')
    self.stream, self.layout, self.global_rows = stream, layout, global_rows
    self.seed, self.sampling = seed, sampling
    self.rows = global_rows // layout.process_count
    self.offset = layout.process * self.rows
    self.row = 0

  def _progress(self) -> dict:
    return {'row': self.row, 'global': True}  # global: one position for every process

  def _identity(self) -> dict:
    # States written before data.sampling existed were sequential.
    tokens = ('tokens', len(self.stream), None)  # the training split's size
    return {'tokens': tokens, 'sampling': ('data.sampling', self.sampling, 'sequential')}

  def _restore(self, state: dict) -> None:
    self.row = int(state['row'])

  def __next__(self) -> dict[str, np.ndarray]:
    first, layout = self.row + self.offset, self.layout
    starts = row_starts(
      len(self.stream), layout.span, layout.length, first, self.rows, self.global_rows, self.seed,
      self.sampling,
    )  # fmt: skip
    batch = mask_rows(rows(self.stream, starts, layout), first, self.seed, layout)
    where = f'training rows {first}..{first + self.rows - 1} of the shards'
    batching.check_token_ids(batch, layout.vocab_size, where)
    self.row += self.global_rows
    return batch


def eval_rows(tokens: int, length: int, family: str) -> int:
  """Rows of an eval split: non-overlapping windows r*T that fit without wrapping (at least 1)."""
  span = length + 1 if family == 'causal_lm' else length
  return max(1, (tokens - span) // length + 1)


def num_eval_batches(tokens: int, length: int, family: str, global_rows: int, wanted: int) -> int:
  """Global eval batches for data.eval_batches=`wanted`: 0 = the whole split, -1 = the whole split
  up to AUTO_EVAL_TOKENS tokens, else its first AUTO_EVAL_BATCHES batches; n = at most n."""
  available = -(-eval_rows(tokens, length, family) // global_rows)
  if wanted == -1:
    wanted = 0 if tokens <= AUTO_EVAL_TOKENS else AUTO_EVAL_BATCHES
  return min(wanted, available) if wanted else available


def eval_batches(
  stream, layout: Layout, global_rows: int, num_batches: int, spread: bool = False
) -> list[dict]:
  """Global eval batches of a split, this process's rows of each (the same count on every
  process): rows r*T in order, once; rows past the end of the split are padding. `num_batches`
  as data.eval_batches (`num_eval_batches`). `spread` takes the rows at evenly spaced windows of
  the whole split instead of its first ones (a sample of the training split)."""
  length, family = layout.length, layout.family
  limit = eval_rows(len(stream), length, family)
  num_batches = num_eval_batches(len(stream), length, family, global_rows, num_batches)
  per = global_rows // layout.process_count
  picked = np.arange(limit, dtype=np.int64)
  if spread and num_batches * global_rows < limit:
    picked = np.linspace(0, limit - 1, num_batches * global_rows).round().astype(np.int64)
  out = []
  for b in range(num_batches):
    first = b * global_rows + layout.process * per
    index = np.arange(first, first + per)
    real = index < len(picked)
    starts = np.where(real, picked[np.minimum(index, len(picked) - 1)], 0) * length
    batch = mask_rows(rows(stream, starts, layout, real=real), first, _EVAL_MASK_SEED, layout)
    batching.check_token_ids(batch, layout.vocab_size, f'eval rows {first}..{first + per - 1}')
    out.append(batch)
  return out


@dataclasses.dataclass(frozen=True)
class StreamSource:
  """The tokens of a streamed task: a training and an eval stream, cut into rows by `layout`.

  `documents`: the eval examples are the eval split's documents (a corpus), else its rows (a
  running text, whose documents are whole files).
  """

  train: TokenStream | ArrayStream
  evaluation: TokenStream | ArrayStream
  layout: Layout
  batch_size: int  # global rows of a training batch
  eval_batch_size: int  # global rows of an eval batch
  num_eval_batches: int  # data.eval_batches
  seed: int
  sampling: str
  documents: bool

  def train_iterator(self) -> StreamIterator:
    return StreamIterator(self.train, self.layout, self.batch_size, self.seed, self.sampling)

  def eval_batches(self) -> list[dict[str, np.ndarray]]:
    return eval_batches(self.evaluation, self.layout, self.eval_batch_size, self.num_eval_batches)

  def train_eval_batches(self, count: int) -> list[dict[str, np.ndarray]]:
    """`count` eval batches of training rows at evenly spaced windows of the training split."""
    return eval_batches(self.train, self.layout, self.eval_batch_size, count, spread=True)

  def eval_documents(self, n: int, tokenizer: Tokenizer) -> list[str | tuple[str, str]]:
    """The first n eval documents of this process, decoded; for a running text, n eval rows as
    (first half, second half). None for token-id shards read without their tokenizer."""
    if tokenizer.kind == 'ids' or not n:
      return []
    if not self.documents:
      return self._row_halves(n, tokenizer)
    process, count = self.layout.process, self.layout.process_count
    separator, tokens, start, total = self.layout.separator, [], 0, len(self.evaluation)
    while start < total:  # read on until n documents of this process are whole
      tokens.append(self.evaluation.read(start, min(_EXAMPLE_CHUNK, total - start)))
      start += len(tokens[-1])
      if np.count_nonzero(np.concatenate(tokens) == separator) > (n + 1) * count:
        break
    tokens = np.concatenate(tokens)
    docs = np.split(tokens, np.flatnonzero(tokens == separator))
    docs = [d[1:] for d in docs if len(d) > 1][process::count][:n]
    return [tokenizer.decode(d.tolist()) for d in docs]

  def _row_halves(self, n: int, tokenizer: Tokenizer) -> list[tuple[str, str]]:
    length, process = self.layout.length, self.layout.process
    available = eval_rows(len(self.evaluation), length, self.layout.family)
    out = []
    for r in range(process * min(n, available), (process + 1) * min(n, available)):
      tokens = self.evaluation.read(r % available * length, length).tolist()
      out.append((tokenizer.decode(tokens[: length // 2]), tokenizer.decode(tokens[length // 2 :])))
    return out
