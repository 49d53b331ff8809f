"""Sweep measurements: the gold alignment of the numbers task and the synthetic batches."""

import types

import numpy as np
import pytest

from research import measures
from transformer import data


@pytest.mark.parametrize(
  'digits,expected',
  [
    ('0', [('zero', [0])]),
    ('7', [('seven', [0])]),
    ('15', [('fifteen', [0, 1])]),
    ('40', [('forty', [0])]),
    ('105', [('one', [0]), ('hundred', [0]), ('five', [2])]),
    (
      '1234000',
      [('one', [0]), ('million', [0]), ('two', [1]), ('hundred', [1]), ('thirty', [2]),
       ('four', [3]), ('thousand', [1, 2, 3])],
    ),
    ('1000011', [('one', [0]), ('million', [0]), ('eleven', [5, 6])]),
  ],
)  # fmt: skip
def test_gold_alignment_names_the_digits_of_each_word(digits, expected):
  assert measures.gold_alignment(digits) == expected


def test_gold_alignment_covers_every_word_of_large_numbers():
  rng = np.random.default_rng(0)
  for n in rng.integers(0, 10**12, size=200):
    words = measures.gold_alignment(str(n))  # asserts the words are numbers_to_words(n)
    assert all(0 <= d < len(str(n)) for _, digits in words for d in digits)
  with pytest.raises(ValueError, match='without leading zeros'):
    measures.gold_alignment('012')


def test_gold_token_alignment_with_bytes():
  src, tgt, gold = measures.gold_token_alignment(data.ByteTokenizer(), '105', 'one hundred five')
  assert len(src) == 3 and len(tgt) == len('one hundred five') and gold.shape == (16, 3)
  assert gold[0].tolist() == [True, False, False]  # 'o' of 'one' <- the hundreds digit
  assert not gold[3].any()  # the space belongs to no word
  assert gold[-1].tolist() == [False, False, True]  # 'e' of 'five' <- the ones digit


def test_entropy_summary_separates_heads_from_layers():
  # Two modules: one with a sharp and a uniform head, one with a single head. The model-wide
  # spread sees 0.9 - 0.1; the within-module spread is (0.8 + 0) / 2 and is 0 for one head.
  s = measures.entropy_summary({'a': np.array([0.1, 0.9]), 'b': np.array([0.5])})
  assert s['entropy.spread'] == pytest.approx(0.8)
  assert s['entropy.layer_spread'] == pytest.approx(0.4)
  assert s['entropy.sharp_share'] == pytest.approx(1 / 3)
  assert s['entropy.uniform_share'] == 0.0
  one_head = measures.entropy_summary({'enc': np.array([0.05]), 'cross': np.array([0.95])})
  assert one_head['entropy.spread'] == pytest.approx(0.9)
  assert one_head['entropy.layer_spread'] == 0.0


def test_step_times_take_turns_so_a_slowdown_moves_both_sides_of_each_ratio(monkeypatch):
  """_time_steps runs one step of each compiled step per round, in turn, first one then the other
  going first. A clock that slows down by 2x halfway through leaves each round's ratio at 1.5x."""
  calls, now = [], [0.0]

  def fake(name, cost):
    def step(state, *args):
      calls.append(name)
      now[0] += cost * (2.0 if len(calls) > 8 else 1.0)  # the machine slows down mid-way
      return state, {}

    return dict(fn=step, args=[None, None, None])

  monkeypatch.setattr(measures.time, 'perf_counter', lambda: now[0])
  ref, own = measures._time_steps([fake('ref', 1.0), fake('own', 1.5)], steps=5)
  assert calls == ['ref', 'own', 'own', 'ref'] * 3 + ['ref', 'own']  # 2 warm-ups, then 5
  assert len(ref) == len(own) == 5 and max(own) == 2 * min(own)  # the clock did move
  assert np.allclose(np.asarray(own) / np.asarray(ref), 1.5)


def test_step_time_memory_against_a_reference_records_their_ratio(tiny_config):
  config = tiny_config('causal_lm')
  config.model.remat = 'full'
  ctx = types.SimpleNamespace(config=config)
  out = measures.step_time_memory(ctx, steps=2, against={'model.remat': 'none'})
  assert config.model.remat == 'full'  # the reference is a copy
  assert out['step_ratio'] > 0 and out['step_ms'] > 0 and out['step_ms_reference'] > 0
  assert out['temp_mib'] > 0 and out['tokens_per_sec'] > 0
