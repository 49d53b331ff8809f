"""The built-in `recall` LM task: multi-query associative recall (Zoology, Arora et al. 2023).

An example lists key-value pairs, then filler, then queries: keys seen earlier, each followed by
its value. Predicting a queried value needs the pair, `recall_gap` tokens back or more, so a
model that sees only a local window cannot answer; `grammar` needs only the previous token.
"""

from __future__ import annotations

import string

import ml_collections
import numpy as np

KEYS = string.ascii_lowercase  # 26 keys, one byte (one byte-tokenizer token) each
VALUES = string.ascii_uppercase  # 26 values: guessing scores 1/26
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


def check(pairs: int, gap: int, queries: int) -> None:
  """One ValueError naming the first bad knob and what is valid."""
  for name, value, low, high in (
    ('recall_pairs', pairs, 1, len(KEYS)),
    ('recall_queries', queries, 1, pairs),
    ('recall_gap', gap, 0, None),
  ):
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
      raise ValueError(f'{name}={value!r} must be an integer >= {low}')
    if high is not None and value > high:
      raise ValueError(f'{name}={value} must be <= {high} (keys are distinct: at most {high})')


def sample(
  rng: np.random.Generator,
  count: int,
  pairs: int,
  gap: int,
  queries: int,
  order: str = 'random',
  filler: str = 'random',
) -> list[str]:
  """`count` examples: 'aQkZ...' + `gap` digits + 'kZ...' (queried keys with their values).

  order='random' asks `queries` of the pairs in a random order (Zoology's MQAR); 'pairs' asks the
  first `queries` in their own order, so every answer lies exactly 2 * pairs + gap tokens back.
  """
  check(pairs, gap, queries)
  if order not in ORDERS:
    raise ValueError(f'recall_order={order!r} is not valid; choose one of {ORDERS}')
  if filler not in FILLERS:
    raise ValueError(f'recall_filler={filler!r} is not valid; choose one of {FILLERS}')
  keys = np.argsort(rng.random((count, len(KEYS))), axis=1)[:, :pairs]  # distinct per example
  values = rng.integers(0, len(VALUES), (count, pairs))
  digits = rng.integers(0, len(FILLER), (count, gap)) * (filler == 'random')  # 'constant': 0s
  asked = np.argsort(rng.random((count, pairs)), axis=1)[:, :queries]  # which pairs, in order
  if order == 'pairs':
    asked = np.broadcast_to(np.arange(queries), (count, queries))
  out = []
  for k, v, f, a in zip(keys, values, digits, asked):
    text = ''.join(KEYS[i] + VALUES[j] for i, j in zip(k, v))
    text += ''.join(FILLER[i] for i in f)
    out.append(text + ''.join(KEYS[k[i]] + VALUES[v[i]] for i in a))
  return out


def answers(text: str, pairs: int, gap: int) -> list[tuple[int, str]]:
  """(character offset, value) of each answer in an example, read back from its own pairs."""
  table = {text[i]: text[i + 1] for i in range(0, 2 * pairs, 2)}
  start = layout(pairs, gap, 0)['query_start']
  return [(i + 1, table[text[i]]) for i in range(start, len(text) - 1, 2)]


def generate(cfg: ml_collections.ConfigDict) -> tuple[list[str], list[str], dict]:
  """Train examples, eval examples and info for the `recall` task (knobs `recall_*` in cfg).

  The two splits come from separate random streams of `cfg.recall_seed`.
  """
  knobs = int(cfg.recall_pairs), int(cfg.recall_gap), int(cfg.recall_queries)
  seed = int(cfg.recall_seed)
  loss = cfg.recall_loss
  if loss not in LOSSES:
    raise ValueError(f'recall_loss={loss!r} is not valid; choose one of {LOSSES}')
  style = str(cfg.recall_order), str(cfg.recall_filler)
  train = sample(np.random.default_rng([seed, 1]), cfg.num_train_examples, *knobs, *style)
  evaluation = sample(np.random.default_rng([seed, 2]), cfg.num_eval_examples, *knobs, *style)
  return train, evaluation, {'recall_chance': 1.0 / len(VALUES), **layout(*knobs)}
