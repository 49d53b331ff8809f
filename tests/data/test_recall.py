"""Tests of the generated `recall` task (multi-query associative recall)."""

import re

import numpy as np
import pytest

from transformer import data
from transformer.config.experiment import DataConfig, section
from transformer.data import recall


def _cfg(**overrides):
  cfg = data.default_config()
  cfg.task, cfg.tokenizer = 'recall', 'byte'
  cfg.num_train_examples, cfg.num_eval_examples = 200, 50
  cfg.recall_pairs, cfg.recall_gap, cfg.recall_queries = 11, 37, 5
  cfg.update(overrides)
  return cfg


@pytest.mark.parametrize('pairs, gap, queries', [(11, 37, 5), (26, 0, 26), (1, 3, 1)])
def test_examples_are_pairs_filler_and_queries_with_the_right_answers(pairs, gap, queries):
  examples = recall.sample(np.random.default_rng(0), 300, pairs, gap, queries)
  pattern = re.compile(rf'((?:[a-z][A-Z]){{{pairs}}})([0-9]{{{gap}}})((?:[a-z][A-Z]){{{queries}}})')
  for text in examples:
    match = pattern.fullmatch(text)
    assert match, text
    keys, values = match.group(1)[::2], match.group(1)[1::2]
    assert len(set(keys)) == pairs  # distinct keys
    asked = match.group(3)
    assert len(set(asked[::2])) == queries and set(asked[::2]) <= set(keys)
    for key, value in zip(asked[::2], asked[1::2]):
      assert value == values[keys.index(key)]
    # `answers` gives each answer's offset and value, and its pair lies >= gap + 2 tokens back.
    got = recall.answers(text, pairs, gap)
    assert [text[i] for i, _ in got] == [v for _, v in got] == list(asked[1::2])
    for offset, _ in got:  # query key at offset - 1, its pair's key where it first occurs
      assert (offset - 1) - text.index(text[offset - 1]) >= gap + 2


def test_many_answers_lie_beyond_a_window():
  pairs, gap = 16, 64
  examples = recall.sample(np.random.default_rng(1), 200, pairs, gap, 8)
  distances = [
    offset - text.index(text[offset - 1]) - 1 for text in examples
    for offset, _ in recall.answers(text, pairs, gap)
  ]  # fmt: skip
  assert min(distances) >= gap + 2
  assert np.mean(np.array(distances) > 80) > 0.5  # most answers lie beyond 80 tokens


def test_pairs_order_asks_the_first_pairs_in_order_a_fixed_distance_back():
  pairs, gap, queries = 7, 9, 5
  for text in recall.sample(np.random.default_rng(3), 50, pairs, gap, queries, order='pairs'):
    start = 2 * pairs + gap
    assert text[start:] == text[: 2 * queries]
    assert recall.answers(text, pairs, gap) == [
      (start + 2 * j + 1, text[2 * j + 1]) for j in range(5)
    ]


def test_constant_filler_is_zeros_and_the_rest_is_as_with_random_filler():
  constant = recall.sample(np.random.default_rng(4), 20, 6, 11, 6, filler='constant')
  noisy = recall.sample(np.random.default_rng(4), 20, 6, 11, 6)
  for a, b in zip(constant, noisy):
    assert a[12:23] == '0' * 11 and a[:12] == b[:12] and a[23:] == b[23:]
    assert b[12:23] != '0' * 11


def test_values_and_queries_are_uniform():
  examples = recall.sample(np.random.default_rng(2), 2000, 8, 0, 4)
  values = np.array([ord(c) - ord('A') for text in examples for c in text[1:16:2]])
  counts = np.bincount(values, minlength=26)
  assert counts.min() > 0.6 * counts.mean()  # 16000 draws of 26 values
  first_asked = [text[:16:2].index(text[16]) for text in examples]  # which pair is asked first
  assert np.bincount(first_asked, minlength=8).min() > 0.7 * 250


def test_task_builds_deterministic_disjoint_splits_with_byte_tokens():
  task = data.build(section(DataConfig, _cfg()), family='causal_lm', workdir=None, seed=0)
  again = data.build(section(DataConfig, _cfg()), family='causal_lm', workdir=None, seed=0)
  assert task.info['length'] == 2 * 11 + 37 + 2 * 5
  assert task.info['query_start'] == 2 * 11 + 37
  assert task.info['recall_chance'] == pytest.approx(1 / 26)
  batch, batch2 = task.eval_batches()[0], again.eval_batches()[0]
  np.testing.assert_array_equal(batch['targets'], batch2['targets'])
  train, evaluation, _ = recall.generate(_cfg())
  assert not set(train) & set(evaluation)
  # One token per character: the targets of a row spell its example, then eos.
  row = batch['targets'][0]
  text = task.tokenizer.decode([int(t) for t in row if t > 0][:-1])
  assert text == evaluation[0]
  other = recall.generate(_cfg(recall_seed=1))[1]
  assert other[0] != evaluation[0]


