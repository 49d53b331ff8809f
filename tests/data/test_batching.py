"""Tests of batch formats, packing, buckets, MLM masking, resumption, determinism and sharding."""

import collections
import json

import numpy as np
import pytest

from transformer import data
from transformer.config.experiment import DataConfig, section
from transformer.data import batching, grammar
from transformer.data import number_words as numbers

BOS, EOS, MASK = 1, 2, 3


def _cfg(**overrides):
  cfg = data.default_config()
  cfg.update(
    dict(
      num_train_examples=200,
      num_eval_examples=37,
      batch_size=8,
      eval_batch_size=8,
      max_length=96,
      max_source_length=16,
      max_target_length=64,
    )
  )
  cfg.update(overrides)
  return cfg


def _build(family='encoder_decoder', seed=0, **overrides):
  return data.build(section(DataConfig, _cfg(**overrides)), family=family, workdir=None, seed=seed)


def _segments(segment_row):
  """(id, positions) of each segment in a row; checks that segments are contiguous."""
  out = []
  for s in sorted(set(segment_row.tolist()) - {0}):
    where = np.flatnonzero(segment_row == s)
    np.testing.assert_array_equal(where, np.arange(where[0], where[-1] + 1))
    out.append((s, where))
  return out


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def _assert_padding_is_zero(batch, segment_key, keys):
  pad = batch[segment_key] == 0
  for key in keys:
    assert np.all(batch[key][pad] == 0), key


@pytest.mark.parametrize('pack', [False, True])
def test_encoder_decoder_batches(pack):
  task = _build(pack=pack)
  tok = task.tokenizer
  packed_rows = 0
  for batch in _take(task.train_iterator(), 4):
    assert set(batch) == {
      'inputs',
      'inputs_segments',
      'inputs_positions',
      'decoder_inputs',
      'targets',
      'targets_segments',
      'targets_positions',
      'weights',
    }
    for key, value in batch.items():
      assert value.dtype == (np.float32 if key == 'weights' else np.int32), key
      assert value.shape[0] == 8
    if pack:
      assert batch['inputs'].shape[1] == 16 and batch['targets'].shape[1] == 64
    _assert_padding_is_zero(batch, 'inputs_segments', ['inputs', 'inputs_positions'])
    _assert_padding_is_zero(batch, 'targets_segments', ['targets', 'decoder_inputs', 'weights'])
    for row in range(8):
      sources = _segments(batch['inputs_segments'][row])
      targets = _segments(batch['targets_segments'][row])
      assert [s for s, _ in sources] == [s for s, _ in targets] == list(range(1, len(sources) + 1))
      packed_rows += len(sources) > 1
      for (_, src), (_, tgt) in zip(sources, targets):
        np.testing.assert_array_equal(batch['inputs_positions'][row, src], np.arange(len(src)))
        np.testing.assert_array_equal(batch['targets_positions'][row, tgt], np.arange(len(tgt)))
        source, target = batch['inputs'][row, src], batch['targets'][row, tgt]
        assert source[-1] == EOS and target[-1] == EOS
        np.testing.assert_array_equal(batch['decoder_inputs'][row, tgt], [BOS, *target[:-1]])
        assert np.all(batch['weights'][row, tgt] == 1.0)
        # Segment k of the source pairs with segment k of the target.
        assert tok.decode(target) == data.numbers_to_words(int(tok.decode(source)))
  assert packed_rows > 0 if pack else packed_rows == 0


@pytest.mark.parametrize('pack', [False, True])
def test_causal_lm_batches(pack):
  task = _build('causal_lm', task='grammar', pack=pack)
  g = grammar.make_grammar(0)
  rows_with_two = 0
  for batch in _take(task.train_iterator(), 3):
    assert set(batch) == {'inputs', 'targets', 'weights', 'segments', 'positions'}
    _assert_padding_is_zero(batch, 'segments', ['inputs', 'targets', 'weights', 'positions'])
    for row in range(8):
      segments = _segments(batch['segments'][row])
      rows_with_two += len(segments) > 1
      for _, where in segments:
        inputs, targets = batch['inputs'][row, where], batch['targets'][row, where]
        np.testing.assert_array_equal(inputs, [BOS, *targets[:-1]])  # shifted by one
        assert targets[-1] == EOS and np.all(batch['weights'][row, where] == 1.0)
        np.testing.assert_array_equal(batch['positions'][row, where], np.arange(len(where)))
        text = task.tokenizer.decode(targets)
        if len(where) < 96:  # untruncated documents parse back into the grammar
          assert g.render(g.parse(text)[:-1]) == text
  assert rows_with_two > 0 if pack else rows_with_two == 0


