"""What a rule's verdict is made of: its statuses, the `Verdict`, and the per-seed values it reads
from a table (`table[variant][metric] -> [one value per seed]`), shared by `research.verdicts`
and the curve rules in `research.curves`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from research.estimates import mean_std

REPRODUCED = 'reproduced'
NOT_REPRODUCED = 'not reproduced at this scale'
NOT_RUN = 'not run'
# How a NOT_RUN verdict begins when the rule's `where` left out an arm it names (the data exist).
NOT_COMPARED = 'not compared'
INCONCLUSIVE = 'inconclusive at this budget'
BY_CONSTRUCTION = 'holds by construction'  # it holds on a null too: it could not have failed
VACUOUS = 'vacuous'  # every rule that held holds by construction

Table = Mapping[str, Mapping[str, Sequence[float]]]  # variant -> metric -> per-seed values

_LOWER_IS_BETTER_WORDS = ('loss', 'perplexity', 'nll', '_ms', 'ms@', 'mib', 'time', 'rise', 'std')


@dataclasses.dataclass(frozen=True)
class Verdict:
  """The outcome of one rule: `status` (REPRODUCED | NOT_REPRODUCED | INCONCLUSIVE | NOT_RUN)
  and its numbers."""

  status: str
  text: str  # the comparison with its numbers, in words
  rule: dict
  numbers: dict = dataclasses.field(default_factory=dict)
  null: str = ''  # the rule on the sweep's nulls, in words (`judge`)

  @property
  def reproduced(self) -> bool:
    return self.status == REPRODUCED


def lower_is_better(metric: str) -> bool:
  """Whether smaller values of `metric` are better: losses, perplexities, times, memory."""
  return any(word in metric.lower() for word in _LOWER_IS_BETTER_WORDS)


def seed_values(table: Table, variant: str, metric: str) -> list[float] | None:
  """The per-seed values, or None when the variant or metric has none. NaN counts as missing."""
  values = [v for v in (table.get(variant) or {}).get(metric) or [] if v is not None]
  values = [float(v) for v in values if not (isinstance(v, float) and math.isnan(v))]
  return values or None


def fmt(value: float, std: float | None = None) -> str:
  """A number for the report: 4 significant digits, with ± std when there are several seeds."""
  if value is None or (isinstance(value, float) and math.isnan(value)):
    return 'n/a'
  text = 'inf' if math.isinf(value) else f'{value:.4g}'
  if std is not None and std > 0 and math.isfinite(std):
    text += f' ± {std:.2g}'
  return text


def describe(variant: str, metric: str, values: list[float]) -> str:
  mean, std = mean_std(values)
  return f'{variant} {metric} = {fmt(mean, std)}'


def pair(rule: Mapping) -> tuple[tuple[str, str], tuple[str, str]]:
  return (rule['a'], rule.get('metric_a', rule['metric'])), (
    rule['b'],
    rule.get('metric_b', rule['metric']),
  )