@pytest.mark.parametrize(
  'overrides, message',
  [
    (dict(recall_pairs=27), 'recall_pairs=27 must be <= 26'),
    (dict(recall_queries=12), 'recall_queries=12 must be <= 11'),
    (dict(recall_gap=-1), 'recall_gap=-1 must be an integer >= 0'),
    (dict(recall_queries=0), 'recall_queries=0 must be an integer >= 1'),
    (dict(recall_order='sorted'), "recall_order='sorted' is not valid; choose one of"),
    (dict(recall_filler='dots'), "recall_filler='dots' is not valid; choose one of"),
    (dict(recall_loss='keys'), "recall_loss='keys' is not valid; choose one of"),
    (dict(recall_vocab=25), r'recall_vocab=25 must be an integer in \[26, 10496\]'),
    (dict(recall_vocab=512), "recall_vocab=512 draws keys .* only with data.tokenizer='char'"),
    (dict(recall_vocab=512, tokenizer='char', recall_pairs=513), 'recall_pairs=513 must be <= 512'),
  ],
)
def test_bad_knobs(overrides, message):
  with pytest.raises(ValueError, match=message):
    recall.generate(_cfg(**overrides))


@pytest.mark.parametrize('pack', [False, True])
def test_answers_loss_weighs_exactly_the_answers(pack):
  """recall_loss='answers': weight 1 on each queried value and 0 elsewhere (keys, pairs, filler,
  eos, padding), in eval and in training batches, packed or not."""
  cfg = _cfg(recall_loss='answers', pack=pack, max_length=160, batch_size=4)  # 2 fit a row
  task = data.build(section(DataConfig, cfg), family='causal_lm', workdir=None, seed=0)
  batches = [task.eval_batches()[0], next(task.train_iterator())]
  examples_per_row = []
  for batch in batches:
    for row in range(len(batch['targets'])):
      ids, weights, seg = batch['targets'][row], batch['weights'][row], batch['segments'][row]
      # each example (segment) in the row: its answers, read back from its own text
      bounds = [0] + [t for t in range(1, len(seg)) if seg[t] != seg[t - 1]] + [len(seg)]
      examples_per_row.append(len(set(seg[seg > 0])))
      expected = np.zeros_like(weights)
      for lo, hi in zip(bounds[:-1], bounds[1:]):
        tokens = [int(t) for t in ids[lo:hi] if t > 0]
        if not tokens:
          continue
        text = task.tokenizer.decode(tokens[:-1])
        for offset, value in recall.answers(text, 11, 37):
          assert task.tokenizer.decode([int(ids[lo + offset])]) == value
          expected[lo + offset] = 1.0
      np.testing.assert_array_equal(weights, expected)
      assert weights.sum() == 5 * examples_per_row[-1]
  assert max(examples_per_row) == (2 if pack else 1)
  # 'all' weighs every real token
  full = data.build(
    section(DataConfig, _cfg()), family='causal_lm', workdir=None, seed=0
  ).eval_batches()[0]
  np.testing.assert_array_equal(full['weights'], (full['targets'] > 0).astype(np.float32))


@pytest.mark.parametrize(
  'overrides, family, message',
  [
    (
      dict(tokenizer='sentencepiece'),
      'causal_lm',
      "needs one token per character: data.tokenizer='byte' or 'char'",
    ),
    ({}, 'bidirectional_lm', "family='bidirectional_lm' is not one"),
  ],
)
def test_answers_loss_needs_a_causal_lm_with_one_token_per_character(overrides, family, message):
  with pytest.raises(ValueError, match=message):
    data.build(
      section(DataConfig, _cfg(recall_loss='answers', **overrides)),
      family=family,
      workdir=None,
      seed=0,
    )


# A large vocabulary (recall_vocab), a queried subset, per-seed data and disjoint splits --------
def _large(**overrides):
  knobs = dict(tokenizer='char', recall_vocab=512, recall_pairs=16, recall_gap=4)
  return _cfg(**{**knobs, 'recall_queries': 4, 'recall_filler': 'constant', **overrides})


