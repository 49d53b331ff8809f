"""Sweeps: one base config, a few variants of overrides, several seeds; results in one JSONL file.

A sweep file (`configs/sweeps/<name>.py`) defines `get_sweep(scale: int) -> dict` with the fields
of `Sweep`. `run_sweep(sweep, workdir, seeds)` trains every (variant, seed) in
`workdir/<variant>/seed_<k>` (one after another, or `parallel` worker processes at a time), runs
the sweep's `measure` on each, and collects one line per run into `workdir/results.jsonl`. A
finished run is skipped on rerun and an interrupted one resumes from its latest checkpoint.
`transformer.report` turns the results into `report.md`; `transformer.verdicts` applies the rules.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import itertools
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np

from transformer import verdicts

SWEEPS_DIR = os.path.join('configs', 'sweeps')
WORKER_MODULE = 'experiments.sweep'  # `python -m` entry point that runs one (variant, seed)
RESULTS = 'results.jsonl'
SWEEP_JSON = 'sweep.json'
_NAME = re.compile(r'[A-Za-z0-9_.+=-]+')  # variant names become directory names
_FIELDS = (
  'name', 'claim', 'base', 'overrides', 'variants', 'axes', 'metrics', 'rule', 'rules', 'measure',
  'measure_args', 'train', 'eval_variants', 'plots', 'description',
)  # fmt: skip


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
    rules: the verdict rules (`transformer.verdicts.KINDS`); the claim holds if all hold.
    measure: a function `measure(ctx: MeasureContext, **measure_args) -> dict` run after training
      (or instead of it when `train` is False): a name defined in the sweep file or in
      `transformer.measures.MEASURES`. Its numbers join the run's metrics; a list under the key
      'figures' names PNG files (relative to the run directory) for the report.
    measure_args: keyword arguments of `measure`.
    train: whether each run trains (False: the measure only, e.g. memory and time benchmarks).
    eval_variants: name -> {'from': a trained variant, 'overrides': {dotted key: value}}: no
      training of its own; `measure` runs on the checkpoint of `from` with the overrides applied,
      which must change only the compute (e.g. model.rope_scaling at test time).
    plots: extra report plots (`transformer.report.PLOT_KINDS`).
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
  if not os.path.isfile(path):
    shown = ', '.join(available_sweeps()) or f'none in {SWEEPS_DIR}'
    raise ValueError(f'sweep file {path!r} does not exist; available sweeps: {shown}')
  module_name = 'sparrow_sweep_' + re.sub(r'\W', '_', os.path.splitext(os.path.basename(path))[0])
  spec = importlib.util.spec_from_file_location(module_name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
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


def apply_overrides(config: ml_collections.ConfigDict, overrides: Mapping[str, Any], where: str):
  """Sets each dotted key of `overrides` in `config`; a key the config lacks is one ValueError."""
  for key, value in overrides.items():
    node, parts = config, key.split('.')
    for i, part in enumerate(parts):
      has = isinstance(node, ml_collections.ConfigDict) and part in node
      if not has:
        parent = '.'.join(parts[:i]) or 'the config'
        valid = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
        raise ValueError(
          f'{where} overrides {key!r}, which is not a key of the base config: {parent} has no '
          f'{part!r}' + (f'; valid keys there: {", ".join(valid)}' if valid else '')
        )
      if i < len(parts) - 1:
        node = node[part]
    try:
      node[parts[-1]] = tuple(value) if isinstance(value, list) else value
    except (TypeError, ValueError) as e:
      raise ValueError(f'{where} sets {key}={value!r}, which the config rejects: {e}') from None


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
  from transformer.config import ModelConfig

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
  from transformer import faults, optim, train

  for name in sweep.all_variants:  # every key exists, every model and schedule is valid
    config = resolve_config(sweep, name)
    model_cfg = ModelConfig.from_config(config.model)
    optim.make_schedule(train.optim_config(config, model_cfg))
    faults.check_config(config.train)
  for rule in sweep.rules:
    verdicts.check_rule(rule, sweep.all_variants)
  if sweep.measure is not None:
    resolve_measure(sweep)
  from transformer import report  # noqa: F401 - plots are checked where they are drawn

  report.check_plots(sweep.plots)


def resolve_measure(sweep: Sweep) -> Callable | None:
  """The measure function: the sweep file's own, else `transformer.measures.MEASURES[name]`."""
  if sweep.measure is None or callable(sweep.measure):
    return sweep.measure
  own = getattr(sweep.module, sweep.measure, None)
  if callable(own):
    return own
  from transformer import measures

  if sweep.measure not in measures.MEASURES:
    raise ValueError(
      f'sweep {sweep.name!r}: measure={sweep.measure!r} is neither a function of its file nor '
      f'one of transformer.measures.MEASURES: {", ".join(measures.MEASURES)}'
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


# One run -------------------------------------------------------------------------------------
def run_dir(workdir: str, variant: str, seed: int) -> str:
  return os.path.join(workdir, variant, f'seed_{seed}')


@dataclasses.dataclass
class MeasureContext:
  """What a measure function gets: the run's config and directories, and a checkpoint loader."""

  config: ml_collections.ConfigDict  # the resolved config of this run
  run_dir: str  # where this run's files (figures, result.json) go
  checkpoint_dir: str  # the trained run's workdir (run_dir, or that of an eval variant's source)
  variant: str
  seed: int
  scale: int
  trained: bool

  def load(self):
    """(train.Run, params): this run's config (its eval overrides included) and trained params."""
    from transformer import checkpoint, sharding, train

    saved = checkpoint.read_run_config(self.checkpoint_dir)
    if saved is None:
      raise ValueError(f'no trained run in {self.checkpoint_dir!r} (no config.json)')
    config = ml_collections.ConfigDict(self.config.to_dict())
    config.model.vocab_size = saved['model']['vocab_size']
    import jax

    try:
      sharding.mesh_shape(tuple(config.mesh.shape), jax.device_count())
    except ValueError:
      config.mesh.shape = (-1, 1, 1)
    run = train.Run(config, self.checkpoint_dir)
    ckpt = checkpoint.Checkpointer(self.checkpoint_dir, keep=config.train.keep_checkpoints)
    try:
      state, _, _ = ckpt.restore(run.abstract_state)
    finally:
      ckpt.close()
    return run, state.params


def _jsonable(x: Any) -> Any:
  return json.loads(json.dumps(x, default=str))


def config_dict(config: ml_collections.ConfigDict) -> dict:
  """The config as JSON-normalised data (tuples become lists), as results.jsonl stores it."""
  return json.loads(config.to_json_best_effort())


def read_curve(workdir: str) -> dict[str, list[dict]]:
  """{'train': [...], 'eval': [...]} from the run's metrics.jsonl (resumes included, once each)."""
  curve = {'train': [], 'eval': []}
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return curve
  with open(path) as f:
    for line in f:
      try:
        entry = json.loads(line)
      except ValueError:
        continue
      kind = entry.pop('kind', None)
      if kind in curve:
        curve[kind].append(entry)
  return curve


def final_metrics(curve: Mapping[str, list[dict]]) -> dict[str, float]:
  """The run's numbers from its curve.

  train.loss / train.nll: mean of the last 10% of logged training losses (label-smoothed) and
  cross-entropies (log of the logged perplexity); train.loss_final: the last one;
  train.loss_rise: the largest rise of the loss above its lowest value so far (a spike; inf
  when a loss was not finite).
  eval.*: the last evaluation (loss and perplexity without label smoothing).
  """
  out: dict[str, float] = {}
  train = [h for h in curve.get('train', []) if 'loss' in h]
  if train:
    losses = np.array([h['loss'] for h in train], np.float64)
    tail = max(1, len(losses) // 10)
    out['train.loss'] = float(np.mean(losses[-tail:]))
    out['train.loss_final'] = float(losses[-1])
    if all('perplexity' in h for h in train):
      nll = np.log(np.maximum([h['perplexity'] for h in train], 1.0))
      out['train.nll'] = float(np.mean(nll[-tail:]))
    finite = np.all(np.isfinite(losses))
    out['train.loss_rise'] = float(np.max(losses - np.minimum.accumulate(losses)))
    out['train.loss_rise'] = out['train.loss_rise'] if finite else math.inf
  evals = curve.get('eval', [])
  if evals:
    for key, value in evals[-1].items():
      if key != 'step' and isinstance(value, int | float) and not isinstance(value, bool):
        out[f'eval.{key}'] = float(value)
  return out


def model_numbers(config: ml_collections.ConfigDict, workdir: str | None) -> dict[str, float]:
  """Parameters (all, and without embedding tables) and training FLOPs per token."""
  import jax

  from transformer import checkpoint, models
  from transformer.config import ModelConfig

  model = dict(config.model, attention_impl=None, remat='none')  # the params do not depend on these
  saved = checkpoint.read_run_config(workdir) if workdir else None
  if saved is not None:
    model['vocab_size'] = saved['model']['vocab_size']
  cfg = ModelConfig.from_config(model)
  data = config.data
  seq_len = data.max_target_length if cfg.family == 'encoder_decoder' else data.max_length
  shapes = models.param_shapes(cfg)
  embedding = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
    if 'embedding' in jax.tree_util.keystr(path):
      embedding += math.prod(leaf.shape)
  params = models.count_params(cfg)
  return {
    'params': float(params),
    'params_non_embedding': float(params - embedding),
    'flops_per_token': models.flops_per_token(cfg, seq_len)['train'],
  }


def _write_json(path: str, value: Any) -> None:
  tmp = f'{path}.tmp-{os.getpid()}'
  with open(tmp, 'w') as f:
    json.dump(value, f, indent=1, default=str)
  os.replace(tmp, path)


def finished_result(sweep: Sweep, variant: str, seed: int, workdir: str) -> dict | None:
  """The run's result.json if it is finished with the same config; raises if it differs."""
  path = os.path.join(run_dir(workdir, variant, seed), 'result.json')
  if not os.path.exists(path):
    return None
  with open(path) as f:
    result = json.load(f)
  want = config_dict(resolve_config(sweep, variant, seed))
  if result.get('config') != want:
    diff = _first_difference(result.get('config') or {}, want)
    raise ValueError(
      f'{os.path.dirname(path)} holds a finished run of another config ({diff}); use another '
      '--workdir, or delete that run directory to redo it'
    )
  return result


def _first_difference(a: Mapping, b: Mapping, prefix: str = '') -> str:
  for key in sorted(set(a) | set(b)):
    x, y = a.get(key), b.get(key)
    if isinstance(x, Mapping) and isinstance(y, Mapping):
      found = _first_difference(x, y, f'{prefix}{key}.')
      if found:
        return found
    elif x != y:
      return f'{prefix}{key} is {json.dumps(x)} there and {json.dumps(y)} here'
  return ''


def execute_run(sweep: Sweep, variant: str, seed: int, workdir: str) -> dict:
  """Trains (or resumes) one run, measures it and writes its result.json; returns the result.

  A finished run (result.json with the same config) is returned as it is. A run whose loss
  stops being finite (transformer.faults.NonFiniteError) is recorded with status 'diverged' and
  infinite losses rather than stopping the sweep.
  """
  done = finished_result(sweep, variant, seed, workdir)
  if done is not None:
    return done
  import jax

  from transformer import faults, train

  config = resolve_config(sweep, variant, seed)
  directory = run_dir(workdir, variant, seed)
  os.makedirs(directory, exist_ok=True)
  source = sweep.eval_variants.get(variant, {}).get('from')
  checkpoint_dir = run_dir(workdir, source, seed) if source else directory
  start = time.time()
  status, error = 'ok', None
  if source is not None:
    source_result = finished_result(sweep, source, seed, workdir)
    if source_result is None:
      raise ValueError(f'eval variant {variant!r} needs the finished run of {source!r} first')
    curve = read_curve(checkpoint_dir)
  else:
    if sweep.train:
      try:
        train.train_and_evaluate(config, directory)
      except faults.NonFiniteError as e:
        status, error = 'diverged', str(e).splitlines()[0]
    curve = read_curve(directory)
  metrics = final_metrics(curve)
  if status == 'diverged':
    metrics.update({'eval.loss': math.inf, 'eval.perplexity': math.inf, 'diverged': 1.0})
  elif sweep.train:
    metrics['diverged'] = 0.0
  figures = []
  measure = resolve_measure(sweep)
  if measure is not None and status == 'ok':
    ctx = MeasureContext(config, directory, checkpoint_dir, variant, seed, sweep.scale, sweep.train)
    extra = dict(measure(ctx, **sweep.measure_args) or {})
    figures = list(extra.pop('figures', []))
    if 'skipped' in extra:
      status, error = 'skipped', str(extra.pop('skipped'))
    metrics.update({k: float(v) for k, v in extra.items()})
  wall = time.time() - start
  numbers = model_numbers(config, checkpoint_dir if sweep.train else None)
  metrics.update(numbers, wall_time_s=wall)
  curve_path = os.path.join(directory, 'curve.json')
  _write_json(curve_path, curve)
  result = {
    'variant': variant,
    'seed': seed,
    'status': status,
    'error': error,
    'metrics': metrics,
    'config': config_dict(config),
    'curve': os.path.relpath(curve_path, workdir),
    'run_dir': os.path.relpath(directory, workdir),
    'figures': [os.path.relpath(os.path.join(directory, f), workdir) for f in figures],
    'wall_time_s': wall,
    'params': int(numbers['params']),
    'flops_per_token': numbers['flops_per_token'],
    'backend': jax.default_backend(),
    'device': jax.devices()[0].device_kind,
  }
  _write_json(os.path.join(directory, 'result.json'), _jsonable(result))
  return result


# The whole sweep -----------------------------------------------------------------------------
def sweep_metadata(sweep: Sweep, seeds: int) -> dict:
  """What the report needs from the sweep file, stored as workdir/sweep.json."""
  return _jsonable(
    {
      'name': sweep.name,
      'claim': sweep.claim,
      'description': sweep.description,
      'path': sweep.path,
      'scale': sweep.scale,
      'seeds': seeds,
      'base': sweep.base if isinstance(sweep.base, str) else getattr(sweep.base, '__name__', ''),
      'overrides': sweep.overrides,
      'variants': sweep.variants,
      'eval_variants': sweep.eval_variants,
      'metrics': list(sweep.metrics),
      'rules': list(sweep.rules),
      'measure': sweep.measure_name,
      'measure_args': sweep.measure_args,
      'train': sweep.train,
      'plots': list(sweep.plots),
    }
  )


def _prepare_workdir(sweep: Sweep, workdir: str, seeds: int) -> None:
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, SWEEP_JSON)
  if os.path.exists(path):
    with open(path) as f:
      previous = json.load(f)
    if previous.get('name') != sweep.name:
      raise ValueError(
        f'workdir {workdir!r} holds sweep {previous.get("name")!r}, not {sweep.name!r}; '
        'use another --workdir'
      )
    seeds = max(seeds, int(previous.get('seeds', 1)))
  _write_json(path, sweep_metadata(sweep, seeds))


def worker_command(sweep: Sweep, workdir: str, variant: str, seed: int) -> list[str]:
  """The command that runs one (variant, seed) in its own process (see experiments/sweep.py)."""
  return [
    sys.executable, '-m', WORKER_MODULE, f'--sweep={sweep.path}', f'--workdir={workdir}',
    f'--scale={sweep.scale}', f'--run={variant}:{seed}',
  ]  # fmt: skip


def run_sweep(
  sweep: Sweep,
  workdir: str,
  *,
  seeds: int = 1,
  parallel: int = 1,
  variants: Sequence[str] | None = None,
  log: Callable[[str], None] = print,
) -> list[dict]:
  """Runs every (variant, seed) not finished yet, then writes workdir/results.jsonl.

  `parallel` > 1 runs that many worker processes at once, each logging to its run's log.txt
  (evaluation-only variants start once their source run is done). Returns the results.
  """
  if not isinstance(seeds, int) or seeds < 1:
    raise ValueError(f'seeds={seeds!r} must be a positive integer')
  if not isinstance(parallel, int) or parallel < 1:
    raise ValueError(f'parallel={parallel!r} must be a positive integer')
  names = select_variants(sweep, variants)
  _prepare_workdir(sweep, workdir, seeds)
  jobs = [(v, s) for s in range(seeds) for v in names]
  todo = [job for job in jobs if finished_result(sweep, *job, workdir) is None]
  log(f'sweep {sweep.name}: {len(jobs)} runs, {len(jobs) - len(todo)} already finished')
  # Trained variants first: eval variants read their checkpoints.
  todo.sort(key=lambda job: job[0] in sweep.eval_variants)
  if parallel == 1:
    for i, (variant, seed) in enumerate(todo):
      log(f'[{i + 1}/{len(todo)}] {variant} seed {seed} -> {run_dir(workdir, variant, seed)}')
      result = execute_run(sweep, variant, seed, workdir)
      log(f'  {variant} seed {seed}: {result["status"]}, {result["wall_time_s"]:.0f} s')
      write_results(workdir)
  else:
    _run_parallel(sweep, workdir, todo, parallel, log)
  return write_results(workdir)


def _run_parallel(sweep: Sweep, workdir: str, todo: list, parallel: int, log) -> None:
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE='false')  # GPU: share the device memory
  pending, running, failed = list(todo), {}, []
  while pending or running:
    for job in list(pending):
      if len(running) >= parallel:
        break
      variant, seed = job
      source = sweep.eval_variants.get(variant, {}).get('from')
      if source and (source, seed) in [*running.values(), *pending]:
        continue  # wait for the checkpoint it evaluates
      directory = run_dir(workdir, variant, seed)
      os.makedirs(directory, exist_ok=True)
      with open(os.path.join(directory, 'log.txt'), 'a') as out:
        process = subprocess.Popen(
          worker_command(sweep, workdir, variant, seed),
          stdout=out,
          stderr=subprocess.STDOUT,
          env=env,
        )
      running[process] = job
      pending.remove(job)
      log(f'started {variant} seed {seed} (pid {process.pid}); log: {directory}/log.txt')
    time.sleep(0.5)
    for process, (variant, seed) in list(running.items()):
      code = process.poll()
      if code is None:
        continue
      del running[process]
      if code:
        failed.append(f'{variant} seed {seed} (exit {code}, log {run_dir(workdir, variant, seed)})')
        pending = [j for j in pending if sweep.eval_variants.get(j[0], {}).get('from') != variant]
      log(f'finished {variant} seed {seed}: {"ok" if not code else f"failed, exit {code}"}')
      write_results(workdir)
  if failed:
    raise RuntimeError(f'{len(failed)} run(s) failed: {"; ".join(failed)}')


