"""The built-in `recall` LM task: multi-query associative recall (Zoology, Arora et al. 2023).

An example lists key-value pairs, then filler, then queries: keys seen earlier, each followed by
its value. Predicting a queried value needs the pair, `recall_gap` tokens back or more, so a
model that sees only a local window cannot answer; `grammar` needs only the previous token.

Every key and value is one character: a-z and A-Z by default, or with `recall_vocab` > 26 that
many keys and as many values from the CJK block (one token each with data.tokenizer='char'), and
then an example's values are distinct, as its keys are (Zoology's MQAR).
"""

from __future__ import annotations

import string

import ml_collections
import numpy as np

KEYS = string.ascii_lowercase  # 26 keys, one byte (one byte-tokenizer token) each
VALUES = string.ascii_uppercase  # 26 values: guessing scores 1/26
# recall_vocab > 26: keys are the first `vocab` characters from here, values the next `vocab`.
LARGE_START = 0x4E00  # CJK Unified Ideographs: 20,992 code points, none of them a digit
MAX_VOCAB = (0x9FFF + 1 - LARGE_START) // 2
FILLER = string.digits  # the gap between the pairs and the queries: noise, never a key or value
# Query order: random (MQAR), or the pairs' own (each answer a fixed distance back).
ORDERS = ('random', 'pairs')
FILLERS = ('random', 'constant')  # filler digits drawn at random, or all '0' (nothing to predict)
# Which tokens carry loss: all of them, or only the answers (the value after each queried key), as
# Zoology trains: the pairs and the filler are noise to a model, and the keys asked next are too.
LOSSES = ('all', 'answers')


def layout(pairs: int, gap: int, queries: int) -> dict[str, int]:
  """Character offsets of an example: the pairs at [0, 2 * pairs), filler up to `query_start`,
  then query j's key at query_start + 2j and its value (the answer) at query_start + 2j + 1."""
  return {'query_start': 2 * pairs + gap, 'length': 2 * pairs + gap + 2 * queries}


def scored_positions(pairs: int, gap: int, queries: int) -> tuple[int, ...]:
  """Target positions of the answers: with a bos first, target t is character t."""
  start = layout(pairs, gap, queries)['query_start']
  return tuple(start + 2 * j + 1 for j in range(queries))


def alphabets(vocab: int = len(KEYS)) -> tuple[str, str]:
  """(keys, values): `vocab` characters each; 26 gives a-z and A-Z, more gives CJK characters."""
  if not isinstance(vocab, int) or isinstance(vocab, bool) or not len(KEYS) <= vocab <= MAX_VOCAB:
    raise ValueError(f'recall_vocab={vocab!r} must be an integer in [{len(KEYS)}, {MAX_VOCAB}]')
  if vocab == len(KEYS):
    return KEYS, VALUES
  points = range(LARGE_START, LARGE_START + 2 * vocab)
  return ''.join(map(chr, points[:vocab])), ''.join(map(chr, points[vocab:]))


def check(pairs: int, gap: int, queries: int, vocab: int = len(KEYS)) -> None:
  """One ValueError naming the first bad knob and what is valid."""
  alphabets(vocab)
  for name, value, low, high in (
    ('recall_pairs', pairs, 1, vocab),
    ('recall_queries', queries, 1, pairs),
    ('recall_gap', gap, 0, None),
  ):
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
      raise ValueError(f'{name}={value!r} must be an integer >= {low}')
    if high is not None and value > high:
      raise ValueError(f'{name}={value} must be <= {high} (keys are distinct: at most {high})')


def _first_of_permutations(
  rng: np.random.Generator, count: int, size: int, first: int, rows: int = 4096
) -> np.ndarray:
  """[count, first]: the first `first` entries of `count` random permutations of range(size),
  as `argsort(rng.random((count, size)))[:, :first]` gives them (the same draws, so the same
  examples), in chunks of rows and by partial sort: 100k rows of 8192 fit in memory."""
  out = []
  for start in range(0, count, rows):
    scores = rng.random((min(rows, count - start), size))  # the draws of one call, row by row
    if first < size:
      part = np.argpartition(scores, first - 1, axis=1)[:, :first]  # the smallest, unordered
    else:
      part = np.broadcast_to(np.arange(size), scores.shape)
    order = np.argsort(np.take_along_axis(scores, part, axis=1), axis=1)
    out.append(np.take_along_axis(part, order, axis=1))
  return np.concatenate(out) if out else np.zeros((0, first), np.int64)