def test_large_vocabulary_examples_ask_a_random_subset_with_the_right_answers():
  keys, values = recall.alphabets(512)
  assert len(set(keys)) == len(set(values)) == 512 and not set(keys) & set(values)
  assert recall.alphabets(26) == (recall.KEYS, recall.VALUES)
  examples = recall.sample(np.random.default_rng(0), 2000, 16, 4, 4, 'random', 'constant', 512)
  asked_pairs = []
  for text in examples:
    assert len(text) == 2 * 16 + 4 + 2 * 4
    pairs, asked = text[:32], text[36:]
    assert set(pairs[::2]) <= set(keys) and set(pairs[1::2]) <= set(values)
    assert len(set(pairs[::2])) == len(set(pairs[1::2])) == 16  # distinct keys, distinct values
    assert text[32:36] == '0000'
    table = dict(zip(pairs[::2], pairs[1::2]))
    assert len(set(asked[::2])) == 4 and all(table[k] == v for k, v in zip(asked[::2], asked[1::2]))
    asked_pairs += [pairs[::2].index(k) for k in asked[::2]]
  # which 4 of the 16 pairs are asked is uniform: 8000 draws, 500 expected per pair
  assert np.bincount(asked_pairs, minlength=16).min() > 400
  drawn = [c for text in examples for c in text[:32]]
  assert len(set(drawn) & set(keys)) > 500 * 0.99 and len(set(drawn) & set(values)) > 500 * 0.99


def test_large_vocabulary_task_has_one_char_token_per_key_and_value():
  cfg = _large(recall_loss='answers', max_length=64)
  task = data.build(section(DataConfig, cfg), family='causal_lm', workdir=None, seed=0)
  assert task.info['recall_chance'] == pytest.approx(1 / 512)
  _, evaluation, _ = recall.generate(cfg)
  batch = task.eval_batches()[0]
  row = [int(t) for t in batch['targets'][0] if t > 0]
  assert len(row) == len(evaluation[0]) + 1  # one token per character, then eos
  assert task.tokenizer.decode(row[:-1]) == evaluation[0]
  assert max(row) < task.tokenizer.vocab_size
  weighted = np.flatnonzero(batch['weights'][0])
  assert [o for o, _ in recall.answers(evaluation[0], 16, 4)] == weighted.tolist()


def test_data_seed_follows_the_run_seed_when_recall_seed_is_none():
  cfg = _large(recall_seed=None)
  runs = [recall.generate(cfg, seed) for seed in (0, 1, 0)]
  assert runs[0][0] == runs[2][0] and runs[0][1] == runs[2][1]  # deterministic per seed
  assert not set(runs[0][0]) & set(runs[1][0]) and runs[0][1] != runs[1][1]
  fixed = _large(recall_seed=3)
  assert recall.generate(fixed, 0)[0] == recall.generate(fixed, 1)[0]  # a fixed data seed
  built = [
    data.build(section(DataConfig, cfg), family='causal_lm', workdir=None, seed=s) for s in (0, 1)
  ]
  first = [b.eval_batches()[0]['targets'] for b in built]
  assert not np.array_equal(first[0], first[1])


def test_disjoint_drops_the_training_examples_that_occur_in_eval():
  # 26 keys, 1 pair, no gap, one query: 676 examples in all, so the splits overlap a lot.
  knobs = dict(recall_pairs=1, recall_queries=1, recall_gap=0, num_train_examples=2000)
  train, evaluation, info = recall.generate(_cfg(**knobs))
  assert 'recall_dropped' not in info and set(train) & set(evaluation)  # the old behaviour
  kept, evaluation2, info = recall.generate(_cfg(**knobs, recall_disjoint=True))
  assert evaluation2 == evaluation and not set(kept) & set(evaluation)
  assert kept == [x for x in train if x not in set(evaluation)]
  assert info['recall_dropped'] == len(train) - len(kept) > 0


@pytest.mark.parametrize(
  'count, size, first, rows', [(300, 26, 11, 4096), (300, 26, 26, 7), (50, 512, 16, 8)]
)
def test_first_of_permutations_are_argsorts_of_the_same_draws(count, size, first, rows):
  # The chunked, partial sort keeps recall_vocab=26 generating the committed sweep's examples.
  expected = np.argsort(np.random.default_rng(9).random((count, size)), axis=1)[:, :first]
  found = recall._first_of_permutations(np.random.default_rng(9), count, size, first, rows)
  np.testing.assert_array_equal(found, expected)