def test_causal_lm_on_pairs_scores_only_the_target():
  task = _build('causal_lm', pack=True)
  batch = next(task.train_iterator())
  for row in range(8):
    for _, where in _segments(batch['segments'][row]):
      targets, weights = batch['targets'][row, where], batch['weights'][row, where]
      separator = int(np.flatnonzero(targets == EOS)[0])
      source, target = targets[:separator], targets[separator + 1 :]
      np.testing.assert_array_equal(weights, (np.arange(len(where)) > separator).astype(float))
      words = data.numbers_to_words(int(task.tokenizer.decode(source)))
      assert task.tokenizer.decode(target) == words


@pytest.mark.parametrize('pack', [False, True])
def test_bidirectional_lm_masking(pack):
  task = _build('bidirectional_lm', task='grammar', pack=pack)
  chosen, eligible, masked = 0, 0, 0
  for batch in _take(task.train_iterator(), 6):
    inputs, targets, weights = batch['inputs'], batch['targets'], batch['weights']
    assert np.all(batch['token_types'] == 0)
    _assert_padding_is_zero(batch, 'segments', ['inputs', 'targets', 'weights'])
    special = np.isin(targets, [0, BOS, EOS, MASK])
    assert np.all(weights[special] == 0)  # pad, bos ([CLS]) and eos ([SEP]) are never predicted
    assert np.all(inputs[weights == 0] == targets[weights == 0])  # unmasked positions are intact
    assert np.all(weights[inputs != targets] == 1)
    for row in range(8):
      for _, where in _segments(batch['segments'][row]):
        assert targets[row, where[0]] == BOS and targets[row, where[-1]] == EOS
    chosen += weights.sum()
    eligible += (~special).sum()
    masked += (inputs[weights == 1] == MASK).sum()
  assert abs(chosen / eligible - 0.15) < 0.03
  assert abs(masked / chosen - 0.8) < 0.1


def test_bidirectional_lm_pairs_have_token_types_and_masks_change_per_epoch():
  task = _build('bidirectional_lm', num_train_examples=8, batch_size=8)
  first, second = _take(task.train_iterator(), 2)  # epoch 0 and epoch 1, same 8 examples
  for row in range(8):
    targets, types = first['targets'][row], first['token_types'][row]
    separator = int(np.flatnonzero(targets == EOS)[0])
    real = first['segments'][row] > 0
    np.testing.assert_array_equal(types[real], np.arange(real.sum()) > separator)

  def by_targets(batch):
    order = np.lexsort(batch['targets'].T[::-1])
    return batch['targets'][order], batch['weights'][order]

  targets_a, weights_a = by_targets(first)
  targets_b, weights_b = by_targets(second)
  np.testing.assert_array_equal(targets_a, targets_b)
  assert not np.array_equal(weights_a, weights_b)


def test_buckets_pick_the_smallest_fitting_length():
  assert batching.bucket_lengths(100, True) == (8, 16, 32, 64, 100)
  assert batching.bucket_lengths(100, False) == (100,)
  assert batching.bucket_lengths(100, [24, 12, 200]) == (12, 24, 100)
  for buckets, allowed in ((True, (8, 16, 32, 64)), ([12, 24], (12, 24, 64)), (False, (64,))):
    task = _build(buckets=buckets)
    for batch in _take(task.train_iterator(), 5):
      length = batch['targets'].shape[1]
      longest = (batch['targets_segments'] > 0).sum(axis=1).max()
      assert length in allowed and length >= longest
      assert all(b < longest for b in allowed if b < length)


def test_eval_batches_fixed_shape_and_padded_rows():
  task = _build(max_source_length=8)
  batches = task.eval_batches()
  assert len(batches) == 5  # ceil(37 / 8)
  assert all(b['inputs'].shape == (8, 8) and b['targets'].shape == (8, 64) for b in batches)
  weights = np.concatenate([b['weights'] for b in batches])
  real_rows = weights.sum(axis=1) > 0
  np.testing.assert_array_equal(real_rows, np.arange(40) < 37)
  sources = [task.tokenizer.decode(row) for b in batches for row in b['inputs']][:37]
  assert sources == [src for src, _ in task.eval_examples(37)]
  _, evaluation, _ = numbers.generate(_cfg())
  assert task.eval_examples(37) == evaluation
  other_seed = _build(max_source_length=8, seed=5).eval_batches()
  for a, b in zip(batches, other_seed):
    np.testing.assert_array_equal(a['targets'], b['targets'])


