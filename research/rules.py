"""The rules of a sweep's verdicts as data: each kind with its keys (`KINDS`), and the checks a
sweep file's rules, preconditions and groups pass when it loads, before anything runs.
`research.verdicts` applies them to the recorded numbers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# kind -> (required keys, optional keys). Common optional keys: 'text' (the claim in words).
KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
  # mean(a) < mean(b): with >= 2 seeds each, the 95% interval of the effect mean(b) - mean(a)
  # (Welch's) lies above rel_margin * |mean(b)| (the least effect that counts, default 0); with
  # one seed, the gap exceeds rel_margin * |b| (default 2%).
  'less': (('metric', 'a', 'b'), ('metric_a', 'metric_b', 'rel_margin')),
  'greater': (('metric', 'a', 'b'), ('metric_a', 'metric_b', 'rel_margin')),
  # a is no worse than b, up to `tolerance` (absolute); the direction comes from the metric.
  'no_worse': (('metric', 'a', 'b'), ('metric_a', 'metric_b', 'tolerance', 'lower_is_better')),
  # |mean(a) - mean(b)| <= tolerance (absolute) or rel_tolerance * max(|a|, |b|).
  'close': (('metric', 'a', 'b'), ('metric_a', 'metric_b', 'tolerance', 'rel_tolerance')),
  # the means over `variants` (one metric), in the listed order, rise (or fall) step by step.
  # With >= 2 seeds each step's 95% interval (Welch's) must lie on the rising side of 0.
  'ordering': (('metric', 'variants'), ('direction', 'tolerance')),
  # within one variant, the metrics in the listed order rise (or fall) step by step.
  'monotone': (('variant', 'metrics'), ('direction', 'tolerance')),
  # the std over seeds of a exceeds factor x that of b (needs >= 2 seeds).
  'variance_greater': (('metric', 'a', 'b'), ('factor',)),
  # least-squares fit log y = log c + slope * log x, across variants (x, y metrics) or within one
  # variant (x values, y metrics); checks slope_sign and/or slope_between. floor=E fits
  # log(y - E) instead (a power law above an irreducible loss E); floor='free' also fits E.
  'fit_power_law': (
    (),
    tuple('variants x y variant xs metrics slope_sign slope_between min_r2 floor'.split()),
  ),
  # mean(a) / mean(b) lies in [low, high].
  'ratio_between': (('metric', 'a', 'b', 'low', 'high'), ('metric_a', 'metric_b')),
  # the best (or worst) mean of `metric` among `among` (default all) is one of `expect`.
  'best': (('metric', 'expect'), ('among', 'lower_is_better')),
  'worst': (('metric', 'expect'), ('among', 'lower_is_better')),
  # across `variants` in order (model sizes, say), the largest change of the mean of `metric`
  # between neighbours as a share of all the changes (the sum of their sizes): at_least_share
  # asks for a jump, at_most_share for a smooth curve; min_step: that change is also >= this;
  # expect_at: the variant the largest step leads to (e.g. the second: the first gain is largest).
  # x: a recorded metric (e.g. 'params'); each change counts per e-fold of it, as if the variants
  # were evenly spaced in log x. With >= 2 seeds, a share whose 95% interval (a bootstrap of the
  # seeds) holds the threshold is inconclusive, a jump's or a smooth's.
  'largest_step': (
    ('metric', 'variants'),
    ('at_least_share', 'at_most_share', 'min_step', 'expect_at', 'x'),
  ),
  # how abruptly `metric` rises with x (a recorded metric, e.g. 'params') across `variants`: the
  # 10-90% width in e-folds of x of the least-squares logistic in ln x through every seed's value,
  # with its 95% interval over seeds (research.logistic). shape='jump': the interval lies below
  # `threshold` (e-folds); shape='smooth': above it. An interval across it, or a curve that a
  # logistic fits no better than shuffled values, is inconclusive. Sizes added inside the rise
  # sharpen the width without moving it (largest_step's shares fall as the rise gets more points).
  'sigmoid_width': (('metric', 'variants', 'x', 'shape', 'threshold'), ()),
  # every listed variant's mean is >= (at_least) or <= (at_most) `value`; every_seed=True: its
  # worst seed is (the minimum for at_least, the maximum for at_most); interval=True: the mean's
  # 95% interval over seeds lies wholly on that side (wholly on the other: fails; across it:
  # inconclusive).
  'at_least': (('metric', 'variants', 'value'), ('every_seed', 'interval')),
  'at_most': (('metric', 'variants', 'value'), ('every_seed', 'interval')),
}
# exact: why the compared values do not vary with the seed (a compiled program's memory, a
# parameter count), so that one seed may give a counted verdict (`verdicts.MIN_SEEDS`).
COMPILED_MEMORY = (
  "XLA's compiled temporary memory of one program: the seed changes the parameters' values, "
  'not the program, so every seed compiles to the same bytes'
)
COMMON = ('kind', 'text', 'where', 'chance', 'chance_tolerance', 'requires', 'name', 'exact')


def check_rule(rule: Mapping[str, Any], variants: Sequence[str] | None = None) -> None:
  """Raises one ValueError for an unknown kind, a missing or unknown key, or (when `variants` is
  given) a variant that is not one of them."""
  kind = rule.get('kind')
  if kind not in KINDS:
    raise ValueError(f'rule kind={kind!r} is not valid; choose one of {", ".join(KINDS)}')
  required, optional = KINDS[kind]
  missing = [k for k in required if k not in rule]
  if missing:
    raise ValueError(f'rule {dict(rule)} of kind {kind!r} needs the key {missing[0]!r}')
  unknown = sorted(set(rule) - set(required) - set(optional) - set(COMMON))
  if unknown:
    valid = ', '.join(required + optional + COMMON)
    raise ValueError(f'rule of kind {kind!r} has unknown key {unknown[0]!r}; valid keys: {valid}')
  named = [rule[k] for k in ('a', 'b', 'variant') if k in rule]
  for key in ('variants', 'among', 'expect'):
    named += list(rule.get(key) or [])
  for name in named:
    if variants is not None and name not in variants:
      raise ValueError(
        f'rule {kind!r} names variant {name!r}, which the sweep does not have; '
        f'its variants are: {", ".join(variants)}'
      )
  if kind == 'largest_step' and not {'at_least_share', 'at_most_share', 'expect_at'} & set(rule):
    raise ValueError("rule 'largest_step' needs at_least_share, at_most_share or expect_at")
  if (
    kind == 'largest_step'
    and rule.get('expect_at', rule['variants'][1]) not in rule['variants'][1:]
  ):
    raise ValueError(
      f"rule 'largest_step' has expect_at={rule['expect_at']!r}; a step leads to one of "
      f'{", ".join(rule["variants"][1:])}'
    )
  if kind == 'sigmoid_width':
    if rule['shape'] not in ('jump', 'smooth'):
      raise ValueError(f"sigmoid_width: shape={rule['shape']!r} must be 'jump' or 'smooth'")
    threshold = rule['threshold']
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or threshold <= 0:
      raise ValueError(f'sigmoid_width: threshold={threshold!r} must be a number of e-folds > 0')
    if len(rule['variants']) < 4:
      raise ValueError('sigmoid_width needs >= 4 variants: a logistic has 4 parameters')
  if kind == 'fit_power_law':
    across = 'x' in rule and 'y' in rule
    within = 'variant' in rule and 'xs' in rule and 'metrics' in rule
    if across == within:
      raise ValueError(
        "rule 'fit_power_law' needs either x and y (metrics, across variants) or variant, xs "
        '(x values) and metrics (one per x value), not both or neither'
      )
    if within and len(rule['xs']) != len(rule['metrics']):
      raise ValueError(
        f'fit_power_law: xs {rule["xs"]} and metrics {rule["metrics"]} differ in size'
      )
  floor = rule.get('floor')
  if floor is not None and floor != 'free' and not isinstance(floor, int | float):
    raise ValueError(f"fit_power_law: floor={floor!r} must be a number or 'free'")
  where = rule.get('where')
  if where is not None and (
    not isinstance(where, Mapping)
    or set(where) != {'metric', 'value'}
    or not isinstance(where['value'], int | float)
  ):
    raise ValueError(f"where={where!r} must be {{'metric': a metric, 'value': a number}}")
  if rule.get('direction', 'increasing') not in ('increasing', 'decreasing'):
    raise ValueError(f"direction={rule['direction']!r} must be 'increasing' or 'decreasing'")
  chance = rule.get('chance')
  if chance is not None and not isinstance(chance, str):
    raise ValueError(
      f"chance={chance!r} must name one of the sweep's nulls (chance is what a model that learns "
      'nothing scores, not 1/vocabulary); runs judged by older rules: python -m '
      'experiments.report --workdir=DIR --rejudge'
    )
  exact = rule.get('exact')
  if exact is not None and (not isinstance(exact, str) or not exact.strip()):
    raise ValueError(
      f'exact={exact!r} must say why the values do not vary with the seed (a sentence)'
    )
  value = rule.get('chance_tolerance')
  if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
    raise ValueError(f'chance_tolerance={value!r} must be a number')
  if rule.get('chance_tolerance') is not None and 'chance' not in rule:
    raise ValueError('chance_tolerance needs chance (the null whose values are chance)')
  requires = rule.get('requires')
  if requires is not None and (
    isinstance(requires, str) or not all(isinstance(n, str) for n in requires)
  ):
    raise ValueError(f'requires={requires!r} must be a list of precondition names')


def check_preconditions(
  preconditions: Sequence[Mapping[str, Any]],
  rules: Sequence[Mapping[str, Any]],
  variants: Sequence[str] | None = None,
  metrics: Sequence[str] | None = None,
) -> None:
  """Raises one ValueError for a precondition without a unique `name`, one that names an unknown
  variant, or (when `metrics` is given) a metric the sweep does not record, and for a rule whose
  `requires` names no precondition."""
  names = []
  for pre in preconditions:
    check_rule(pre, variants)
    name = pre.get('name')
    if not isinstance(name, str) or not name:
      raise ValueError(f'precondition {dict(pre)} needs a name (a string) for rules to require')
    if name in names:
      raise ValueError(f'two preconditions are named {name!r}; names must be unique')
    if pre.get('requires'):
      raise ValueError(f'precondition {name!r} has requires: preconditions do not chain')
    names.append(name)
    if metrics is not None:
      for metric in rule_metrics(pre):
        if metric not in metrics:
          raise ValueError(
            f'precondition {name!r} names metric {metric!r}, which the sweep does not record; '
            f'its metrics are: {", ".join(metrics)}'
          )
  for rule in rules:
    check_rule(rule, variants)
    for name in rule.get('requires') or ():
      if name not in names:
        shown = ', '.join(names) or 'none'
        raise ValueError(
          f'rule {rule.get("text") or rule["kind"]!r} requires precondition {name!r}; the '
          f"sweep's preconditions are: {shown}"
        )


def rule_metrics(rule: Mapping[str, Any]) -> list[str]:
  """The metrics a rule reads (its `where` condition included)."""
  found = [rule[k] for k in ('metric', 'metric_a', 'metric_b', 'x', 'y') if k in rule]
  found += list(rule.get('metrics') or [])
  if rule.get('where'):
    found.append(rule['where']['metric'])
  return list(dict.fromkeys(found))


def check_groups(groups: Mapping[str, Mapping[str, Any]], variants: Sequence[str]) -> None:
  """Raises one ValueError for a group named like a variant, without exactly 'best_of' (a
  non-empty list of the sweep's variants) and 'metric' (and optionally 'grid': True, for members
  that are a grid of one setting in order, such as rates), or naming an unknown variant."""
  for name, group in groups.items():
    if name in variants:
      raise ValueError(f'group {name!r} has the name of a variant; name it unlike the variants')
    keys = sorted(set(group) - {'grid'}) if isinstance(group, Mapping) else None
    if keys != ['best_of', 'metric'] or group.get('grid', True) is not True:
      raise ValueError(
        f"group {name!r} needs exactly 'best_of' (variants) and 'metric', and may add 'grid': True"
      )
    if not group['best_of'] or isinstance(group['best_of'], str):
      raise ValueError(f'group {name!r}: best_of={group["best_of"]!r} must list variants')
    unknown = [v for v in group['best_of'] if v not in variants]
    if unknown:
      raise ValueError(
        f'group {name!r} names variant {unknown[0]!r}; the variants are: {", ".join(variants)}'
      )
