"""How often the verdicts' bootstrap intervals cover the truth, on simulated sweeps of 3 seeds.

Each case draws a curve whose true statistic is known (a power law's slope, the largest step's
share of a rise, a logistic's width), adds seed noise, and asks whether the 95% interval holds
the truth: sparrow's (`estimates.bootstrap_interval`, `logistic.fit_rise`) beside a plain
percentile bootstrap of the same draws (python -m experiments.interval_coverage).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from research import estimates, logistic

SEEDS = 3
_XS = [2.0**k for k in range(10, 17)]  # 7 sizes, one doubling apart
_RISE = 1 / (1 + np.exp(-(np.arange(9) - 4) / 1.5))  # a logistic over 9 grid points
_SIZES = [2.0**k for k in range(3, 12)]  # 9 sizes for the logistic width, midpoint at 2^7


def largest_share(means) -> float:
  """The largest step between neighbours as a share of all steps (curves.largest_step's)."""
  sizes = np.abs(np.diff(means))
  return float(sizes.max() / sizes.sum())


def _slope(fitter, means) -> float:
  return fitter(_XS, list(means))['slope']


def _logistic(width: float) -> np.ndarray:
  """A rise from 0 to 1 over `width` e-folds (10% to 90%) at the _SIZES, centred on 2^7."""
  scale = width / logistic.WIDTH_PER_SCALE
  return 1 / (1 + np.exp(-(np.log(_SIZES) - 7 * np.log(2)) / scale))


def _width_intervals(groups) -> tuple[tuple[float, float], tuple[float, float]]:
  """(sparrow's interval of the logistic's width, `logistic.fit_rise`; the plain percentile
  interval of the same fit over bootstrap draws of the seeds, read from its candidate grid)."""
  rise = logistic.fit_rise(_SIZES, groups)
  lx = np.concatenate([np.full(len(g), np.log(x)) for x, g in zip(_SIZES, groups)])
  y = np.concatenate([np.asarray(g, np.float64) for g in groups])
  curves, _, _, widths = logistic._candidates(lx)  # noqa: SLF001 (the same grid, uncorrected)
  rng, starts = np.random.default_rng(0), np.cumsum([0] + [len(g) for g in groups])[:-1]
  picks = np.concatenate(
    [s + rng.integers(0, len(g), (estimates.RESAMPLES, len(g))) for s, g in zip(starts, groups)],
    axis=1,
  )
  drawn = widths[logistic._best(curves, y[picks])[0]]  # noqa: SLF001
  return (rise.low, rise.high), tuple(float(v) for v in np.percentile(drawn, [2.5, 97.5]))


def _cases(rng: np.random.Generator) -> dict[str, tuple[Callable, Callable, float]]:
  """name -> (a sweep's per-point seed values, the statistic of their means, its true value);
  a statistic of None: the logistic's width, whose intervals come from `_width_intervals`."""
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
    "logistic's 10-90% width, 2 e-folds (9 sizes, noise 0.05)": (
      lambda: [list(y + 0.05 * rng.standard_normal(SEEDS)) for y in _logistic(2.0)], None, 2.0,
    ),
    "logistic's 10-90% width, 4 e-folds (9 sizes, noise 0.03)": (
      lambda: [list(y + 0.03 * rng.standard_normal(SEEDS)) for y in _logistic(4.0)], None, 4.0,
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
      if statistic is None:
        ours, plain = _width_intervals(groups)
      else:
        ours, plain = (
          estimates.bootstrap_interval(groups, statistic),
          plain_interval(groups, statistic),
        )
      hits['sparrow'] += ours[0] <= truth <= ours[1]
      hits['plain'] += plain[0] <= truth <= plain[1]
    out[name] = {k: v / sweeps for k, v in hits.items()}
  return out
