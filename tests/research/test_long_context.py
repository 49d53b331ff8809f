"""Tests of research.long_context: the step cost that the long_context sweep fits, and the
recall null (elimination) against its exact expectation."""

import math

import numpy as np
import pytest

from configs import gpt_tiny
from research import long_context


def _config(**model):
  config = gpt_tiny.get_config()
  config.model.update(position='rope', vocab_size=300, d_model=32, d_ff=64, num_layers=1, **model)
  return config


@pytest.mark.parametrize(
  'model, low, high',
  [
    # [T, T] logits: 16x at 4x the length (measured 18.7x: 3.5 -> 65.6 MiB, 4.5 -> 65.6 before the
    # heads-in-batch path kept fewer buffers at T=256); linear would be ~4x
    (dict(attention_impl='xla'), 8.0, 24.0),
    # a [H, H] state per block: ~4x (slow, ~10 s: test_linear_attention checks the same growth)
    pytest.param(dict(attention='linear'), 2.0, 6.0, marks=pytest.mark.slow),
  ],
)
def test_step_memory_of_full_attention_is_quadratic_and_of_linear_attention_linear(
  model, low, high
):
  short, long = (long_context.step_cost(_config(**model), T, steps=1) for T in (256, 1024))
  assert short['ms'] > 0 and long['ms'] > 0
  assert low < long['mib'] / short['mib'] < high, (short, long)


def _expected_mode_share(m: int, letters: int = 26) -> float:
  """E[largest multiplicity among m uniform draws from `letters`] / m, exactly: P(max < k) counts
  the sequences whose every letter occurs under k times, m! [x^m] (sum_{i<k} x^i / i!)^letters."""
  from fractions import Fraction

  def below(k):  # P(max < k)
    poly = [Fraction(1)]
    term = [Fraction(1, math.factorial(i)) for i in range(min(k, m + 1))]
    for _ in range(letters):
      poly = [sum(poly[j] * term[d - j] for j in range(len(poly)) if 0 <= d - j < len(term))
              for d in range(m + 1)]  # fmt: skip
    return poly[m] * math.factorial(m) / Fraction(letters) ** m

  return float(sum(1 - below(k) for k in range(1, m + 1)) / m)


def test_elimination_scores_the_most_frequent_value_left_in_the_bag():
  # 2 pairs: the first answer is right when both values agree (1/26), else half the time.
  first = 1 / 26 + 25 / 26 * 0.5
  assert _expected_mode_share(2) == pytest.approx(first)
  for pairs in (2, 4, 8):
    found = long_context.elimination_accuracy(pairs, 8, pairs, count=20_000)
    exact = [_expected_mode_share(pairs - j) for j in range(pairs)]  # j answers are out
    assert found == pytest.approx(exact, abs=0.01)
    assert found[-1] == 1.0  # the last value left is the answer
  # Asking only some of the pairs leaves the others in the bag: the last answer is a guess.
  some = long_context.elimination_accuracy(4, 8, 2, count=20_000)
  assert some == pytest.approx([_expected_mode_share(4), _expected_mode_share(3)], abs=0.01)


def test_elimination_with_a_large_vocabulary_and_few_queries_is_about_one_over_the_pairs():
  # With more than 26 values an example's values are distinct: query j is right 1 / (pairs - j).
  found = long_context.elimination_accuracy(8, 4, 3, count=5_000, vocab=512)
  assert found == pytest.approx([1 / 8, 1 / 7, 1 / 6], rel=1e-9)
  # recall_mqar's design: a quarter of the pairs asked. Elimination gains little over copying
  # any value of the pairs (1 / pairs), where asking all 16 of 26 values gives it 4.6 times that.
  for pairs in (4, 8, 16, 32):
    asked_few = np.mean(
      long_context.elimination_accuracy(pairs, 4, pairs // 4, count=2_000, vocab=512)
    )
    assert 1 / pairs <= asked_few < 1.15 / pairs
  asked_all = np.mean(long_context.elimination_accuracy(16, 4, 16, count=10_000))
  assert asked_all > 4.5 / 16
