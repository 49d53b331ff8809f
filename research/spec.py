"""A sweep as its file states it: `Sweep`, loading a sweep file, its variants' configs, and the
checks that run before anything trains."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import itertools
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections

from research import measures, nulls, report
from research import rules as rules_lib
from transformer.config.experiment import Config, apply_overrides
from transformer.training import optim
from transformer.training.state import optim_config

SWEEPS_DIR = os.path.join('configs', 'sweeps')
_NAME = re.compile(r'[A-Za-z0-9_.+=-]+')  # variant names become directory names
_FIELDS = (
  'name', 'claim', 'base', 'overrides', 'variants', 'axes', 'metrics', 'rule', 'rules', 'measure',
  'measure_args', 'train', 'eval_variants', 'plots', 'description', 'preconditions', 'nulls',
  'groups',
)  # fmt: skip

# The paper's rsqrt schedule (peak 0.0051 at step 300), which several sweeps' results were run
# with; configs/default.py itself uses warmup_cosine (see configs/sweeps/default_recipe.py).
PAPER_SCHEDULE = {'optim.schedule': 'rsqrt', 'optim.learning_rate': 1.0, 'optim.warmup_steps': 300}


@dataclasses.dataclass(frozen=True)
class Sweep:
  """A sweep as its file states it (see configs/sweeps/*.py for examples).

  Attributes:
    name: short name, also the report's title.
    claim: the claim under test, in one sentence.
    base: the base config: a path ('configs/gpt_tiny.py'), a module ('configs.gpt_tiny') or a
      function returning a ConfigDict.
    variants: variant name -> {dotted config key: value}; names become directory names.
    overrides: {dotted key: value} applied to every variant first.
    metrics: the metrics compared in the report (e.g. 'eval.loss', 'train.nll', measure keys).
    rules: the verdict rules (`research.rules.KINDS`); the claim holds if all hold.
    preconditions: rules with a `name` that must hold for the rules to count, such as "full
      attention learns the task"; a rule that `requires` a failed one (or any, when it lists
      none) is inconclusive at this budget. Their metrics must be among `metrics`.
    nulls: what a model that learns nothing scores, each a dict of `name`, `reason` (in words:
      an untrained model, the task's best strategy without the skill under test, or an analytic
      value and why) and `values` ({variant: {metric: number, or 'as recorded' for one measured
      before any training}}); `research.nulls` checks them. Every rule is evaluated on them
      too; one that also holds on a null holds by construction and is not counted. A null may
      instead be a generator (`generator`: a name in `research.nulls.GENERATORS`, its `args`
      and `draws`): the rule is judged on each draw, and one that holds on more than 5% of
      them does not count either. A rule's
      `chance` names one of them.
    groups: name -> {'best_of': [variants], 'metric': m}: a variant chosen after the runs, the
      member with the best mean of m (e.g. an arm's best learning rate); rules, preconditions,
      nulls and plots may name it like a variant (`research.verdicts.best_of`).
    measure: a function `measure(ctx: MeasureContext, **measure_args) -> dict` run after training
      (or instead of it when `train` is False): a name defined in the sweep file or in
      `research.measures.MEASURES`. Its numbers join the run's metrics; a list under the key
      'figures' names PNG files (relative to the run directory) for the report.
    measure_args: keyword arguments of `measure`.
    train: whether each run trains (False: the measure only, e.g. memory and time benchmarks).
    eval_variants: name -> {'from': a trained variant, 'overrides': {dotted key: value}}: no
      training of its own; `measure` runs on the checkpoint of `from` with the overrides applied,
      which must change only the compute (e.g. model.rope_scaling at test time).
    plots: extra report plots (`research.report.PLOT_KINDS`).
    description: what the sweep does and how its numbers are defined, for the report.
    path: the sweep file; scale: the --scale it was built for.
  """

  name: str
  claim: str
  base: Any
  variants: dict[str, dict[str, Any]]
  overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
  metrics: tuple[str, ...] = ('eval.loss',)
  rules: tuple[dict, ...] = ()
  preconditions: tuple[dict, ...] = ()
  nulls: tuple[dict, ...] = ()
  groups: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
  measure: str | Callable | None = None
  measure_args: dict[str, Any] = dataclasses.field(default_factory=dict)
  train: bool = True
  eval_variants: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
  plots: tuple[dict, ...] = ()
  description: str = ''
  path: str = ''
  scale: int = 1
  module: Any = dataclasses.field(default=None, repr=False, compare=False)

  @property
  def all_variants(self) -> list[str]:
    """Trained variants first, then the evaluation-only ones."""
    return list(self.variants) + list(self.eval_variants)

  @property
  def measure_name(self) -> str | None:
    if self.measure is None:
      return None
    return self.measure if isinstance(self.measure, str) else self.measure.__name__


# Loading and checking ------------------------------------------------------------------------
def available_sweeps() -> list[str]:
  """The sweep files in configs/sweeps/, as paths."""
  if not os.path.isdir(SWEEPS_DIR):
    return []
  names = sorted(n for n in os.listdir(SWEEPS_DIR) if n.endswith('.py') and n != '__init__.py')
  return [os.path.join(SWEEPS_DIR, n) for n in names]


def load_sweep(path: str, scale: int = 1) -> Sweep:
  """Imports the sweep file at `path`, calls its `get_sweep(scale)` and checks the result.

  Raises:
    ValueError: a missing file, no get_sweep, unknown fields, or any problem `check_sweep` finds.
  """
  if not isinstance(scale, int) or isinstance(scale, bool) or scale < 1:
    raise ValueError(f'scale={scale!r} must be a positive integer')
  module = _import(path)
  if not callable(getattr(module, 'get_sweep', None)):
    raise ValueError(f'sweep file {path!r} must define get_sweep(scale: int) -> dict')
  spec_value = module.get_sweep(scale)
  if isinstance(spec_value, ml_collections.ConfigDict):
    spec_value = spec_value.to_dict()
  if isinstance(spec_value, Sweep):
    spec_value = {f.name: getattr(spec_value, f.name) for f in dataclasses.fields(Sweep)}
    for key in ('path', 'scale', 'module'):
      spec_value.pop(key)
  if not isinstance(spec_value, Mapping):
    raise ValueError(f'get_sweep of {path!r} returned {type(spec_value).__name__}; return a dict')
  sweep = _from_spec(dict(spec_value), path, scale, module)
  check_sweep(sweep)
  return sweep


def _import(path: str):
  if not os.path.isfile(path):
    shown = ', '.join(available_sweeps()) or f'none in {SWEEPS_DIR}'
    raise ValueError(f'sweep file {path!r} does not exist; available sweeps: {shown}')
  module_name = 'sparrow_sweep_' + re.sub(r'\W', '_', os.path.splitext(os.path.basename(path))[0])
  spec = importlib.util.spec_from_file_location(module_name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def gpu_scale(path: str) -> int:
  """The sweep file's GPU_SCALE: the --scale of its run on one GPU (about an hour for all)."""
  value = getattr(_import(path), 'GPU_SCALE', None)
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(
      f'sweep file {path!r} has GPU_SCALE={value!r}; set a module-level GPU_SCALE = K (a '
      'positive int, the --scale of its one-GPU run) or leave the sweep out with --only'
    )
  return value


def _flatten(overrides: Mapping[str, Any] | None, where: str) -> dict[str, Any]:
  """{'model': {'num_heads': 4}} or {'model.num_heads': 4} -> {'model.num_heads': 4}."""
  if overrides is None:
    return {}
  if not isinstance(overrides, Mapping):
    raise ValueError(f'{where} must be a dict of dotted config keys to values; got {overrides!r}')
  flat = {}
  for key, value in overrides.items():
    if isinstance(value, Mapping | ml_collections.ConfigDict) and not isinstance(value, tuple):
      for sub, v in _flatten(dict(value), where).items():
        flat[f'{key}.{sub}'] = v
    else:
      flat[str(key)] = value
  return flat


def _from_spec(spec: dict, path: str, scale: int, module: Any) -> Sweep:
  unknown = sorted(set(spec) - set(_FIELDS))
  if unknown:
    raise ValueError(
      f'sweep {path!r} has unknown field {unknown[0]!r}; valid fields: {", ".join(_FIELDS)}'
    )
  for key in ('name', 'base'):
    if key not in spec:
      raise ValueError(f'sweep {path!r} must set {key!r}')
  if ('variants' in spec) == ('axes' in spec):
    raise ValueError(f'sweep {path!r} must set exactly one of variants and axes')
  if 'variants' in spec:
    variants = {str(k): _flatten(v, f'variant {k!r}') for k, v in spec['variants'].items()}
  else:  # the product of the axes: {'norm': {'pre': {...}, 'post': {...}}, 'warmup': {...}}
    axes = {a: {str(k): _flatten(v, f'axis {a!r} value {k!r}') for k, v in values.items()}
            for a, values in spec['axes'].items()}  # fmt: skip
    variants = {}
    for combo in itertools.product(*[list(values.items()) for values in axes.values()]):
      variants['_'.join(name for name, _ in combo)] = {k: v for _, o in combo for k, v in o.items()}
  if not variants:
    raise ValueError(f'sweep {path!r} has no variants')
  rules = list(spec.get('rules') or []) + ([spec['rule']] if spec.get('rule') else [])
  eval_variants = {}
  for name, entry in (spec.get('eval_variants') or {}).items():
    if not isinstance(entry, Mapping) or 'from' not in entry:
      raise ValueError(f"eval variant {name!r} must be a dict with 'from' and 'overrides'")
    eval_variants[str(name)] = {
      'from': entry['from'],
      'overrides': _flatten(entry.get('overrides'), f'eval variant {name!r}'),
    }
  metrics = spec.get('metrics', ('eval.loss',))
  return Sweep(
    name=str(spec['name']),
    claim=str(spec.get('claim', '')),
    base=spec['base'],
    variants=variants,
    overrides=_flatten(spec.get('overrides'), 'overrides'),
    metrics=(metrics,) if isinstance(metrics, str) else tuple(metrics),
    rules=tuple(dict(r) for r in rules),
    preconditions=tuple(dict(r) for r in spec.get('preconditions') or ()),
    nulls=tuple(dict(n) for n in spec.get('nulls') or ()),
    groups={str(k): dict(v) for k, v in (spec.get('groups') or {}).items()},
    measure=spec.get('measure'),
    measure_args=dict(spec.get('measure_args') or {}),
    train=bool(spec.get('train', True)),
    eval_variants=eval_variants,
    plots=tuple(dict(p) for p in spec.get('plots') or ()),
    description=str(spec.get('description', '')),
    path=path,
    scale=scale,
    module=module,
  )


def base_config(sweep: Sweep) -> ml_collections.ConfigDict:
  """The sweep's base ConfigDict, fresh (callers may change it)."""
  base = sweep.base
  if callable(base):
    return base()
  name = str(base)
  if name.endswith('.py'):
    module_name = os.path.splitext(os.path.normpath(name))[0].replace(os.sep, '.')
    if module_name.startswith('configs.') and os.path.isfile(name):
      return importlib.import_module(module_name).get_config()
    if not os.path.isfile(name):
      raise ValueError(f'sweep {sweep.name!r}: base config file {name!r} does not exist')
    spec = importlib.util.spec_from_file_location('sparrow_base_config', name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()
  try:
    return importlib.import_module(name).get_config()
  except ModuleNotFoundError:
    raise ValueError(
      f'sweep {sweep.name!r}: base={name!r} is neither a config file nor a config module'
    ) from None


def task_losses(base: Any, *overrides: Mapping[str, Any]) -> dict[str, float]:
  """`research.nulls.task_losses` of the base config with each of `overrides` applied in turn
  (a sweep file's common overrides, then a variant's): what a model that learns nothing scores
  on that variant's task, for the sweep's nulls."""
  config = base_config(Sweep(name='nulls', claim='', base=base, variants={}))
  for layer in overrides:
    apply_overrides(config, _flatten(layer, 'overrides'), 'a null')
  return nulls.task_losses(config)


def resolve_config(sweep: Sweep, variant: str, seed: int = 0) -> ml_collections.ConfigDict:
  """The full config of one run: base, then the common overrides, the variant's, and the seed."""
  config = base_config(sweep)
  apply_overrides(config, sweep.overrides, f'sweep {sweep.name!r}')
  if variant in sweep.eval_variants:
    entry = sweep.eval_variants[variant]
    apply_overrides(config, sweep.variants[entry['from']], f'variant {entry["from"]!r}')
    apply_overrides(config, entry['overrides'], f'eval variant {variant!r}')
  elif variant in sweep.variants:
    apply_overrides(config, sweep.variants[variant], f'variant {variant!r}')
  else:
    raise ValueError(
      f'unknown variant {variant!r} of sweep {sweep.name!r}; its variants are: '
      f'{", ".join(sweep.all_variants)}'
    )
  config.seed = int(config.seed) + int(seed)
  config.name = f'{sweep.name}-{variant}-seed{seed}'
  return config


def check_sweep(sweep: Sweep) -> None:
  """Checks everything that can be checked before running: names, every dotted key of every
  variant against the base config, each variant's model config, the rules and the measure."""
  for name in sweep.all_variants:
    if not _NAME.fullmatch(name):
      raise ValueError(f'variant name {name!r} must use only letters, digits and _ . + = -')
  clash = sorted(set(sweep.variants) & set(sweep.eval_variants))
  if clash:
    raise ValueError(f'{clash[0]!r} is both a variant and an eval variant of {sweep.name!r}')
  for name, entry in sweep.eval_variants.items():
    if entry['from'] not in sweep.variants:
      raise ValueError(
        f'eval variant {name!r} is from {entry["from"]!r}, which is not a trained variant; '
        f'choose one of {", ".join(sweep.variants)}'
      )
  if sweep.eval_variants and not sweep.train:
    raise ValueError(f'sweep {sweep.name!r}: eval_variants need train=True (a checkpoint)')
  if sweep.eval_variants and sweep.measure is None:
    raise ValueError(f'sweep {sweep.name!r}: eval_variants need a measure to run')
  if not sweep.train and sweep.measure is None:
    raise ValueError(f'sweep {sweep.name!r} has train=False and no measure: nothing to run')
  for name in sweep.all_variants:  # every key exists, every model and schedule is valid
    config = resolve_config(sweep, name)
    experiment = Config.from_configdict(config)  # every knob, the model's included
    optim.make_schedule(optim_config(config, experiment.model))
  rules_lib.check_groups(sweep.groups, sweep.all_variants)
  named = [*sweep.all_variants, *sweep.groups]  # what rules, nulls and plots may compare
  for rule in sweep.rules:
    rules_lib.check_rule(rule, named)
  rules_lib.check_preconditions(sweep.preconditions, sweep.rules, named, list(sweep.metrics))
  read = [*sweep.metrics, *(m for r in sweep.rules for m in rules_lib.rule_metrics(r))]
  nulls.check_nulls(sweep.nulls, [*sweep.rules, *sweep.preconditions], named, read)
  if sweep.measure is not None:
    resolve_measure(sweep)
  report.check_plots(sweep.plots)


def resolve_measure(sweep: Sweep) -> Callable | None:
  """The measure function: the sweep file's own, else `research.measures.MEASURES[name]`."""
  if sweep.measure is None or callable(sweep.measure):
    return sweep.measure
  own = getattr(sweep.module, sweep.measure, None)
  if callable(own):
    return own
  if sweep.measure not in measures.MEASURES:
    raise ValueError(
      f'sweep {sweep.name!r}: measure={sweep.measure!r} is neither a function of its file nor '
      f'one of research.measures.MEASURES: {", ".join(measures.MEASURES)}'
    )
  return measures.MEASURES[sweep.measure]


def select_variants(sweep: Sweep, names: Sequence[str] | None) -> list[str]:
  """The requested variants (all when None), in the sweep's order; an unknown name is an error."""
  if not names:
    return sweep.all_variants
  unknown = [n for n in names if n not in sweep.all_variants]
  if unknown:
    raise ValueError(
      f'unknown variant {unknown[0]!r} of sweep {sweep.name!r}; its variants are: '
      f'{", ".join(sweep.all_variants)}'
    )
  needed = set(names) | {sweep.eval_variants[n]['from'] for n in names if n in sweep.eval_variants}
  return [n for n in sweep.all_variants if n in needed]
