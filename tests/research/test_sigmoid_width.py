"""The sigmoid_width rule (research.logistic): the width of a logistic rise in log parameters tells
a jump from a smooth rise whatever grid samples it, calls noise inconclusive, and on the committed
emergence runs never turns a smooth metric into a jump when sizes are left out, as the share of
the largest step did."""

import math
import os

import numpy as np
import pytest

from research import logistic, spec, verdicts
from research import results as results_lib
from research import rules as rules_lib

R, N, I = verdicts.REPRODUCED, verdicts.NOT_REPRODUCED, verdicts.INCONCLUSIVE  # noqa: E741
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_THRESHOLD = math.log(4)  # emergence's: a factor of 4 in parameters
_SPAN = 4.0  # e-folds of parameters the synthetic grids cover; 5 points are 1 e-fold apart


def _logistic(lx, mid, width):
  return 1 / (1 + np.exp(-(lx - mid) * logistic.WIDTH_PER_SCALE / width))


def _table(lx, values):
  """{'s0': {'params': [...], 'y': [...]}, ...}: one variant per size, one value per seed."""
  return {
    f's{i}': {'params': [math.exp(x)] * len(v), 'y': list(v)}
    for i, (x, v) in enumerate(zip(lx, values))
  }


def _rule(n, shape):
  return dict(kind='sigmoid_width', metric='y', variants=[f's{i}' for i in range(n)], x='params',
              shape=shape, threshold=_THRESHOLD)  # fmt: skip


def _synthetic(n, width, offset, seed, noise=0.02):
  """3 seeds at each of n sizes 1e4 .. 1e4 e^_SPAN (nested grids: 5 in 9 in 17), a logistic of
  this 10-90% width from 0 to 1 whose midpoint lies `offset` of a 5-point cell past the centre,
  plus noise."""
  rng = np.random.default_rng(seed)
  lx = math.log(1e4) + np.linspace(0, _SPAN, n)
  mid = math.log(1e4) + _SPAN / 2 + offset * _SPAN / 4
  return _table(lx, [_logistic(x, mid, width) + rng.normal(0, noise, 3) for x in lx])


def test_the_width_of_a_logistic_is_recovered():
  table = _synthetic(17, 0.44, 0.3, seed=0, noise=0.0)
  rise = logistic.fit_rise(
    [v['params'][0] for v in table.values()], [v['y'] for v in table.values()]
  )
  assert rise.width == pytest.approx(0.44, rel=0.08)  # the grid of widths is 7% apart
  assert rise.change == pytest.approx(1.0, rel=0.02) and rise.r2 > 0.999
  assert math.log(rise.midpoint) == pytest.approx(math.log(1e4) + 2.3, abs=0.06)
  assert rise.low == rise.high == rise.width and rise.resamples > 0  # no noise, no spread


@pytest.mark.parametrize('n', [5, 9, 17])
def test_a_sharp_rise_is_a_jump_and_a_wide_one_smooth_on_any_grid(n):
  # 12% to 88% within +-0.2 e-folds: a 10-90% width of 0.44 e-folds; the wide one 4.4.
  assert _logistic(0.2, 0.0, 0.44) == pytest.approx(0.88, abs=0.002)
  for offset in (0.0, 0.5, 1.0):  # on one of the 5 sizes, between two, on another
    smooth = verdicts.evaluate(_rule(n, 'smooth'), _synthetic(n, 4.4, offset, seed=n))
    assert smooth.status == R and smooth.numbers['low'] > _THRESHOLD, smooth.text
    sharp = verdicts.evaluate(_rule(n, 'jump'), _synthetic(n, 0.44, offset, seed=n))
    if n == 5 and offset == 0.0:
      # The midpoint on one of 5 sizes: only the neighbours bound the width, and with 3 seeds
      # its interval reaches past ln 4. Not shown, and not called smooth either.
      assert sharp.status == I and sharp.numbers['low'] < _THRESHOLD, sharp.text
    else:
      assert sharp.status == R and sharp.numbers['high'] < _THRESHOLD, sharp.text
  # The same data under the other expectation fails: a verdict, not a default.
  assert verdicts.evaluate(_rule(n, 'smooth'), _synthetic(n, 0.44, 0.5, seed=n)).status == N
  assert verdicts.evaluate(_rule(n, 'jump'), _synthetic(n, 4.4, 0.5, seed=n)).status == N


