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

import numpy as np

from transformer.config.experiment import SAMPLINGS
from transformer.data import batching, masking, shards
from transformer.data.tokenizers import MASK_ID, PAD_ID

_EVAL_MASK_SEED = 7  # eval masks are the same for every run seed, so eval losses compare
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


def _segments(inputs: np.ndarray, separator: int) -> tuple[np.ndarray, np.ndarray]:
  """Segment ids (1, 2, ... per document) and positions (0 at each document start) of [B, T]
  rows; a document starts at its separator token, and the first token of a row starts one."""
  column = np.arange(inputs.shape[1])
  starts = inputs == separator  # [B, T]
  starts[:, 0] = True
  segments = np.cumsum(starts, axis=1).astype(np.int32)  # [B, T]
  last_start = np.maximum.accumulate(np.where(starts, column, 0), axis=1)
  return segments, (column - last_start).astype(np.int32)


def rows(
  stream: TokenStream | ArrayStream,
  starts: np.ndarray,
  length: int,
  family: str,
  separator: int,
  pack: bool,
  real: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
  """One batch of `family` whose row i reads the stream from token starts[i] ([len(starts), T]).

  Rows where `real` is False (eval: past the end of the split) are all padding, weight 0.
  `pack` gives each document its own segment (attention stays inside it) and positions.
  """
  count = len(starts)
  span = length + 1 if family == 'causal_lm' else length  # tokens read per row
  windows = np.zeros([count, span], np.int32)  # [B, span]
  real = np.ones(count, bool) if real is None else np.asarray(real, bool)
  for i in range(count):
    if real[i]:
      windows[i] = stream.read(int(starts[i]), span)
  inputs = windows[:, :length]  # [B, T]
  if pack:
    segments, positions = _segments(inputs, separator)
  else:
    segments = np.ones_like(inputs)
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), inputs.shape).copy()
  segments[~real], positions[~real] = 0, 0
  weights = np.broadcast_to(real[:, None], inputs.shape).astype(np.float32)
  if family == 'causal_lm':
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
  if sampling != 'random':
    raise ValueError(f'data.sampling={sampling!r} is not valid; choose one of {SAMPLINGS}')
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


def mask_rows(
  batch: dict,
  first: int,
  seed: int,
  vocab_size: int,
  special: tuple,
  prob: float,
  mask_id: int = MASK_ID,
):
  """BERT-masks each real row with its own generator, seeded by its global row number (so masks
  do not depend on the number of processes); weights are 1 where a token is to be predicted."""
  for i in range(len(batch['inputs'])):
    if not batch['segments'][i, 0]:
      continue  # a padding row
    rng = np.random.default_rng([seed, first + i])
    inputs, _, weights = masking.mlm_mask(
      rng,
      batch['targets'][i : i + 1],  # [1, T]
      mask_id=mask_id,
      vocab_size=vocab_size,
      special_ids=special,
      mask_prob=prob,
    )
    batch['inputs'][i], batch['weights'][i] = inputs[0], weights[0]
  return batch


class StreamIterator:
  """Infinite, resumable training batches of one process, read from a TokenStream.

  The state is {'row': global rows consumed, 'tokens': the split's size}: the same on every
  process, so a run resumes exactly also with another number of processes.
  """

  def __init__(
    self,
    stream,
    *,
    family,
    length,
    global_rows,
    process,
    process_count,
    separator,
    pack,
    vocab_size,
    seed,
    mlm_prob=0.15,
    special=(),
    mask_id=MASK_ID,
    sampling='sequential',
  ):
    if sampling not in SAMPLINGS:
      raise ValueError(f'data.sampling={sampling!r} is not valid; choose one of {SAMPLINGS}')
    self.sampling = sampling
    self.stream, self.family, self.length = stream, family, length
    self.global_rows, self.separator, self.pack = global_rows, separator, pack
    self.rows = global_rows // process_count
    self.offset = process * self.rows
    self.vocab_size, self.seed, self.mlm_prob, self.special = vocab_size, seed, mlm_prob, special
    self.mask_id = mask_id
    self.row = 0

  def __iter__(self) -> StreamIterator:
    return self

  def get_state(self) -> dict:
    return {'row': self.row, 'tokens': len(self.stream), 'global': True, 'sampling': self.sampling}

  def set_state(self, state: dict) -> None:
    if state.get('tokens') != len(self.stream):
      raise ValueError(
        f'data state is for a training split of {state.get("tokens")} tokens but these shards '
        f'hold {len(self.stream)}; resume with the same corpus (data.train_path)'
      )
    if state.get('sampling', 'sequential') != self.sampling:
      raise ValueError(
        f'data state is for data.sampling={state.get("sampling", "sequential")!r} but this run '
        f'has {self.sampling!r}; resume with the same data.sampling'
      )
    self.row = int(state['row'])

  def __next__(self) -> dict[str, np.ndarray]:
    first = self.row + self.offset
    span = self.length + 1 if self.family == 'causal_lm' else self.length
    starts = row_starts(
      len(self.stream), span, self.length, first, self.rows, self.global_rows, self.seed,
      self.sampling,
    )  # fmt: skip
    batch = rows(self.stream, starts, self.length, self.family, self.separator, self.pack)
    if self.family == 'bidirectional_lm':
      mask_rows(batch, first, self.seed, self.vocab_size, self.special, self.mlm_prob, self.mask_id)
    batching.check_token_ids(
      batch, self.vocab_size, f'training rows {first}..{first + self.rows - 1} of the shards'
    )
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
  stream,
  *,
  family,
  length,
  global_rows,
  process,
  process_count,
  separator,
  pack,
  vocab_size,
  num_batches,
  special=(),
  mlm_prob=0.15,
  mask_id=MASK_ID,
  spread=False,
) -> list[dict]:
  """Global eval batches of a split, this process's rows of each (the same count on every
  process): rows r*T in order, once; rows past the end of the split are padding. `num_batches`
  as data.eval_batches (`num_eval_batches`). `spread` takes the rows at evenly spaced windows of
  the whole split instead of its first ones (a sample of the training split)."""
  limit = eval_rows(len(stream), length, family)
  num_batches = num_eval_batches(len(stream), length, family, global_rows, num_batches)
  per = global_rows // process_count
  picked = np.arange(limit, dtype=np.int64)
  if spread and num_batches * global_rows < limit:
    picked = np.linspace(0, limit - 1, num_batches * global_rows).round().astype(np.int64)
  out = []
  for b in range(num_batches):
    first = b * global_rows + process * per
    index = np.arange(first, first + per)
    real = index < len(picked)
    starts = np.where(real, picked[np.minimum(index, len(picked) - 1)], 0) * length
    batch = rows(stream, starts, length, family, separator, pack, real=real)
    if family == 'bidirectional_lm':
      mask_rows(batch, first, _EVAL_MASK_SEED, vocab_size, special, mlm_prob, mask_id)
    batching.check_token_ids(batch, vocab_size, f'eval rows {first}..{first + per - 1}')
    out.append(batch)
  return out
