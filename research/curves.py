"""The rules about a curve over variants: steps that rise or fall (`ordering`, `monotone`), the
largest step, the width of a logistic rise (`sigmoid_width`) and a power-law fit; each returns a
`research.outcome.Verdict` (the kinds and their keys are in `research.rules.KINDS`)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

import numpy as np

from research import estimates, logistic
from research.estimates import mean_std, welch_interval
from research.outcome import (
  INCONCLUSIVE,
  NOT_REPRODUCED,
  NOT_RUN,
  REPRODUCED,
  Table,
  Verdict,
  fmt,
  seed_values,
)


def _steps(rule: Mapping, labels: list[str], values: list[list[float]]) -> Verdict:
  """Whether the means of `values` rise (or fall) step by step.

  With one seed somewhere, a step may fall back by up to `tolerance`. With >= 2 seeds everywhere
  each step has its 95% interval over seeds (Welch's): one wholly against the direction fails the
  rule; one across 0 makes it inconclusive.
  """
  rising = rule.get('direction', 'increasing') == 'increasing'
  stats = [mean_std(v) for v in values]
  means = [m for m, _ in stats]
  seeded = all(len(v) >= 2 for v in values)
  bad, flat = [], []
  for i in range(len(means) - 1):
    step = means[i + 1] - means[i] if rising else means[i] - means[i + 1]
    pair = (labels[i], labels[i + 1])
    if not seeded:
      if not step > -float(rule.get('tolerance', 0.0)):
        bad.append(pair)
      continue
    later, earlier = (values[i + 1], values[i]) if rising else (values[i], values[i + 1])
    low, high = welch_interval(later, earlier)
    if high < 0:
      bad.append(pair)
    elif low <= 0:
      flat.append((*pair, low, high))
  shown = ', '.join(f'{label} {fmt(m, sd)}' for label, (m, sd) in zip(labels, stats))
  text = f'{rule.get("direction", "increasing")}: {shown}'
  numbers = dict(zip(labels, means))
  if bad:
    text += f'; breaks between {bad[0][0]} and {bad[0][1]}'
    return Verdict(NOT_REPRODUCED, text, dict(rule), numbers)
  if flat:
    first, second, low, high = flat[0]
    text += (
      f"; {first} to {second} is within the seeds' noise (its 95% interval over seeds, "
      f'{fmt(low)} to {fmt(high)}, spans 0)'
    )
    return Verdict(INCONCLUSIVE, text, dict(rule), numbers)
  return Verdict(REPRODUCED, text, dict(rule), numbers)


def ordering(rule: Mapping, table: Table) -> Verdict:
  metric = rule['metric']
  values = [seed_values(table, v, metric) for v in rule['variants']]
  verdict = _steps(rule, list(rule['variants']), values)
  return dataclasses.replace(verdict, text=f'{metric} {verdict.text}')


def largest_step(rule: Mapping, table: Table) -> Verdict:
  """The largest change between neighbouring variants' means (per e-fold of rule['x'] if given),
  as a share of the sum of all the changes' sizes.

  With two or more seeds everywhere the share has a 95% interval (`estimates.bootstrap_interval`:
  the seeds within each variant resampled): a threshold inside it is inconclusive, for
  at_least_share (a jump) and at_most_share (smooth) alike.
  """
  metric, labels = rule['metric'], list(rule['variants'])
  stats = [mean_std(seed_values(table, v, metric)) for v in labels]
  means = np.array([m for m, _ in stats])
  widths = np.ones(len(labels) - 1)  # each step's width: 1, or its e-folds of x
  if 'x' in rule:
    widths = np.diff(np.log([mean_std(seed_values(table, v, rule['x']))[0] for v in labels]))
    if not np.all(widths > 0):
      raise ValueError(f"rule 'largest_step' needs {rule['x']} rising along {', '.join(labels)}")
  steps = np.diff(means) / widths
  total = float(np.sum(np.abs(steps)))
  i = int(np.argmax(np.abs(steps)))
  size = abs(float(steps[i]))
  share = size / total if total > 0 else math.nan
  per = f' per e-fold of {rule["x"]}' if 'x' in rule else ''
  shown = ', '.join(f'{label} {fmt(m, sd)}' for label, (m, sd) in zip(labels, stats))
  text = (
    f'{metric}: {shown}; largest step{per} {labels[i]} -> {labels[i + 1]} {steps[i]:+.4g}, '
    f'{fmt(share)} of the total change {fmt(total)}'
  )
  numbers = {'share': share, 'step': float(steps[i]), 'total': total, 'at': labels[i + 1]}
  if not total > 0:
    return Verdict(INCONCLUSIVE, text + ' (the metric does not change)', dict(rule), numbers)
  groups = [seed_values(table, v, metric) for v in labels]

  def share_of(means):  # the largest step's share, wherever it falls in this draw
    sizes = np.abs(np.diff(means) / widths)
    return float(sizes.max() / sizes.sum()) if sizes.sum() > 0 else math.nan

  finite = all(math.isfinite(v) for g in groups for v in g)
  spread = estimates.bootstrap_interval(groups, share_of) if finite else None
  low, high = spread or (share, share)
  held, unsure = True, False  # the share against its thresholds, and whether noise could flip it
  if 'at_least_share' in rule:
    held &= share >= float(rule['at_least_share'])
    unsure |= low < float(rule['at_least_share']) <= high
  if 'at_most_share' in rule:
    held &= share <= float(rule['at_most_share'])
    unsure |= low <= float(rule['at_most_share']) < high
  fixed = abs(means[i + 1] - means[i]) >= float(rule.get('min_step', 0.0))
  if 'expect_at' in rule:
    fixed &= labels[i + 1] == rule['expect_at']
    text += f' (expected at {rule["expect_at"]})'
  if spread:
    numbers.update(low=low, high=high)
    text += (
      f"; the share's 95% interval is {fmt(low)} to {fmt(high)} ({_bootstrap_words('variant')})"
    )
  if fixed and unsure:
    text += "; a threshold lies inside it: within the seeds' noise"
    return Verdict(INCONCLUSIVE, text, dict(rule), numbers)
  return Verdict(REPRODUCED if fixed and held else NOT_REPRODUCED, text, dict(rule), numbers)


def sigmoid_width(rule: Mapping, table: Table) -> Verdict:
  """How abruptly `metric` rises with rule['x']: the 10-90% width, in e-folds of x, of the
  least-squares logistic in ln x through every seed's value (`research.logistic`), with its
  interval over seeds (a bootstrap of the seeds within each size). A jump: the interval lies
  below `threshold`; a smooth rise: above it; across it the rule is inconclusive. So is a curve
  whose best logistic fits no better than one of shuffled values does (no rise beyond the noise).
  """
  metric, labels, x_name = rule['metric'], list(rule['variants']), rule['x']
  groups = [seed_values(table, v, metric) for v in labels]
  xs = [mean_std(seed_values(table, v, x_name))[0] for v in labels]
  stats = [mean_std(g) for g in groups]
  shown = ', '.join(f'{label} {fmt(m, sd)}' for label, (m, sd) in zip(labels, stats))
  text = f'{metric} against ln {x_name}: {shown}'
  if not all(math.isfinite(v) for g in groups for v in g) or not all(x > 0 for x in xs):
    return Verdict(NOT_RUN, f'{text}; a logistic needs finite values and {x_name} > 0', dict(rule))
  if len({v for g in groups for v in g}) == 1:
    return Verdict(NOT_REPRODUCED, f'{text}; it does not change at all', dict(rule), {})
  rise = logistic.fit_rise(xs, groups)
  threshold, shape = float(rule['threshold']), rule['shape']
  call = 'jump' if rise.high < threshold else 'smooth' if rise.low > threshold else 'neither'
  numbers = {**dataclasses.asdict(rise), 'call': call}
  spread = (
    f'{logistic.LEVEL:.0%} interval over seeds {rise.low:.3g} to {rise.high:.3g}, {rise.resamples} '
    'resamples'
    if rise.resamples
    else 'one seed: no interval'
  )
  edge = ''
  if math.isclose(rise.midpoint, min(xs), rel_tol=1e-9) or math.isclose(
    rise.midpoint, max(xs), rel_tol=1e-9
  ):  # the fit would put it outside: the grid holds one side of the rise
    edge = ' (at the edge of the sizes: the rise is half outside them)'
  text += (
    f'; logistic 10-90% width {rise.width:.3g} e-folds of {x_name} ({spread}), midpoint '
    f'{x_name} {rise.midpoint:.3g}{edge}, change {rise.change:+.3g}, r2 {rise.r2:.3f}'
  )
  if rise.p_rise >= logistic.RISE_P:
    text += (
      f'; no rise beyond the noise: {rise.p_rise:.2f} of {logistic.SHUFFLES} shuffles of the '
      'values over the sizes fit a logistic as well'
    )
    return Verdict(INCONCLUSIVE, text, dict(rule), numbers)
  words = {'jump': f'below {threshold:.3g}: a jump', 'smooth': f'above {threshold:.3g}: smooth'}
  text += f'; the width is {words.get(call, f"across {threshold:.3g}: neither shown")}'
  if call == 'neither':
    return Verdict(INCONCLUSIVE, text, dict(rule), numbers)
  return Verdict(REPRODUCED if call == shape else NOT_REPRODUCED, text, dict(rule), numbers)


def monotone(rule: Mapping, table: Table) -> Verdict:
  variant = rule['variant']
  values = [seed_values(table, variant, m) for m in rule['metrics']]
  verdict = _steps(rule, list(rule['metrics']), values)
  return dataclasses.replace(verdict, text=f'{variant}: {verdict.text}')


def power_law_points(rule: Mapping, table: Table) -> tuple[list[str], list[float], list[float]]:
  """(labels, xs, ys) of a fit_power_law rule: finite, positive means only."""
  labels, xs, groups = _power_law_groups(rule, table)
  return labels, xs, [mean_std(g)[0] for g in groups]


def _power_law_groups(rule: Mapping, table: Table) -> tuple[list[str], list[float], list[list]]:
  """(labels, xs, each point's per-seed ys) of the points whose means are finite and positive."""
  if 'variant' in rule:
    variant, pairs = rule['variant'], zip(rule['xs'], rule['metrics'])
    raw = [(f'{variant} {m}', float(x), seed_values(table, variant, m)) for x, m in pairs]
  else:
    raw = []
    for v in rule.get('variants') or list(table):
      x = seed_values(table, v, rule['x'])
      raw.append((v, mean_std(x)[0] if x else None, seed_values(table, v, rule['y'])))
  good = [(label, x, y) for label, x, y in raw if x and y and x > 0 and mean_std(y)[0] > 0]
  good = [g for g in good if math.isfinite(g[1]) and all(map(math.isfinite, g[2]))]
  return [g[0] for g in good], [g[1] for g in good], [g[2] for g in good]


def fit_power_law(rule: Mapping, table: Table) -> Verdict:
  """A power law through the points' means: its slope against `slope_sign` or `slope_between`,
  and its r2 against `min_r2`. With two or more seeds at every point, the slope has a 95%
  interval (`estimates.bootstrap_interval`: the seeds within each point resampled, the law
  refitted): a condition holds when the whole interval meets it, fails when none of it does, and
  is inconclusive across. r2 is the means' fit's, judged as it is. One seed: the fitted slope."""
  labels, xs, groups = _power_law_groups(rule, table)
  ys = [mean_std(g)[0] for g in groups]
  if len(xs) < 3:
    return Verdict(NOT_RUN, f'needs >= 3 finite positive points to fit; has {len(xs)}', dict(rule))
  floor = rule.get('floor')
  if floor == 'free':
    fitter = estimates.fit_power_law_free_floor
  else:
    below = [(label, y) for label, y in zip(labels, ys) if y <= float(floor or 0.0)]
    if below:  # log(y - floor) does not exist: no power law above this floor
      text = f'{below[0][0]} has y = {fmt(below[0][1])}, not above the floor {floor:g}'
      return Verdict(NOT_REPRODUCED, text, dict(rule), {'points': dict(zip(labels, zip(xs, ys)))})
    fitter = functools.partial(estimates.fit_power_law, floor=float(floor or 0.0))
  fit = fitter(xs, ys)

  def slope(means):
    fine = floor == 'free' or all(m > float(floor or 0.0) for m in means)
    return fitter(xs, list(means))['slope'] if fine else math.nan

  interval = estimates.bootstrap_interval(groups, slope)
  seeded = min(map(len, groups)) >= 2  # ... and no draw fitted: no interval, nothing shown
  lo, hi = interval or ((-math.inf, math.inf) if seeded else (fit['slope'], fit['slope']))
  checks = []  # (status, words)
  if 'slope_sign' in rule:
    sign = float(np.sign(rule['slope_sign']))
    checks.append((_judged(sign * lo > 0, sign * hi <= 0), f'sign {rule["slope_sign"]:+d}'))
  if 'slope_between' in rule:
    low, high = rule['slope_between']
    checks.append(
      (_judged(low <= lo and hi <= high, hi < low or lo > high), f'in [{low:g}, {high:g}]')
    )
  if 'min_r2' in rule:
    ok = fit['r2'] >= rule['min_r2']
    checks.append((REPRODUCED if ok else NOT_REPRODUCED, f'r2 >= {rule["min_r2"]:g}'))
  statuses = [s for s, _ in checks]
  status = next((s for s in (NOT_REPRODUCED, INCONCLUSIVE) if s in statuses), REPRODUCED)
  if 'variant' in rule:  # within one variant: its metrics against the given x values
    y_name = f'{rule["variant"]} {rule["metrics"][0]} .. {rule["metrics"][-1]}'
    x_name = f'x = {", ".join(f"{x:g}" for x in rule["xs"])}'
  else:
    y_name, x_name = rule['y'], rule['x']
  if floor == 'free':
    y_name = f'({y_name} - E), E fitted = {fit["floor"]:.4g},'
  elif floor:
    y_name = f'({y_name} - {float(floor):g})'
  spread = f' (95% interval {lo:.3f} to {hi:.3f}, {_bootstrap_words("point")})' if interval else ''
  spread = spread or (' (no resample could be fitted)' if seeded else ' (one seed: no interval)')
  shown = ', '.join(
    f'{t} ({"no" if s == NOT_REPRODUCED else "unsure" if s == INCONCLUSIVE else "yes"})'
    for s, t in checks
  )
  text = (
    f'{y_name} ∝ ({x_name})^slope over {len(xs)} points: slope {fit["slope"]:.3f}{spread}, r2 '
    f'{fit["r2"]:.3f}; expected slope {shown or "(no condition)"}'
  )
  numbers = {**fit, 'points': dict(zip(labels, zip(xs, ys)))}
  if interval:
    numbers.update(low=lo, high=hi)
  return Verdict(status, text, dict(rule), numbers)


def _bootstrap_words(unit: str) -> str:
  return f'a bootstrap of the seeds at each {unit}, {estimates.RESAMPLES} resamples'


def _judged(holds: bool, fails: bool) -> str:
  return REPRODUCED if holds else NOT_REPRODUCED if fails else INCONCLUSIVE
