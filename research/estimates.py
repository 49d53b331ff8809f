"""Estimates over seeds that the verdicts use: the mean and spread, Welch's interval of a
difference of means, a ratio's interval, a bootstrap over seeds, and least-squares power-law
fits."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def mean_std(values: Sequence[float]) -> tuple[float, float]:
  """Mean and sample standard deviation (0 for one value; inf when a value is infinite)."""
  x = np.asarray(values, np.float64)
  if not np.all(np.isfinite(x)):
    return float(np.mean(x)) if not np.any(np.isnan(x)) else math.nan, math.inf
  return float(x.mean()), float(x.std(ddof=1)) if len(x) > 1 else 0.0


def welch_interval(va: Sequence[float], vb: Sequence[float], level: float = 0.95):
  """(low, high): the `level` interval of mean(va) - mean(vb) by Welch's t, or None when a side
  has one value (no spread to judge by)."""
  from scipy import stats

  if len(va) < 2 or len(vb) < 2:
    return None
  (ma, sa), (mb, sb) = mean_std(va), mean_std(vb)
  ea, eb = sa**2 / len(va), sb**2 / len(vb)
  se = math.sqrt(ea + eb)
  if se == 0 or not math.isfinite(se):
    return (ma - mb, ma - mb) if se == 0 else (-math.inf, math.inf)
  df = (ea + eb) ** 2 / (ea**2 / (len(va) - 1) + eb**2 / (len(vb) - 1))
  half = float(stats.t.ppf(0.5 + level / 2, df)) * se
  return ma - mb - half, ma - mb + half


def t_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
  """The `level` t-interval of the mean of `values` (seeds); one value: (value, value)."""
  from scipy import stats

  mean, std = mean_std(values)
  if not std or len(values) < 2:
    return mean, mean
  half = float(stats.t.ppf(0.5 + level / 2, len(values) - 1)) * std / math.sqrt(len(values))
  return mean - half, mean + half


def fit_power_law(xs: Sequence[float], ys: Sequence[float], floor: float = 0.0) -> dict[str, float]:
  """Least squares of log(y - floor) = log c + slope * log x; returns slope, c, r2 (of the log
  fit) and floor. Every y must be above the floor."""
  lx = np.log(np.asarray(xs, np.float64))
  ly = np.log(np.asarray(ys, np.float64) - floor)
  slope, intercept = np.polyfit(lx, ly, 1)
  predicted = intercept + slope * lx
  if np.ptp(ly) == 0:  # a flat y: its slope is 0, not polyfit's roundoff (which has a sign)
    slope, intercept, predicted = 0.0, float(ly[0]), ly
  total = float(np.sum((ly - ly.mean()) ** 2))
  r2 = 1.0 - float(np.sum((ly - predicted) ** 2)) / total if total > 0 else 1.0
  return {'slope': float(slope), 'c': float(math.exp(intercept)), 'r2': r2, 'floor': float(floor)}


def fit_power_law_free_floor(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float]:
  """y = floor + c * x^slope with the floor fitted too: over a grid of floors in [0, min y), the
  log-log fit (`fit_power_law`) whose curve has the least squared error in y itself (the log
  residuals of different floors are not comparable: the log stretches as y - floor shrinks).
  The grid's fits are solved together, in closed form."""
  x, y = np.asarray(xs, np.float64), np.asarray(ys, np.float64)
  floors = float(y.min()) * (1.0 - np.geomspace(1.0, 1e-4, 241))  # denser near min y
  lx, ly = np.log(x), np.log(y[None] - floors[:, None])  # [n], [floors, n]
  dx = lx - lx.mean()
  slopes = (ly - ly.mean(1, keepdims=True)) @ dx / (dx @ dx)  # [floors]
  intercepts = ly.mean(1) - slopes * lx.mean()
  curves = floors[:, None] + np.exp(intercepts[:, None] + slopes[:, None] * lx[None])
  best = int(np.argmin(np.sum((curves - y[None]) ** 2, axis=1)))
  return fit_power_law(x, y, float(floors[best]))


RESAMPLES = 1000  # bootstrap draws of the seeds, for `bootstrap_interval`