def test_one_epoch_visits_every_example_once():
  task = _build(num_train_examples=64)
  train, _, _ = numbers.generate(_cfg(num_train_examples=64))
  batches = _take(task.train_iterator(), 8)
  seen = [task.tokenizer.decode(row) for b in batches for row in b['inputs']]
  assert collections.Counter(seen) == collections.Counter(src for src, _ in train)


@pytest.mark.parametrize(
  'family, overrides',
  [
    ('encoder_decoder', dict(pack=False)),
    ('encoder_decoder', dict(pack=True)),
    ('bidirectional_lm', dict(pack=True, task='grammar')),
    ('causal_lm', dict(pack=False, task='grammar')),
  ],
)
def test_resuming_from_state_gives_the_same_batches(family, overrides):
  overrides |= dict(num_train_examples=40)
  iterator = _build(family, seed=3, **overrides).train_iterator()
  _take(iterator, 4)
  state = json.loads(json.dumps(iterator.get_state()))
  expected = _take(iterator, 6)  # crosses at least one epoch boundary
  assert iterator.get_state()['epoch'] >= 1
  resumed = _build(family, seed=3, **overrides).train_iterator()
  resumed.set_state(state)
  for a, b in zip(expected, _take(resumed, 6)):
    assert a.keys() == b.keys()
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])


def test_same_seed_same_batches_different_seed_different_batches():
  first = _take(_build(seed=11).train_iterator(), 3)
  again = _take(_build(seed=11).train_iterator(), 3)
  other = _take(_build(seed=12).train_iterator(), 3)
  for a, b in zip(first, again):
    np.testing.assert_array_equal(a['targets'], b['targets'])
  assert any(
    a['targets'].shape != c['targets'].shape or np.any(a['targets'] != c['targets'])
    for a, c in zip(first, other)
  )


def test_set_state_rejects_a_different_dataset():
  iterator = _build(num_train_examples=40).train_iterator()
  other = _build(num_train_examples=41).train_iterator()
  with pytest.raises(ValueError, match='num_examples=40'):
    other.set_state(iterator.get_state())


def test_two_processes_read_disjoint_halves(tmp_path):
  lines = [f'document number {i} with some words' for i in range(264)]
  (tmp_path / 'train.txt').write_text('\n'.join(lines))
  overrides = dict(task='text', train_path=str(tmp_path / 'train.txt'))
  overrides['text_format'] = 'lines'
  seen = []
  eval_counts = []
  for process in range(2):
    task = data.build(
      section(DataConfig, _cfg(**overrides)),
      family='causal_lm',
      workdir=None,
      seed=0,
      process_index=process,
      process_count=2,
    )
    batches = _take(task.train_iterator(), 25)  # 200 training lines / 2 processes / 4 rows
    assert all(b['targets'].shape[0] == 4 for b in batches)
    seen.append([task.tokenizer.decode(row) for b in batches for row in b['targets']])
    eval_counts.append(len(task.eval_batches()))
  assert not set(seen[0]) & set(seen[1])
  assert sorted(seen[0] + seen[1]) == sorted(lines[:200])  # the last 64 lines are held out
  assert eval_counts[0] == eval_counts[1] == 8  # 64 eval lines / 8 rows


def test_bad_build_arguments():
  with pytest.raises(ValueError, match='batch_size=6 is not a positive multiple'):
    data.build(
      section(DataConfig, _cfg(batch_size=6)),
      family='causal_lm',
      workdir=None,
      seed=0,
      process_count=4,
    )
  with pytest.raises(ValueError, match="family='gpt'"):
    _build('gpt')
  with pytest.raises(TypeError, match='takes the typed DataConfig, not a ConfigDict'):
    data.build(_cfg(), family='causal_lm', workdir=None, seed=0)
  with pytest.raises(ValueError, match="task='grammar' gives single documents"):
    _build('encoder_decoder', task='grammar')
  with pytest.raises(ValueError, match="task='wiki'"):
    _build(task='wiki')
  with pytest.raises(ValueError, match="tokenizer='words'"):
    _build(tokenizer='words')


def test_uneven_eval_shards_get_the_same_number_of_batches():
  real_rows = []
  for process in range(2):
    task = data.build(
      section(DataConfig, _cfg(num_eval_examples=9)),
      family='encoder_decoder',
      workdir=None,
      seed=0,
      process_index=process,
      process_count=2,
    )
    batches = task.eval_batches()
    assert len(batches) == 2 and all(b['targets'].shape == (4, 64) for b in batches)
    real_rows.append(sum(int((b['weights'].sum(axis=1) > 0).sum()) for b in batches))
  assert real_rows == [5, 4]  # examples 0, 2, 4, 6, 8 and 1, 3, 5, 7
