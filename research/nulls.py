"""A sweep's nulls: what a model that learns nothing scores, against which `research.verdicts`
judges every rule too. Each is a dict of `name`, `reason` (in words) and `values`
({variant: {metric: number or AS_RECORDED}}); see research/spec.py's `Sweep.nulls`."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# A null's value: the runs' own mean (a metric measured before any training), or with ': METRIC'
# that of another metric of the same variant (e.g. uniform attention scores what chance is), or
# with ': VARIANT METRIC' that of another variant (a positive control: what a rule finds in a model
# that has the skill the claim says the others lack).
AS_RECORDED = 'as recorded'


def check_nulls(
  nulls: Sequence[Mapping[str, Any]],
  rules: Sequence[Mapping[str, Any]] = (),
  variants: Sequence[str] | None = None,
  metrics: Sequence[str] | None = None,
) -> None:
  """Raises one ValueError for a null without a unique name, a reason or numeric values, one that
  names an unknown variant or metric, and for a rule whose `chance` names no null."""
  names = []
  for null in nulls:
    name = null.get('name') if isinstance(null, Mapping) else None
    if not isinstance(name, str) or not name or name in names:
      raise ValueError(f'null {null!r} needs a name (a string) unlike the other nulls')
    names.append(name)
    if 'generator' in null:
      _check_generator(name, null, variants, metrics)
      continue
    if sorted(null) != ['name', 'reason', 'values'] or not str(null['reason']).strip():
      raise ValueError(f"null {name!r} needs exactly 'name', 'reason' (in words) and 'values'")
    for variant, row in null['values'].items():
      if variants is not None and variant not in variants:
        raise ValueError(f'null {name!r} names variant {variant!r}; the variants are: '
                         f'{", ".join(variants)}')  # fmt: skip
      for metric, value in row.items():
        if metrics is not None and metric not in metrics:
          raise ValueError(f'null {name!r} names metric {metric!r}; the compared metrics are: '
                           f'{", ".join(metrics)}')  # fmt: skip
        source = _recorded(variant, metric, value)
        if source is None and (isinstance(value, bool) or not isinstance(value, int | float)):
          raise ValueError(
            f'null {name!r}: {variant} {metric}={value!r} must be a number, {AS_RECORDED!r}, '
            f"'{AS_RECORDED}: METRIC' or '{AS_RECORDED}: VARIANT METRIC'"
          )
        if source is not None and variants is not None and source[0] not in variants:
          raise ValueError(
            f'null {name!r}: {variant} {metric}={value!r} names variant {source[0]!r}; the '
            f'variants are: {", ".join(variants)}'
          )
  for rule in rules:
    if rule.get('chance') is not None and rule['chance'] not in names:
      raise ValueError(
        f'rule {rule.get("text") or rule["kind"]!r} has chance={rule["chance"]!r}; the '
        f"sweep's nulls are: {', '.join(names) or 'none'}"
      )


def decreasing_curves(
  table: Mapping[str, Mapping[str, Sequence]], rng: Any, metric: str, variants: Sequence[str]
) -> dict[str, dict[str, float]]:
  """One draw of a curve that only falls, in the range the runs span: the variants' values of
  `metric` are uniform draws between the lowest and highest recorded means, sorted from high to
  low in the order `variants` gives (a straight line in log N and a sigmoid are among them);
  the variants' other metrics as recorded."""
  means = [float(np.mean(table[v][metric])) for v in variants if (table.get(v) or {}).get(metric)]
  if len(means) < len(variants):
    return {}
  drawn = np.sort(rng.uniform(min(means), max(means), len(variants)))[::-1]
  recorded = {  # every other metric (the parameter count a fit is spaced by) as it was recorded
    v: {m: float(np.mean(xs)) for m, xs in table[v].items() if m != metric and xs} for v in variants
  }
  return {v: {**recorded[v], metric: float(x)} for v, x in zip(variants, drawn, strict=True)}


