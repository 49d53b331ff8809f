"""The phase-change reader (research/induction.py) on curves whose answer is known."""

import math

import numpy as np
import pytest

from research import induction


def _rows(score, icl, every=50):
  return [
    {'step': every * (i + 1), 'induction.max': float(s), 'previous_token.max': 0.1,
     'induction.in_context_loss': float(c)}
    for i, (s, c) in enumerate(zip(score, icl))
  ]  # fmt: skip


def test_an_abrupt_rise_with_a_coincident_drop_in_in_context_loss():
  at = np.arange(1, 51) * 50  # 2500 steps
  score = 0.03 + 0.6 / (1 + np.exp(-(at - 1200) / 40))  # jumps around step 1200
  icl = -0.1 - 1.0 / (1 + np.exp(-(at - 1250) / 40)) - 0.0002 * at  # falls there, plus a drift
  got = induction.phase_change(_rows(score, icl), steps=2500)
  assert got['induction.final'] == pytest.approx(0.63, abs=0.01)
  assert got['induction.rise_fraction'] <= 0.1  # 20% -> 80% takes about 2 * 40 * 1.39 steps
  assert got['induction.onset'] == pytest.approx(1200 / 2500, abs=0.03)
  assert got['phase.lag'] <= 0.05
  assert got['in_context.final'] < got['in_context.start'] - 1.0


def test_a_gradual_rise_and_a_drop_elsewhere_are_told_apart():
  at = np.arange(1, 51) * 50
  score = 0.03 + 0.6 * at / 2500  # a straight line
  icl = -0.1 - 1.0 / (1 + np.exp(-(at - 400) / 40))  # falls early, not with the score
  got = induction.phase_change(_rows(score, icl), steps=2500)
  assert got['induction.rise_fraction'] == pytest.approx(0.6, abs=0.05)
  abrupt = 0.03 + 0.6 / (1 + np.exp(-(at - 2000) / 40))
  late = induction.phase_change(_rows(abrupt, icl), steps=2500)
  assert late['phase.lag'] == pytest.approx((2000 - 400) / 2500, abs=0.05)


def test_no_rise_has_no_timing_and_too_few_logs_are_one_error():
  flat = induction.phase_change(_rows([0.03] * 20, [-0.2] * 20), steps=1000)
  assert flat['induction.final'] == pytest.approx(0.03)
  assert all(math.isnan(flat[k]) for k in ('induction.rise_fraction', 'phase.lag'))
  with pytest.raises(ValueError, match='3 induction logs are too few'):
    induction.phase_change(_rows([0.1] * 3, [0.0] * 3), steps=150)