@pytest.mark.parametrize('n', [5, 9, 17])
def test_noise_alone_is_inconclusive_for_a_jump_and_a_smooth_rise(n):
  for seed in range(3):
    rng = np.random.default_rng(100 + seed)
    table = _table(np.linspace(9, 9 + _SPAN, n), [0.5 + rng.normal(0, 0.02, 3) for _ in range(n)])
    for shape in ('jump', 'smooth'):
      verdict = verdicts.evaluate(_rule(n, shape), table)
      assert verdict.status == I and 'no rise beyond the noise' in verdict.text, verdict.text
  # A metric that does not change at all (an untrained model's exact match) is no rise either.
  flat = _table(np.linspace(9, 13, 5), [[0.0]] * 5)
  assert verdicts.evaluate(_rule(5, 'jump'), flat).status == N


def test_a_width_interval_across_the_threshold_is_inconclusive():
  verdict = verdicts.evaluate(_rule(9, 'jump'), _synthetic(9, 1.4, 0.5, seed=3, noise=0.05))
  assert verdict.status == I and 'neither shown' in verdict.text, verdict.text
  assert verdict.numbers['low'] < _THRESHOLD < verdict.numbers['high']


def test_bad_sigmoid_width_rules_are_errors_at_load():
  good = _rule(5, 'jump')
  rules_lib.check_rule(good)
  for bad, message in [
    ({**good, 'shape': 'steep'}, "shape='steep' must be 'jump' or 'smooth'"),
    ({**good, 'threshold': 0}, 'threshold=0 must be a number of e-folds > 0'),
    ({**good, 'variants': ['s0', 's1', 's2']}, 'needs >= 4 variants'),
    ({k: v for k, v in good.items() if k != 'x'}, "needs the key 'x'"),
  ]:
    with pytest.raises(ValueError, match=message):
      rules_lib.check_rule(bad)


# The committed emergence runs --------------------------------------------------------------------
@pytest.fixture(scope='module')
def emergence():
  _, results = results_lib.load_results(os.path.join(ROOT, 'docs', 'results', 'emergence'))
  sweep = spec.load_sweep(os.path.join(ROOT, 'configs', 'sweeps', 'emergence.py'))
  return results_lib.metric_table(results), sweep


def _subset(rule, widths):
  return {**rule, 'variants': [v for v in rule['variants'] if int(v[1:].split('_')[0]) in widths]}


def test_leaving_sizes_out_of_the_emergence_grid_never_flips_a_verdict(emergence):
  """The 5 doublings of d_model (8 .. 128) against all 9 widths: largest_step called every metric
  a jump on the 5 and smooth on the 9; the width of the logistic calls no metric a jump on one
  grid and smooth on the other. Fewer sizes inside the rise pin its width less tightly, so the
  subset may be inconclusive where all 9 decide."""
  table, sweep = emergence
  five, nine = (8, 16, 32, 64, 128), (8, 10, 12, 14, 16, 24, 32, 64, 128)
  rules = [r for r in sweep.rules if r['kind'] == 'sigmoid_width']
  assert len(rules) == 8  # 4 metrics x 2 families
  calls = {}
  for rule in rules:
    step = {k: v for k, v in rule.items() if k not in ('shape', 'threshold', 'requires')}
    step.update(kind='largest_step', at_least_share=0.5)
    old = {g: verdicts.evaluate(_subset(step, g), table).numbers['share'] for g in (five, nine)}
    assert old[five] > 0.5 > old[nine]  # the share of the largest step follows the grid
    found = {g: verdicts.evaluate(_subset(rule, g), table).numbers for g in (five, nine)}
    calls[rule['metric'], rule['variants'][0]] = (found[five]['call'], found[nine]['call'])
  for key, (coarse, fine) in calls.items():
    assert {coarse, fine} != {'jump', 'smooth'}, key
    assert 'jump' not in (coarse, fine), key  # no metric's rise is shown to be a jump
  # On all nine, exact match rises smoothly with label smoothing; without it the interval of its
  # width (1.30 to 3.45 e-folds) reaches below ln 4.
  assert calls['eval.exact_match', 'd8'][1] == 'smooth'
  assert calls['eval.exact_match', 'd8_ls0'][1] == 'neither'
