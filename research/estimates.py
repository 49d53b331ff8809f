"""Estimates over seeds that the verdicts use: the mean and spread, Welch's interval of a
difference of means, and least-squares power-law fits."""

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
  residuals of different floors are not comparable: the log stretches as y - floor shrinks)."""
  x, y = np.asarray(xs, np.float64), np.asarray(ys, np.float64)
  lowest = float(y.min())
  best, best_sse = None, math.inf
  for floor in lowest * (1.0 - np.geomspace(1.0, 1e-4, 241)):  # denser near min y
    fit = fit_power_law(x, y, floor)
    sse = float(np.sum((floor + fit['c'] * x ** fit['slope'] - y) ** 2))
    if sse < best_sse:
      best, best_sse = fit, sse
  return best