# name -> draw(table, rng, **args): {variant: {metric: value}}, one table of the null per draw.
GENERATORS = {'decreasing_curves': decreasing_curves}
FALSE_POSITIVE_RATE = 0.05  # a rule that holds on more draws of a generator does not count


def _check_generator(name: str, null: Mapping, variants, metrics) -> None:
  if (
    sorted(null) != ['args', 'draws', 'generator', 'name', 'reason']
    or not str(null['reason']).strip()
  ):
    raise ValueError(
      f"null {name!r} needs exactly 'name', 'reason', 'generator', 'args' and 'draws'"
    )
  if null['generator'] not in GENERATORS:
    raise ValueError(
      f'null {name!r}: generator {null["generator"]!r} is not one of {", ".join(GENERATORS)}'
    )
  if not isinstance(null['draws'], int) or null['draws'] < 100:
    raise ValueError(f'null {name!r}: draws={null["draws"]!r} must be an int >= 100')
  args = null['args']
  for variant in args.get('variants') or ():
    if variants is not None and variant not in variants:
      raise ValueError(f'null {name!r} names variant {variant!r}; the variants are: '
                       f'{", ".join(variants)}')  # fmt: skip
  if metrics is not None and args.get('metric') not in metrics:
    raise ValueError(f'null {name!r} names metric {args.get("metric")!r}; the compared metrics '
                     f'are: {", ".join(metrics)}')  # fmt: skip


def _recorded(variant: str, metric: str, value: Any) -> tuple[str, str] | None:
  """The (variant, metric) whose recorded mean an AS_RECORDED value stands for, else None."""
  if value == AS_RECORDED:
    return variant, metric
  if isinstance(value, str) and value.startswith(f'{AS_RECORDED}: '):
    words = value[len(AS_RECORDED) + 2 :].split()
    if len(words) in (1, 2):
      return (variant, words[0]) if len(words) == 1 else (words[0], words[1])
  return None


def resolve_null(null: Mapping[str, Any], table: Mapping[str, Mapping[str, Sequence]]) -> dict:
  """The null with each AS_RECORDED value replaced by the runs' mean (dropped when none ran); a
  generator's null as it is (it draws from the table when a rule is judged on it)."""
  if 'generator' in null:
    return dict(null)
  values = {}
  for variant, row in null['values'].items():
    for metric, value in row.items():
      source = _recorded(variant, metric, value)
      if source is not None:
        recorded = [v for v in (table.get(source[0]) or {}).get(source[1]) or [] if v is not None]
        recorded = [float(v) for v in recorded if not math.isnan(v)]  # NaN: not recorded
        value = sum(recorded) / len(recorded) if recorded else None
      if value is not None:
        values.setdefault(variant, {})[metric] = float(value)
  return {**null, 'values': values}


def task_losses(config: Any) -> dict[str, float]:
  """What a model that learns nothing scores per target token on the generated task of
  `config` (an experiment ConfigDict), from the task itself: 'uniform' = ln V and 'chance' = 1/V
  for the tokenizer's V ids (a uniform prediction, which an untrained model does no better
  than); for the grammar also
  'unigram' (the best model that ignores the context) and 'chain' (the entropy floor, which the
  previous word alone reaches), both in nats per token."""
  from transformer.config.experiment import Config

  experiment = Config.from_configdict(config)
  return dict(_task_losses(experiment.data, experiment.model.family))


@functools.cache
def _task_losses(data: Any, family: str) -> tuple[tuple[str, float], ...]:
  """`task_losses` of one typed data section, built once per process (about a second)."""
  from transformer.data import tasks

  info = tasks.build(data, family=family, workdir=None, seed=0).info
  found = {'uniform': math.log(info['vocab_size']), 'chance': 1 / info['vocab_size']}
  if 'unigram_entropy_per_token' in info:
    found |= {'unigram': info['unigram_entropy_per_token'], 'chain': info['entropy_per_token']}
  return tuple(found.items())
