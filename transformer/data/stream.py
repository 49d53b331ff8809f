"""Batches streamed from token shards: documents run on, separated, and are cut into rows.

The shards of a split are one token sequence, read through memory maps (host memory and start-up
do not grow with the corpus). Row r of a causal LM is tokens [r*T, r*T + T] (inputs and targets
one apart), of an MLM tokens [r*T, r*T + T): every token is a target once per epoch, none is
dropped, and epochs run on without a seam (positions wrap around the end of the split).
Global batch b is rows [b*B, (b+1)*B); process p of P reads rows b*B + p*B/P onwards, B/P of them,
so the data position is one global row count: it resumes under any number of processes.
"""

from __future__ import annotations

import numpy as np

from transformer.data import batching, masking, shards
from transformer.data.tokenizers import MASK_ID, PAD_ID

_EVAL_MASK_SEED = 7  # eval masks are the same for every run seed, so eval losses compare


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
  stream: TokenStream,
  first: int,
  count: int,
  length: int,
  family: str,
  separator: int,
  pack: bool,
  limit: int | None = None,
) -> dict[str, np.ndarray]:
  """Rows first .. first + count - 1 of the stream as one batch of `family` ([count, length]).

  Rows at or past `limit` (eval: the end of the split, no wrapping) are all padding, weight 0.
  `pack` gives each document its own segment (attention stays inside it) and positions.
  """
  span = length + 1 if family == 'causal_lm' else length  # tokens read per row
  windows = np.zeros([count, span], np.int32)  # [B, span]
  real = np.ones(count, bool)
  for i in range(count):
    row = first + i
    if limit is not None and row >= limit:
      real[i] = False
      continue
    windows[i] = stream.read(row * length, span)
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
  ):
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
    return {'row': self.row, 'tokens': len(self.stream), 'global': True}

  def set_state(self, state: dict) -> None:
    if state.get('tokens') != len(self.stream):
      raise ValueError(
        f'data state is for a training split of {state.get("tokens")} tokens but these shards '
        f'hold {len(self.stream)}; resume with the same corpus (data.train_path)'
      )
    self.row = int(state['row'])

  def __next__(self) -> dict[str, np.ndarray]:
    first = self.row + self.offset
    batch = rows(self.stream, first, self.rows, self.length, self.family, self.separator, self.pack)
    if self.family == 'bidirectional_lm':
      mask_rows(batch, first, self.seed, self.vocab_size, self.special, self.mlm_prob, self.mask_id)
    batching.check_token_ids(
      batch, self.vocab_size, f'training rows {first}..{first + self.rows - 1} of the shards'
    )
    self.row += self.global_rows
    return batch


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
) -> list[dict]:
  """The first `num_batches` global batches of the eval split (0 = all of it), this process's
  rows of each; rows past the end of the split are padding. The same count on every process."""
  span = length + 1 if family == 'causal_lm' else length
  limit = max(1, (len(stream) - span) // length + 1)  # rows that fit without wrapping
  available = -(-limit // global_rows)
  num_batches = min(num_batches, available) if num_batches else available
  per = global_rows // process_count
  out = []
  for b in range(num_batches):
    first = b * global_rows + process * per
    batch = rows(stream, first, per, length, family, separator, pack, limit=limit)
    if family == 'bidirectional_lm':
      mask_rows(batch, first, _EVAL_MASK_SEED, vocab_size, special, mlm_prob, mask_id)
    batching.check_token_ids(batch, vocab_size, f'eval rows {first}..{first + per - 1}')
    out.append(batch)
  return out
