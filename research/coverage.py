"""How often the verdicts' bootstrap intervals cover the truth, on simulated sweeps of 3 seeds.

Each case draws a curve whose true statistic is known (a power law's slope, the largest step's
share of a logistic rise), adds seed noise, and asks whether the 95% interval holds the truth:
`estimates.bootstrap_interval` beside a plain percentile bootstrap of the same draws
(python -m experiments.interval_coverage).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from research import estimates

SEEDS = 3
_XS = [2.0**k for k in range(10, 17)]  # 7 sizes, one doubling apart
_RISE = 1 / (1 + np.exp(-(np.arange(9) - 4) / 1.5))  # a logistic over 9 grid points


def largest_share(means) -> float:
  """The largest step between neighbours as a share of all steps (curves.largest_step's)."""
  sizes = np.abs(np.diff(means))
  return float(sizes.max() / sizes.sum())


def _slope(fitter, means) -> float:
  return fitter(_XS, list(means))['slope']


def _cases(rng: np.random.Generator) -> dict[str, tuple[Callable, Callable, float]]:
  """name -> (a sweep's per-point seed values, the statistic of their means, its true value)."""
  fixed = functools.partial(_slope, functools.partial(estimates.fit_power_law, floor=0.0))
  free = functools.partial(_slope, estimates.fit_power_law_free_floor)
  noisy = lambda y, sd: [y * (1 + sd * rng.standard_normal()) for _ in range(SEEDS)]
  return {
    'power-law slope, floor 0 (y = 2 x^-0.3, 5% noise), 7 sizes': (
      lambda: [noisy(2 * x**-0.3, 0.05) for x in _XS], fixed, -0.3,
    ),
    'power-law slope, floor fitted (y = 1.5 + 30 x^-0.4, 5% noise on the power), 7 sizes': (
      lambda: [[1.5 + v for v in noisy(30 * x**-0.4, 0.05)] for x in _XS], free, -0.4,
    ),
    "largest step's share (a logistic over 9 points, noise 0.03)": (
      lambda: [[y + 0.03 * rng.standard_normal() for _ in range(SEEDS)] for y in _RISE],
      largest_share,
      largest_share(_RISE),
    ),
  }  # fmt: skip


def plain_interval(groups, statistic, level: float = 0.95) -> tuple[float, float]:
  """The percentile interval of statistic(means) over bootstrap draws of the seeds, uncorrected."""
  rng = np.random.default_rng(0)
  draws = [np.asarray(g)[rng.integers(0, len(g), (estimates.RESAMPLES, len(g)))] for g in groups]
  found = np.array([statistic(row) for row in np.stack([d.mean(1) for d in draws], 1)])
  tail = 50 * (1 - level)
  return float(np.percentile(found, tail)), float(np.percentile(found, 100 - tail))


def coverage(sweeps: int, only: str | None = None, seed: int = 1) -> dict[str, dict[str, float]]:
  """case -> {'sparrow': share of `sweeps` simulated sweeps whose 95% interval holds the truth,
  'plain': the same for `plain_interval`}; `only`: the cases whose name contains it."""
  rng = np.random.default_rng(seed)
  out = {}
  for name, (draw, statistic, truth) in _cases(rng).items():
    if only and only not in name:
      continue
    hits = {'sparrow': 0, 'plain': 0}
    for _ in range(sweeps):
      groups = draw()
      low, high = estimates.bootstrap_interval(groups, statistic)
      hits['sparrow'] += low <= truth <= high
      low, high = plain_interval(groups, statistic)
      hits['plain'] += low <= truth <= high
    out[name] = {k: v / sweeps for k, v in hits.items()}
  return out
