"""Verdicts of the sweeps' claims, computed from the recorded numbers by rules stated as data.

A sweep file states each rule as a dict, for example
`dict(kind='less', metric='eval.loss', a='scaled', b='unscaled')`: "the final eval loss of
`scaled` is below that of `unscaled`: the 95% interval over seeds of the difference lies above 0".
`evaluate(rule, table)` applies it to `table[variant][metric] -> [one value per seed]` and returns
a `Verdict`; nothing here is ever written by hand. The kinds and their keys are in
`research.rules.KINDS`.

Any rule may add `where={'metric': m, 'value': v}`: only the variants whose every seed has m == v
take part (dropped from its lists; a rule whose `a`, `b` or `variant` fails it does not run).

A verdict can also be INCONCLUSIVE ("inconclusive at this budget"), never counted as reproduced
or not:
- any rule (`judge`) whose compared values have fewer than MIN_SEEDS (3) seeds, unless the rule
  says with `exact` why its values do not vary with the seed: one seed can mislead;
- a gap rule (`less`, `greater`, `no_worse`, `ordering`, `monotone`) with >= 2 seeds per variant
  whose effect's 95% interval over seeds (Welch's) lies across the least effect that counts (0
  unless the rule gives one): neither shown nor refuted; likewise `close` (a 90% interval, two
  one-sided tests), `ratio_between`, `best`/`worst` (every gap of the leader), and the curves'
  `fit_power_law` slope and `largest_step` share (bootstrap intervals, `research.curves`);
- a `sigmoid_width` rule whose interval of the width over seeds lies across its threshold, or
  whose rise a logistic fits no better than it fits shuffled values (no rise beyond the noise);
- a rule with `chance=NULL` whose every compared value is indistinguishable from that null's
  value of the same variant and metric (within `chance_tolerance`, and within 2 standard errors
  over seeds; one seed and no tolerance: 10% of it): an ordering among runs that learned nothing
  says nothing;
- a rule whose precondition does not hold (`judge`): a sweep's `preconditions` are rules with a
  `name`, such as "full attention learns the task"; a rule depends on the ones its `requires`
  lists, or on all of them when it has no `requires` (`requires=[]`: on none).

A sweep also declares its nulls: what a model that learns nothing scores (`Null`: an untrained
model, the task's best strategy without the skill the claim is about, or an analytic value with
its reason), as `values[variant][metric] -> one number`, or AS_RECORDED for a metric that an
untrained model scores as the runs did (one measured at step 0); `research.nulls` checks them.
`judge` evaluates every rule on
each null too: a rule that also holds on a null is BY_CONSTRUCTION, never counted as reproduced,
and a sweep whose rules that held all hold by construction is VACUOUS.

A sweep's `groups` name a variant chosen from several, such as an arm's best learning rate (as
Zoology tunes each architecture): {'p8_full': {'best_of': [variants], 'metric': m}} stands for the
member with the best mean of m (`best_of`); rules, preconditions and nulls may name the group.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from research import curves, estimates
from research import nulls as nulls_lib
from research.estimates import mean_std, t_interval, welch_interval
from research.nulls import resolve_null
from research.outcome import (
  BY_CONSTRUCTION,
  INCONCLUSIVE,
  NOT_COMPARED,
  NOT_REPRODUCED,
  NOT_RUN,
  REPRODUCED,
  VACUOUS,
  Table,
  Verdict,
  describe,
  fmt,
  lower_is_better,
  pair,
  seed_values,
)
from research.rules import check_rule

MIN_SEEDS = 3  # a rule counts (either way) only with this many seeds of every value it compares
WIDE_SEEDS = 5  # ... and a gap that holds with an interval wider than itself only with this many


# Groups: the best of several variants --------------------------------------------------------
def best_of(table: Table, groups: Mapping[str, Mapping[str, Any]]) -> tuple[dict, dict[str, str]]:
  """(`table` with a row per group, {group: the member whose row it copies}). A group stands
  for its member with the best mean of its metric over seeds (the lowest for a loss; the first of
  equals), every metric of that member; members without that metric do not take part, and a
  group with none has no row (its rules do not run)."""
  out, chosen = dict(table), {}
  for name, group in groups.items():
    sign = 1.0 if lower_is_better(group['metric']) else -1.0
    scored = []
    for i, member in enumerate(group['best_of']):
      values = seed_values(table, member, group['metric'])
      if values:
        scored.append((sign * mean_std(values)[0], i, member))
    if scored:
      chosen[name] = min(scored)[2]
      out[name] = table[chosen[name]]
  return out, chosen


def _missing(rule: Mapping, table: Table) -> Verdict | None:
  """NOT_RUN when a value the rule compares was never recorded (best, worst and fit_power_law
  skip the missing ones instead)."""
  if rule['kind'] in ('best', 'worst', 'fit_power_law'):
    return None
  pairs = _compared(rule, table)
  if 'variants' in rule and rule['kind'] != 'fit_power_law':  # as listed, even when none are left
    pairs = [(v, rule['metric']) for v in rule['variants']]
    pairs += [(v, rule['x']) for v in rule['variants'] if 'x' in rule]
  for variant, metric in pairs:
    if seed_values(table, variant, metric) is None:
      return Verdict(NOT_RUN, f'no recorded {metric} for variant {variant}', dict(rule))
  return None


# Rules -----------------------------------------------------------------------------------------
def _less_or_greater(rule: Mapping, table: Table) -> Verdict:
  """a below (less) or above (greater) b. The effect is b - a (less) or a - b (greater); the
  least effect that counts is `rel_margin` of |mean(b)|. With two or more seeds on each side, its
  95% interval (Welch's) must lie above that: wholly below it is not reproduced (the effect is
  absent, reversed or smaller than claimed), across it inconclusive. With one seed, the gap
  against the margin (default 2% of b); `judge` counts that only for an `exact` rule."""
  (a, metric_a), (b, metric_b) = pair(rule)
  va, vb = seed_values(table, a, metric_a), seed_values(table, b, metric_b)
  (ma, sa), (mb, sb) = mean_std(va), mean_std(vb)
  sign = 1.0 if rule['kind'] == 'less' else -1.0
  word = '<' if rule['kind'] == 'less' else '>'
  numbers = {'a': ma, 'b': mb, 'std_a': sa, 'std_b': sb, 'seeds_a': len(va), 'seeds_b': len(vb)}
  lhs, rhs = describe(a, metric_a, va), describe(b, metric_b, vb)
  if math.isinf(ma) or math.isinf(mb):  # a diverged run or an impossible length: no margin
    ok = sign * (mb - ma) > 0
    text = f'{lhs} {word} {rhs} (an infinite value is a run that diverged or could not run)'
    return Verdict(REPRODUCED if ok else NOT_REPRODUCED, text, dict(rule), numbers)
  gap = sign * (mb - ma) + 0.0  # + 0.0: no "-0" in the report
  interval = welch_interval(vb, va) if sign > 0 else welch_interval(va, vb)
  if interval is None:
    rel = float(rule.get('rel_margin', 0.02))
    margin = rel * abs(mb)
    numbers.update(gap=gap, margin=margin)
    ok = gap > margin
    text = (
      f'{lhs} {word} {rhs}: gap {fmt(gap)} {">" if ok else "<="} margin {fmt(margin)} '
      f'({rel:.0%} of {b}; one seed: no interval)'
    )
    return Verdict(REPRODUCED if ok else NOT_REPRODUCED, text, dict(rule), numbers)
  rel = float(rule.get('rel_margin', 0.0))
  least = rel * abs(mb)
  low, high = interval
  numbers.update(gap=gap, margin=least, low=low, high=high)
  if sa == sb == 0 and gap == 0 and not rule.get('exact'):  # e.g. no spike at any seed of either
    text = f'{lhs} {word} {rhs}: every seed of both has this one value, so no spread to judge by'
    return Verdict(INCONCLUSIVE, text, dict(rule), numbers)
  status = REPRODUCED if low > least else (NOT_REPRODUCED if high <= least else INCONCLUSIVE)
  named = (f'{a} {metric_a}', f'{b} {metric_b}') if a == b else (a, b)  # one variant, 2 metrics
  effect = f'{named[1]} - {named[0]}' if sign > 0 else f'{named[0]} - {named[1]}'
  against = f'{rel:.0%} of {b} = {fmt(least)}' if rel else '0'
  outcome = {REPRODUCED: 'above it', NOT_REPRODUCED: 'not above it',
             INCONCLUSIVE: "across it: within the seeds' noise"}  # fmt: skip
  text = (
    f'{lhs} {word} {rhs}: effect {effect} = {fmt(gap)}, 95% interval {fmt(low)} to {fmt(high)} '
    f'over seeds (Welch), against a least effect of {against}: {outcome[status]}'
  )
  return Verdict(status, text, dict(rule), numbers)


def _no_worse(rule: Mapping, table: Table) -> Verdict:
  """A no worse than B within `tolerance`. With two or more seeds on each side, a
  non-inferiority test: the 95% interval of mean(A) - mean(B) (Welch's) must lie on the better
  side of the tolerance; wholly on the worse side is not reproduced, across it inconclusive, so
  noise alone never passes it. One seed on either side: the means against the tolerance."""
  (a, metric_a), (b, metric_b) = pair(rule)
  va, vb = seed_values(table, a, metric_a), seed_values(table, b, metric_b)
  ma, mb = mean_std(va)[0], mean_std(vb)[0]
  lower = rule.get('lower_is_better', lower_is_better(metric_a))
  tol = float(rule.get('tolerance', 0.0))
  better = 'lower' if lower else 'higher'
  head = f'{describe(a, metric_a, va)} vs {describe(b, metric_b, vb)} ({better} is better'
  numbers = {'a': ma, 'b': mb}
  interval = welch_interval(va, vb)
  if interval is None:
    ok = ma <= mb + tol if lower else ma >= mb - tol
    text = f'{head}, tolerance {tol:g}): {a} is {"no worse" if ok else "worse"}'
    return Verdict(REPRODUCED if ok else NOT_REPRODUCED, text, dict(rule), numbers)
  low, high = interval
  worst, best = (high, low) if lower else (-low, -high)  # how much worse A is, at most / least
  status = REPRODUCED if worst <= tol else (NOT_REPRODUCED if best > tol else INCONCLUSIVE)
  word = {REPRODUCED: 'is no worse', NOT_REPRODUCED: 'is worse',
          INCONCLUSIVE: 'may be worse by more than it or not'}  # fmt: skip
  text = (
    f'{head}): {a} - {b} = {fmt(ma - mb)}, 95% interval {fmt(low)} to {fmt(high)} over seeds '
    f'(Welch), against a tolerance of {tol:g}: {a} {word[status]}'
  )
  return Verdict(status, text, dict(rule), {**numbers, 'low': low, 'high': high})


def _close(rule: Mapping, table: Table) -> Verdict:
  """|mean(A) - mean(B)| within the tolerance (`tolerance` + `rel_tolerance` of the larger
  |mean|). With two or more seeds on each side, an equivalence test (two one-sided tests at 5%):
  the 90% interval of the difference (Welch's) must lie inside +-tolerance; wholly outside it is
  not reproduced, across an end inconclusive, so that noise alone never shows two arms alike.
  One seed on either side: the difference of the means against the tolerance."""
  (a, metric_a), (b, metric_b) = pair(rule)
  va, vb = seed_values(table, a, metric_a), seed_values(table, b, metric_b)
  ma, mb = mean_std(va)[0], mean_std(vb)[0]
  rel = float(rule.get('rel_tolerance', 0.0)) * max(abs(ma), abs(mb))
  tol = float(rule.get('tolerance', 0.0)) + rel
  diff = ma - mb
  numbers = {'a': ma, 'b': mb, 'difference': abs(diff), 'tolerance': tol}
  head = f'{describe(a, metric_a, va)} vs {describe(b, metric_b, vb)}'
  interval = welch_interval(va, vb, level=0.90)
  if interval is None:
    ok = abs(diff) <= tol
    text = f'{head}: difference {fmt(abs(diff))} {"<=" if ok else ">"} tolerance {fmt(tol)}'
    return Verdict(REPRODUCED if ok else NOT_REPRODUCED, text, dict(rule), numbers)
  low, high = interval
  inside, outside = -tol <= low and high <= tol, high < -tol or low > tol
  status = REPRODUCED if inside else NOT_REPRODUCED if outside else INCONCLUSIVE
  word = {REPRODUCED: 'inside it: alike', NOT_REPRODUCED: 'outside it: they differ',
          INCONCLUSIVE: "across its edge: within the seeds' noise"}  # fmt: skip
  named = f'{a} {metric_a} - {metric_b}' if a == b else f'{a} - {b}'  # one variant, 2 metrics
  text = (
    f'{head}: {named} = {fmt(diff)}, 90% interval {fmt(low)} to {fmt(high)} over seeds '
    f'(Welch; two one-sided tests at 5%), against +-{fmt(tol)}: {word[status]}'
  )
  return Verdict(status, text, dict(rule), {**numbers, 'low': low, 'high': high})


def _variance_greater(rule: Mapping, table: Table) -> Verdict:
  """A's spread over seeds above `factor` times B's, by a one-sided F-test at 5%: the variance
  ratio must pass the F quantile of its seed counts (19 at 3 seeds each), so two variants of
  equal spread pass 5% of the time. A larger sample spread that is not significant is
  inconclusive; the ratio is reported with its 95% interval."""
  from scipy import stats

  a, b, metric = rule['a'], rule['b'], rule['metric']
  va, vb = seed_values(table, a, metric), seed_values(table, b, metric)
  if len(va) < 2 or len(vb) < 2:
    text = f'needs >= 2 seeds per variant for a std over seeds (has {len(va)} and {len(vb)})'
    return Verdict(NOT_RUN, text, dict(rule))
  sa, sb = mean_std(va)[1], mean_std(vb)[1]
  factor = float(rule.get('factor', 1.0))
  dfs = (len(va) - 1, len(vb) - 1)
  ratio = sa**2 / sb**2 if sb > 0 else math.inf
  needed = factor**2 * float(stats.f.ppf(0.95, *dfs))
  low, high = (ratio / float(stats.f.ppf(q, *dfs)) for q in (0.975, 0.025))
  status = REPRODUCED if ratio > needed else INCONCLUSIVE
  status = NOT_REPRODUCED if ratio <= factor**2 else status
  text = (
    f'std over seeds of {metric}: {a} {fmt(sa)}, {b} {fmt(sb)}; variance ratio {fmt(ratio)} '
    f'(95% interval {fmt(low)}-{fmt(high)}) against the {fmt(needed)} that {len(va)} and '
    f'{len(vb)} seeds need (one-sided F-test at 5%'
    + (f', factor {factor:g})' if factor != 1 else ')')
  )
  numbers = {'std_a': sa, 'std_b': sb, 'ratio': ratio, 'needed': needed}
  return Verdict(status, text, dict(rule), numbers)


def _ratio_between(rule: Mapping, table: Table) -> Verdict:
  """mean(A) / mean(B) inside [low, high]. With two or more seeds on each side, its 95% interval
  (`estimates.log_ratio_interval`; paired by seed when A and B are one variant's two metrics)
  must lie inside; wholly outside is not reproduced, across an end inconclusive. One seed: the
  ratio of the means."""
  (a, metric_a), (b, metric_b) = pair(rule)
  va, vb = seed_values(table, a, metric_a), seed_values(table, b, metric_b)
  ma, mb = mean_std(va)[0], mean_std(vb)[0]
  ratio = ma / mb if mb else math.inf
  low, high = float(rule['low']), float(rule['high'])
  head = f'{a} {metric_a} {fmt(ma)} / {b} {metric_b} {fmt(mb)} = {ratio:.3f}x'
  paired = a == b and len(va) == len(vb) and min(va + vb) > 0
  interval = estimates.log_ratio_interval(va, vb, paired=paired)
  if interval is None and min(len(va), len(vb)) >= 2:
    text = f'{head}: no interval for a ratio of means that are not both positive'
    return Verdict(INCONCLUSIVE, text, dict(rule), {'ratio': ratio})
  if interval is None:
    ok = low <= ratio <= high
    text = f'{head}, {"inside" if ok else "outside"} [{low:g}, {high:g}]'
    return Verdict(REPRODUCED if ok else NOT_REPRODUCED, text, dict(rule), {'ratio': ratio})
  lo, hi = interval
  inside, outside = low <= lo and hi <= high, hi < low or lo > high
  status = REPRODUCED if inside else NOT_REPRODUCED if outside else INCONCLUSIVE
  word = {REPRODUCED: 'inside', NOT_REPRODUCED: 'outside', INCONCLUSIVE: 'across an end of'}
  how = 'paired by seed' if paired else 'delta method on the log, Welch'
  text = (
    f'{head}, 95% interval {lo:.3g}x to {hi:.3g}x over seeds ({how}), {word[status]} '
    f'[{low:g}, {high:g}]'
  )
  return Verdict(status, text, dict(rule), {'ratio': ratio, 'low': lo, 'high': hi})


def _best_or_worst(rule: Mapping, table: Table) -> Verdict:
  """The best (or worst) mean among the variants is one of `expect`. With two or more seeds
  everywhere, an expected variant must beat every unexpected one, each gap's 95% interval
  (Welch's) clear of 0 (an intersection-union test: no correction for the number of gaps); one
  that beats every expected variant so is not reproduced; otherwise inconclusive."""
  metric = rule['metric']
  among = list(rule.get('among') or table)
  found = {v: seed_values(table, v, metric) for v in among}
  found = {v: values for v, values in found.items() if values}
  if not found:
    return Verdict(NOT_RUN, f'no recorded {metric} for {", ".join(among)}', dict(rule))
  means = {v: mean_std(values)[0] for v, values in found.items()}
  lower = rule.get('lower_is_better', lower_is_better(metric))
  pick_min = lower if rule['kind'] == 'best' else not lower
  winner = (min if pick_min else max)(means, key=lambda v: means[v])
  tied = [v for v in means if means[v] == means[winner]]  # e.g. a null that scores all alike
  shown = ', '.join(f'{v} {fmt(m, mean_std(found[v])[1])}' for v, m in means.items())
  text = (
    f'{rule["kind"]} {metric} ({"lower" if lower else "higher"} is better) among {shown}: '
    f'{" = ".join(tied) + " tie" if len(tied) > 1 else winner}; expected one of '
    f'{", ".join(rule["expect"])}'
  )
  numbers = {'winner': winner, **means}
  ok = winner in rule['expect'] and len(tied) == 1
  sign = 1.0 if pick_min else -1.0  # ahead(x, y): x's 95% interval clear of y's, the right way

  def ahead(x: str, y: str) -> bool:  # an infinite mean (a run that diverged or could not run)
    if not (math.isfinite(means[x]) and math.isfinite(means[y])):  # is compared as it is
      return sign * (means[y] - means[x]) > 0
    interval = welch_interval(found[y], found[x])  # y - x
    return interval is not None and min(sign * interval[0], sign * interval[1]) > 0

  if min(map(len, found.values())) < 2:
    return Verdict(REPRODUCED if ok else NOT_REPRODUCED, text, dict(rule), numbers)
  expected = [v for v in found if v in rule['expect']]
  others = [v for v in found if v not in rule['expect']]
  if any(all(ahead(e, o) for o in others) for e in expected):
    status, why = REPRODUCED, "ahead of every other beyond the seeds' noise (95% intervals)"
  elif any(all(ahead(o, e) for e in expected) for o in others):
    status, why = NOT_REPRODUCED, 'an unexpected variant is ahead of every expected one'
  else:
    status, why = INCONCLUSIVE, "the leaders are within the seeds' noise (95% intervals)"
  return Verdict(status, f'{text}; {why}', dict(rule), numbers)


def _threshold(rule: Mapping, table: Table) -> Verdict:
  metric, value = rule['metric'], float(rule['value'])
  above = rule['kind'] == 'at_least'
  if rule.get('interval'):  # the mean's 95% interval: (worst, best) ends; the worst must pass
    order, ok = (1 if above else -1), (lambda x: x >= value if above else x <= value)
    ends = {v: t_interval(seed_values(table, v, metric))[::order] for v in rule['variants']}
    sure, out = all(ok(w) for w, _ in ends.values()), not all(ok(b) for _, b in ends.values())
    shown = ', '.join(f'{v} {fmt(min(e))} to {fmt(max(e))}' for v, e in ends.items())
    text = f'95% interval of the mean {metric} {">=" if above else "<="} {value:g}: {shown}'
    status = NOT_REPRODUCED if out else REPRODUCED if sure else INCONCLUSIVE
    return Verdict(status, text, dict(rule), {v: sum(e) / 2 for v, e in ends.items()})
  if rule.get('every_seed'):  # the worst seed of each variant
    worst = min if above else max
    means = {v: float(worst(seed_values(table, v, metric))) for v in rule['variants']}
    what = f'{"lowest" if above else "highest"} {metric} over seeds'
  else:
    means = {v: mean_std(seed_values(table, v, metric))[0] for v in rule['variants']}
    what = metric
  failing = [v for v, m in means.items() if not (m >= value if above else m <= value)]
  shown = ', '.join(f'{v} {fmt(m)}' for v, m in means.items())
  text = f'{what} {">=" if above else "<="} {value:g} for each of {shown}'
  if failing:
    text += f'; fails for {", ".join(failing)}'
  return Verdict(NOT_REPRODUCED if failing else REPRODUCED, text, dict(rule), means)


_EVALUATORS = {
  'less': _less_or_greater,
  'greater': _less_or_greater,
  'no_worse': _no_worse,
  'close': _close,
  'ordering': curves.ordering,
  'largest_step': curves.largest_step,
  'sigmoid_width': curves.sigmoid_width,
  'monotone': curves.monotone,
  'variance_greater': _variance_greater,
  'fit_power_law': curves.fit_power_law,
  'ratio_between': _ratio_between,
  'best': _best_or_worst,
  'worst': _best_or_worst,
  'at_least': _threshold,
  'at_most': _threshold,
}


def _passes(table: Table, variant: str, where: Mapping) -> bool:
  values = (table.get(variant) or {}).get(where['metric']) or []
  return bool(values) and all(v is not None and v == where['value'] for v in values)


def _apply_where(rule: Mapping, table: Table) -> tuple[dict, Table, Verdict | None]:
  """The rule and table restricted to the variants that pass rule['where'] (see the module
  docstring), or a NOT_RUN verdict when a variant the rule compares directly fails it."""
  where = rule['where']
  condition = f'{where["metric"]} = {where["value"]:g} at every seed'
  failing = sorted(v for v in table if not _passes(table, v, where))
  named = [rule[k] for k in ('a', 'b', 'variant') if k in rule]
  unknown = [v for v in named if not (table.get(v) or {}).get(where['metric'])]
  if unknown:
    text = f'no recorded {where["metric"]} for variant {unknown[0]}, the condition of where'
    return dict(rule), table, Verdict(NOT_RUN, text, dict(rule))
  out = [v for v in named if v in failing]
  if out:
    text = f'{NOT_COMPARED}: {", ".join(out)} fails the condition {condition}'
    return dict(rule), table, Verdict(NOT_RUN, text, dict(rule))
  kept = dict(rule)
  for key in ('variants', 'among'):
    if key in rule:
      kept[key] = [v for v in rule[key] if v not in failing]
  return kept, {v: m for v, m in table.items() if v not in failing}, None


def _compared(rule: Mapping, table: Table) -> list[tuple[str, str]]:
  """The (variant, metric) pairs whose values a rule compares."""
  if rule['kind'] == 'monotone':
    return [(rule['variant'], m) for m in rule['metrics']]
  if rule['kind'] == 'fit_power_law':
    if 'variant' in rule:
      return [(rule['variant'], m) for m in rule['metrics']]
    return [(v, rule['y']) for v in rule.get('variants') or list(table)]
  if 'a' in rule:
    (a, metric_a), (b, metric_b) = pair(rule)
    return [(a, metric_a), (b, metric_b)]
  names = rule.get('variants') or rule.get('among') or list(table)
  return [(v, rule['metric']) for v in names]


def _at_chance(rule: Mapping, table: Table, nulls: Mapping[str, Mapping]) -> str | None:
  """Words saying that every value the rule compares is indistinguishable from the value of the
  null rule['chance'] for the same variant and metric, or None when one is not (or the rule
  names no chance)."""
  name = rule.get('chance')
  if name is None:
    return None
  if name not in nulls:
    shown = ', '.join(nulls) or 'none'
    raise ValueError(f"rule has chance={name!r}, which is not one of the sweep's nulls: {shown}")
  shown = []
  for variant, metric in _compared(rule, table):
    values = seed_values(table, variant, metric)
    chance = (nulls[name].get(variant) or {}).get(metric)
    if not values or chance is None:
      continue
    mean, std = mean_std(values)
    tolerance = rule.get('chance_tolerance')
    if len(values) >= 2:
      noise = 2 * std / math.sqrt(len(values))  # 2 standard errors of the mean
      tolerance = max(float(tolerance or 0.0), noise)
    elif tolerance is None:
      tolerance = 0.1 * abs(chance)
    if not abs(mean - chance) <= float(tolerance):
      return None
    shown.append(f'{variant} {fmt(mean, std)} (null {fmt(chance)})')
  if not shown:
    return None
  return f'every compared value is at chance (the null {name!r}): {", ".join(shown)}'


def evaluate(
  rule: Mapping[str, Any], table: Table, nulls: Mapping[str, Mapping] | None = None
) -> Verdict:
  """Applies one rule (see `rules.KINDS`) to `table[variant][metric] -> per-seed values`; `nulls`
  (name -> values[variant][metric]) are the chance levels a rule's `chance` may name."""
  check_rule(rule)
  kept = rule
  if rule.get('where') is not None:
    kept, table, skipped = _apply_where(rule, table)
    if skipped is not None:
      return skipped
  verdict = _missing(kept, table) or _EVALUATORS[rule['kind']](kept, table)
  verdict = dataclasses.replace(verdict, rule=dict(rule))
  if verdict.status in (REPRODUCED, NOT_REPRODUCED):
    chance = _at_chance(rule, table, nulls or {})
    if chance is not None:
      text = f'{chance}; had it counted: {verdict.status}, {verdict.text}'
      return dataclasses.replace(verdict, status=INCONCLUSIVE, text=text)
  return verdict


# Nulls -----------------------------------------------------------------------------------------
def on_null(rule: Mapping[str, Any], table: Table, null: Mapping[str, Any]) -> Verdict | None:
  """The rule evaluated on the null's values (one 'seed' each), or None when the null does not
  record every value the rule compares in `table`."""
  values = null['values']
  if any(m not in (values.get(v) or {}) for v, m in _compared(rule, table)):
    return None
  if rule.get('where') is not None and any(
    rule['where']['metric'] not in (values.get(v) or {}) for v, _ in _compared(rule, table)
  ):
    return None
  plain = {k: v for k, v in rule.items() if k not in ('chance', 'chance_tolerance', 'requires')}
  nulled = {v: {m: [x] for m, x in row.items()} for v, row in values.items()}
  if 'x' in rule:  # the spacing (a model's size, say) is the variant's unless the null gives it
    for variant in rule.get('variants') or ():
      nulled.setdefault(variant, {}).setdefault(rule['x'], seed_values(table, variant, rule['x']))
  verdict = evaluate(plain, nulled)
  return None if verdict.status == NOT_RUN else verdict


def against_nulls(verdict: Verdict, table: Table, nulls: Sequence[Mapping[str, Any]]) -> Verdict:
  """The verdict with the rule's outcome on each null in words; a rule that held is
  BY_CONSTRUCTION when it holds on a null too."""
  if not nulls:
    return dataclasses.replace(verdict, null='the sweep declares no null')
  words = {REPRODUCED: 'holds', NOT_REPRODUCED: 'fails'}
  parts, built = [], False
  for n in nulls:
    if 'generator' in n:
      rate = false_positive_rate(verdict.rule, table, n)
      if rate is not None:
        counts = rate <= nulls_lib.FALSE_POSITIVE_RATE
        then = '(at most 5%: it counts)' if counts else '(more than 5%: it would hold anyway)'
        parts.append(f'{n["name"]}: holds in {rate:.1%} of {n["draws"]} draws {then}')
        built = built or not counts
      continue
    v = on_null(verdict.rule, table, n)
    if v is not None:
      parts.append(f'{n["name"]}: {words.get(v.status, v.status)}, {v.text}')
      built = built or v.status == REPRODUCED
  if not parts:
    return dataclasses.replace(verdict, null='no null records the values it compares')
  status = BY_CONSTRUCTION if verdict.status == REPRODUCED and built else verdict.status
  return dataclasses.replace(verdict, status=status, null='; '.join(parts))


def false_positive_rate(rule: Mapping[str, Any], table: Table, null: Mapping[str, Any]):
  """The share of a generator null's draws (`research.nulls.GENERATORS`, seeded) on which the
  rule holds, or None when its draws do not give every value the rule compares."""
  draw = nulls_lib.GENERATORS[null['generator']]
  rng = np.random.default_rng(0)
  held = []
  for _ in range(null['draws']):
    v = on_null(rule, table, {'values': draw(table, rng, **null['args'])})
    if v is None:
      return None
    held.append(v.status == REPRODUCED)
  return float(np.mean(held))


def judge(
  rules: Sequence[Mapping[str, Any]],
  table: Table,
  preconditions: Sequence[Mapping[str, Any]] = (),
  nulls: Sequence[Mapping[str, Any]] = (),
  groups: Mapping[str, Mapping[str, Any]] | None = None,
) -> tuple[list[Verdict], list[Verdict]]:
  """(the preconditions' verdicts, the rules' verdicts). A rule whose precondition (the ones its
  `requires` names, else all) did not hold is INCONCLUSIVE, its own outcome given in words; each
  rule is also evaluated on every null (`against_nulls`). `groups` (`best_of`) join the table
  first, so that rules may compare them."""
  table = best_of(table, groups or {})[0]
  nulls = [resolve_null(n, table) for n in nulls]
  named = {n['name']: n['values'] for n in nulls if 'values' in n}
  pre = {p['name']: evaluate(p, table, named) for p in preconditions}
  found = []
  for rule in rules:
    verdict = evaluate(rule, table, named)
    needs = list(pre) if rule.get('requires') is None else rule['requires']  # []: none
    failed = [n for n in needs if pre[n].status != REPRODUCED]
    if failed and verdict.status != NOT_RUN:
      name = failed[0]
      why = 'does not hold' if pre[name].status == NOT_REPRODUCED else f'is {pre[name].status}'
      text = (
        f'precondition {name!r} {why} ({pre[name].text}); had it counted: {verdict.status}, '
        f'{verdict.text}'
      )
      verdict = dataclasses.replace(verdict, status=INCONCLUSIVE, text=text)
    found.append(_too_few_seeds(against_nulls(verdict, table, nulls), table))
  return list(pre.values()), found


def _too_few_seeds(verdict: Verdict, table: Table) -> Verdict:
  """INCONCLUSIVE, its outcome in words, for a verdict either way on fewer than MIN_SEEDS seeds
  of a value it compares (one seed can mislead; an `exact` rule, whose values do not vary with
  the seed, counts on one unless its seeds differ after all), and for a `less` or `greater` that
  holds with a 95% interval wider than its effect on fewer than WIDE_SEEDS."""
  if verdict.status not in (REPRODUCED, NOT_REPRODUCED):
    return verdict
  rule, where = verdict.rule, verdict.rule.get('where') is not None
  rule, table = _apply_where(rule, table)[:2] if where else (rule, table)
  values = [v for v in (seed_values(table, v, m) for v, m in _compared(rule, table)) if v]
  seeds, n = min(map(len, values), default=0), verdict.numbers
  why = f'{seeds} seed{"s" if seeds != 1 else ""}: a verdict needs {MIN_SEEDS}'
  if seeds >= MIN_SEEDS:
    wide = {'low', 'gap'} <= set(n) and n['high'] - n['low'] > n['gap']
    if verdict.status != REPRODUCED or not wide or seeds >= WIDE_SEEDS:
      return verdict
    why = f'its 95% interval is wider than its effect at {seeds} seeds: it needs {WIDE_SEEDS}'
  elif rule.get('exact') and all(len(set(v)) == 1 for v in values):
    return verdict
  elif rule.get('exact'):
    why += ' (the rule is marked exact, but its seeds differ)'
  text = f'{why}; had it counted: {verdict.status}, {verdict.text}'
  return dataclasses.replace(verdict, status=INCONCLUSIVE, text=text)


def overall(verdicts: Sequence[Verdict]) -> str:
  """A claim's status from its rules: not reproduced if any rule fails, else inconclusive if any
  rule is, else reproduced if any rule held that could have failed (rules that could not run or
  hold by construction are listed with it), else vacuous if rules held by construction only,
  else not run."""
  statuses = [v.status for v in verdicts]
  for status in (NOT_REPRODUCED, INCONCLUSIVE, REPRODUCED):
    if status in statuses:
      return status
  return VACUOUS if BY_CONSTRUCTION in statuses else NOT_RUN
