"""How abruptly a metric rises with model size: a logistic in log x fitted by least squares, the
width of its rise and an interval over seeds. It is the statistic of the `sigmoid_width` rule
(`research.verdicts`).

The curve is y = a + b * sigmoid((ln x - m) / s); its width is the distance in ln x (e-folds of
x) over which it goes from 10% to 90% of its change b: 2 ln 9 * s. The width belongs to the
curve, not to the grid that samples it: sizes added inside the rise make the estimate sharper
without moving it (a largest step's share of all the steps, by contrast, falls as the rise gets
more points).

The fit scans a fixed grid of midpoints m (inside the sampled range) and widths; for each, a and
b are a linear least-squares fit, so every candidate curve is scored with one matrix product, for
the data and for each resample or shuffle of it alike. numpy only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from research import estimates

WIDTH_PER_SCALE = 2 * math.log(9)  # the 10-90% width of sigmoid(z / s) is this times s
RESAMPLES = 1000  # bootstrap resamples of the seeds within each size
BY_SIZE = 200  # ... and of one size's seeds alone, for its share of the variance
SHUFFLES = 999  # shuffles of the values over the sizes, for the test that there is a rise
LEVEL = 0.95  # of the interval
RISE_P = 0.05  # a rise: fewer than this share of shuffles fit a logistic as well
_MIDPOINTS = 81  # across the sampled range of ln x
_WIDTHS = 121  # log-spaced, from 1/500 of that range to 10 times it
_CHUNK = 200  # resamples scored per matrix product (memory: candidates x chunk floats)


@dataclasses.dataclass(frozen=True)
class Rise:
  """The fitted logistic of one metric against ln x, with what the seeds say about its width."""

  width: float  # e-folds of x from 10% to 90% of the fitted change
  low: float  # the interval of the width over seeds (LEVEL); equal to width with one seed
  high: float
  midpoint: float  # x (not its log) at half the change
  change: float  # b, the fitted change from the curve's start to its end (signed)
  r2: float  # of the fit to every seed's value
  p_rise: float  # the share of shuffles of the values over the sizes fitted at least as well
  resamples: int  # bootstrap resamples behind the interval (0: one seed at every size)


def _candidates(lx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """(unit-norm centred curves [C, n], their norms before scaling [C], midpoints [C], widths
  [C]) of every candidate logistic at the points lx."""
  lo, hi = float(lx.min()), float(lx.max())
  span = hi - lo
  mids = np.linspace(lo, hi, _MIDPOINTS)
  widths = np.geomspace(span / 500, 10 * span, _WIDTHS)
  m, w = (a.ravel() for a in np.meshgrid(mids, widths, indexing='ij'))
  z = (lx[None, :] - m[:, None]) * (WIDTH_PER_SCALE / w[:, None])
  g = 0.5 * (1.0 + np.tanh(0.5 * z))  # sigmoid(z), without overflow
  g -= g.mean(axis=1, keepdims=True)
  norm = np.sqrt(np.sum(g * g, axis=1))
  ok = norm > 1e-9 * math.sqrt(lx.size)  # a curve that is flat on the points fits nothing
  return g[ok] / norm[ok, None], norm[ok], m[ok], w[ok]


def _best(curves: np.ndarray, ys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """For each row of ys [B, n]: (the best candidate's index, its explained sum of squares, its
  projection, whose sign is that of the change)."""
  found = [[], [], []]
  for start in range(0, len(ys), _CHUNK):
    rows = ys[start : start + _CHUNK]
    proj = curves @ (rows - rows.mean(axis=1, keepdims=True)).T  # [C, chunk]
    i = np.argmax(proj * proj, axis=0)
    cols = np.arange(len(rows))
    for out, x in zip(found, (i, proj[i, cols] ** 2, proj[i, cols])):
      out.append(x)
  return tuple(np.concatenate(x) for x in found)


def _width_interval(groups, curves, widths, rng) -> tuple[float, float]:
  """The LEVEL interval of the width, in e-folds, over RESAMPLES bootstrap draws of every size's
  seeds, calibrated for few seeds as `estimates.bootstrap_interval` is: each size's deviations
  widened, and the percentile interval of ln width stretched by t / z at the Welch-Satterthwaite
  degrees of freedom of the sizes' variance terms. A size's term is the variance of ln width when
  only its own seeds are drawn (BY_SIZE draws; the fitted width moves on a grid, so it has no
  gradient to take). On simulated logistic rises of 9 sizes and 3 seeds this covers the true
  width in 94-98% of sweeps, where the plain percentile bootstrap covers 82-83%
  (python -m experiments.interval_coverage)."""
  y = np.concatenate([estimates.widened(np.asarray(g, np.float64)) for g in groups])
  starts = np.cumsum([0] + [len(g) for g in groups])[:-1]
  draw = lambda s, g, count: s + rng.integers(0, len(g), (count, len(g)))
  picks = np.concatenate([draw(s, g, RESAMPLES) for s, g in zip(starts, groups)], axis=1)
  found = np.log(widths[_best(curves, y[picks])[0]])
  terms, dfs = [], []
  for s, g in zip(starts, groups):
    if len(g) > 1:
      alone = np.tile(np.arange(len(y)), (BY_SIZE, 1))
      alone[:, s : s + len(g)] = draw(s, g, BY_SIZE)
      terms.append(np.var(np.log(widths[_best(curves, y[alone])[0]])))
      dfs.append(len(g) - 1)
  low, high = estimates.stretched(found, estimates.satterthwaite_df(terms, dfs), LEVEL)
  return math.exp(low), math.exp(high)


def fit_rise(xs: Sequence[float], groups: Sequence[Sequence[float]], seed: int = 0) -> Rise:
  """The logistic of the values in `groups` (one list of seeds' values per size) against ln xs.

  The interval is the LEVEL interval of the widths fitted to RESAMPLES bootstrap resamples, each
  drawing every size's seeds with replacement, calibrated for few seeds (`_width_interval`; one
  seed everywhere: no interval). p_rise tests that y depends on x at all: the share of SHUFFLES
  random reassignments of all the values to the points whose best logistic explains at least as
  much. Deterministic for a given `seed`.

  Raises:
    ValueError: fewer than 4 sizes, x not positive, or a size without values.
  """
  if len(xs) < 4 or len(xs) != len(groups) or not all(len(g) for g in groups):
    raise ValueError('a logistic needs >= 4 sizes, each with at least one value')
  if not all(x > 0 and math.isfinite(x) for x in xs):
    raise ValueError(f'x must be positive and finite: {list(xs)}')
  lx = np.concatenate([np.full(len(g), math.log(x)) for x, g in zip(xs, groups)])
  y = np.concatenate([np.asarray(g, np.float64) for g in groups])
  total = float(np.sum((y - y.mean()) ** 2))
  if not total > 0:
    raise ValueError('the values do not change: no rise to fit')
  curves, norms, mids, widths = _candidates(lx)
  (i,), (explained,), (proj,) = _best(curves, y[None, :])
  rng = np.random.default_rng(seed)
  shuffled = np.stack([rng.permutation(y) for _ in range(SHUFFLES)])
  p_rise = (1 + int(np.sum(_best(curves, shuffled)[1] >= explained * (1 - 1e-9)))) / (1 + SHUFFLES)
  width, low, high, resamples = float(widths[i]), float(widths[i]), float(widths[i]), 0
  if any(len(g) > 1 for g in groups):
    low, high = _width_interval(groups, curves, widths, rng)
    resamples = RESAMPLES
  return Rise(
    width=width,
    low=low,
    high=high,
    midpoint=float(math.exp(mids[i])),
    change=float(proj / norms[i]),
    r2=explained / total,
    p_rise=p_rise,
    resamples=resamples,
  )