def write_results(workdir: str) -> list[dict]:
  """Collects every finished run's result.json into workdir/results.jsonl, in sweep order."""
  with open(os.path.join(workdir, SWEEP_JSON)) as f:
    meta = json.load(f)
  order = list(meta['variants']) + list(meta.get('eval_variants') or {})
  results = []
  for variant in order:
    directory = os.path.join(workdir, variant)
    if not os.path.isdir(directory):
      continue
    seeds = sorted(int(n[5:]) for n in os.listdir(directory) if re.fullmatch(r'seed_\d+', n))
    for seed in seeds:
      path = os.path.join(run_dir(workdir, variant, seed), 'result.json')
      if os.path.exists(path):
        with open(path) as f:
          results.append(json.load(f))
  text = ''.join(json.dumps(r) + '\n' for r in results)
  tmp = os.path.join(workdir, f'.{RESULTS}.tmp-{os.getpid()}')
  with open(tmp, 'w') as f:
    f.write(text)
  os.replace(tmp, os.path.join(workdir, RESULTS))
  return results


def load_results(workdir: str) -> tuple[dict, list[dict]]:
  """(sweep.json metadata, results.jsonl lines) of a sweep workdir; one ValueError if missing."""
  path = os.path.join(workdir, RESULTS)
  if not os.path.exists(path) or not os.path.exists(os.path.join(workdir, SWEEP_JSON)):
    raise ValueError(
      f'no {RESULTS} in {workdir!r}: nothing to report. Run a sweep there first: python -m '
      f'experiments.sweep --sweep=configs/sweeps/<name>.py --workdir={workdir}'
    )
  with open(os.path.join(workdir, SWEEP_JSON)) as f:
    meta = json.load(f)
  with open(path) as f:
    results = [json.loads(line) for line in f if line.strip()]
  if not results:
    raise ValueError(f'{path} has no finished runs yet; run the sweep to completion first')
  return meta, results


def metric_table(results: Sequence[Mapping]) -> dict[str, dict[str, list[float]]]:
  """variant -> metric -> values over seeds (seed order), as `transformer.verdicts` reads them."""
  table: dict[str, dict[str, list[float]]] = {}
  for r in sorted(results, key=lambda r: r['seed']):
    row = table.setdefault(r['variant'], {})
    for key, value in r['metrics'].items():
      row.setdefault(key, []).append(value)
  return table