def sample(
  rng: np.random.Generator,
  count: int,
  pairs: int,
  gap: int,
  queries: int,
  order: str = 'random',
  filler: str = 'random',
  vocab: int = len(KEYS),
) -> list[str]:
  """`count` examples: 'aQkZ...' + `gap` digits + 'kZ...' (queried keys with their values).

  order='random' asks `queries` of the pairs in a random order (Zoology's MQAR); 'pairs' asks the
  first `queries` in their own order, so every answer lies exactly 2 * pairs + gap tokens back.
  Keys and values come from `alphabets(vocab)`; with more than 26, an example's values are
  distinct.
  """
  check(pairs, gap, queries, vocab)
  key_chars, value_chars = alphabets(vocab)
  if order not in ORDERS:
    raise ValueError(f'recall_order={order!r} is not valid; choose one of {ORDERS}')
  if filler not in FILLERS:
    raise ValueError(f'recall_filler={filler!r} is not valid; choose one of {FILLERS}')
  keys = _first_of_permutations(rng, count, vocab, pairs)  # distinct per example
  if vocab == len(KEYS):  # values may repeat: the generator of the committed recall sweep
    values = rng.integers(0, vocab, (count, pairs))
  else:  # distinct, as Zoology draws them: a repeated value would help a guess by elimination
    values = _first_of_permutations(rng, count, vocab, pairs)
  digits = rng.integers(0, len(FILLER), (count, gap)) * (filler == 'random')  # 'constant': 0s
  asked = np.argsort(rng.random((count, pairs)), axis=1)[:, :queries]  # which pairs, in order
  if order == 'pairs':
    asked = np.broadcast_to(np.arange(queries), (count, queries))
  out = []
  for k, v, f, a in zip(keys, values, digits, asked):
    text = ''.join(key_chars[i] + value_chars[j] for i, j in zip(k, v))
    text += ''.join(FILLER[i] for i in f)
    out.append(text + ''.join(key_chars[k[i]] + value_chars[v[i]] for i in a))
  return out


def answers(text: str, pairs: int, gap: int) -> list[tuple[int, str]]:
  """(character offset, value) of each answer in an example, read back from its own pairs."""
  table = {text[i]: text[i + 1] for i in range(0, 2 * pairs, 2)}
  start = layout(pairs, gap, 0)['query_start']
  return [(i + 1, table[text[i]]) for i in range(start, len(text) - 1, 2)]


def generate(
  cfg: ml_collections.ConfigDict, run_seed: int = 0
) -> tuple[list[str], list[str], dict]:
  """Train examples, eval examples and info for the `recall` task (knobs `recall_*` in cfg).

  The two splits come from separate random streams of `cfg.recall_seed`, or of `run_seed` when
  that is None (each seed of a sweep its own examples). With `cfg.recall_disjoint`, training
  examples that also occur in the eval split are dropped (`recall_dropped` counts them).
  """
  knobs = int(cfg.recall_pairs), int(cfg.recall_gap), int(cfg.recall_queries)
  seed = int(run_seed if cfg.recall_seed is None else cfg.recall_seed)
  loss = cfg.recall_loss
  if loss not in LOSSES:
    raise ValueError(f'recall_loss={loss!r} is not valid; choose one of {LOSSES}')
  vocab = cfg.recall_vocab
  alphabets(vocab)  # a valid vocabulary first, then one the tokenizer can take
  if vocab != len(KEYS) and cfg.tokenizer != 'char':
    raise ValueError(
      f'recall_vocab={vocab} draws keys and values from CJK characters, one token each only with '
      f"data.tokenizer='char', not {cfg.tokenizer!r}; use 'char' or recall_vocab={len(KEYS)}"
    )
  style = str(cfg.recall_order), str(cfg.recall_filler), vocab
  train = sample(np.random.default_rng([seed, 1]), cfg.num_train_examples, *knobs, *style)
  evaluation = sample(np.random.default_rng([seed, 2]), cfg.num_eval_examples, *knobs, *style)
  info = {'recall_chance': 1.0 / vocab, **layout(*knobs)}
  if cfg.recall_disjoint:
    held = set(evaluation)
    kept = [x for x in train if x not in held]
    train, info['recall_dropped'] = kept, len(train) - len(kept)
  return train, evaluation, info