def bootstrap_interval(
  groups: Sequence[Sequence[float]], statistic, resamples: int = RESAMPLES, level: float = 0.95
) -> tuple[float, float] | None:
  """The `level` interval of `statistic(means)` (means: one per group) from `resamples` bootstrap
  draws of each group's seeds with replacement (seeded, so a report reproduces), or None when a
  group has one value (no spread to draw from) or no draw gives a finite statistic.

  A plain percentile bootstrap is too narrow with a few seeds: a draw's mean varies by
  (n - 1) / n of the seeds' variance, and the variance itself is known only to n - 1 degrees of
  freedom. So each group's deviations from its mean are first widened (`widened`), and the
  percentile interval is then stretched about the draws' median by t / z (`stretched`), t at the
  Welch-Satterthwaite degrees of freedom of the statistic's linearisation (its finite-difference
  gradient in the means). With 3 seeds at each of 7 points this covers a true power-law slope in
  96% of simulated sweeps, where the plain bootstrap covers 85%; a largest step's share 93%
  against 59% (research/coverage.py, python -m experiments.interval_coverage)."""
  if min(map(len, groups)) < 2:
    return None
  values = [np.asarray(g, np.float64) for g in groups]
  rng = np.random.default_rng(0)
  wide = [widened(v) for v in values]
  draws = np.stack([w[rng.integers(0, len(w), (resamples, len(w)))].mean(1) for w in wide], 1)
  found = np.array([statistic(row) for row in draws], np.float64)  # draws: [resamples, groups]
  found = found[np.isfinite(found)]
  if not len(found):
    return None
  return stretched(found, _linearised_df(statistic, values), level)


def widened(values: np.ndarray) -> np.ndarray:
  """The seeds with their deviations from their mean times sqrt(n / (n - 1)), so that a bootstrap
  draw's mean varies by the unbiased variance / n (not (n - 1) / n of it)."""
  n = len(values)
  return values.mean() + (values - values.mean()) * math.sqrt(n / (n - 1)) if n > 1 else values


def stretched(found: np.ndarray, df: float, level: float) -> tuple[float, float]:
  """The central `level` percentile interval of bootstrap draws, stretched about their median by
  Student's t at `df` over the normal quantile: the few seeds' uncertainty about their own
  variance, which resampling them cannot show."""
  from scipy import stats

  tail, quantile = 50 * (1 - level), 0.5 + level / 2
  low, high, middle = np.percentile(found, [tail, 100 - tail, 50])
  stretch = float(stats.t.ppf(quantile, df) / stats.norm.ppf(quantile))
  return float(middle - (middle - low) * stretch), float(middle + (high - middle) * stretch)


def satterthwaite_df(terms: np.ndarray, dfs: np.ndarray) -> float:
  """Welch-Satterthwaite degrees of freedom of a sum of variance terms, each known to its own
  degrees of freedom; the smallest of those where the terms are all 0."""
  terms, dfs = np.asarray(terms, np.float64), np.asarray(dfs, np.float64)
  if not (np.all(np.isfinite(terms)) and terms.sum() > 0):
    return float(dfs.min())
  return float(terms.sum() ** 2 / np.sum(terms**2 / dfs))


def _linearised_df(statistic, values: list) -> float:
  """The degrees of freedom of statistic(means): each group's term is (d statistic / d mean)^2
  var / n, with n - 1 degrees of freedom (a group without spread adds no term)."""
  means = np.array([v.mean() for v in values])
  var = np.array([v.var(ddof=1) / len(v) for v in values])  # each mean's variance
  dfs = np.array([len(v) - 1 for v in values], np.float64)
  centre, grad = statistic(means), np.zeros(len(means))
  if not math.isfinite(centre):
    return float(dfs.min())
  for i in np.flatnonzero(var > 0):
    h = math.sqrt(var[i]) * 1e-3
    grad[i] = (statistic(means + np.eye(len(means))[i] * h) - centre) / h
  return satterthwaite_df(grad**2 * var, dfs)


def log_ratio_interval(
  va: Sequence[float], vb: Sequence[float], paired: bool = False, level: float = 0.95
) -> tuple[float, float] | None:
  """The `level` interval of mean(va) / mean(vb), both positive: the delta method on the log of
  each mean with Welch's degrees of freedom, or with `paired` (one seed's two values side by
  side) the t-interval of the per-seed log ratios (unpaired when a value is <= 0). None
  with one seed, or a mean <= 0."""
  from scipy import stats

  a, b = np.asarray(va, np.float64), np.asarray(vb, np.float64)
  if min(len(a), len(b)) < 2 or a.mean() <= 0 or b.mean() <= 0:
    return None
  if paired and len(a) == len(b) and np.all(a > 0) and np.all(b > 0):
    low, high = t_interval(np.log(a / b), level)
    return math.exp(low), math.exp(high)
  ea, eb = (x.var(ddof=1) / len(x) / x.mean() ** 2 for x in (a, b))  # var of log mean, to 1st order
  ratio, se = a.mean() / b.mean(), math.sqrt(ea + eb)
  if se == 0:
    return ratio, ratio
  df = (ea + eb) ** 2 / (ea**2 / (len(a) - 1) + eb**2 / (len(b) - 1))
  half = float(stats.t.ppf(0.5 + level / 2, df)) * se
  return ratio * math.exp(-half), ratio * math.exp(half)
