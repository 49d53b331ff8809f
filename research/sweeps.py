"""Sweeps: one base config, a few variants of overrides, several seeds; results in one JSONL file.

A sweep file (`configs/sweeps/<name>.py`) defines `get_sweep(scale: int) -> dict` with the fields
of `Sweep`. `run_sweep(sweep, workdir, seeds)` trains every (variant, seed) in
`workdir/<variant>/seed_<k>` (one after another, or `parallel` worker processes at a time), runs
the sweep's `measure` on each, and appends one line per run to `workdir/results.jsonl`, the
sweep's one store of results (its curve is the run's own metrics.jsonl). A run with a line is
skipped on rerun and an interrupted one resumes from its latest checkpoint. Each line records
the git revision of the source; a sweep does not start runs from a tree with uncommitted changes
unless told to. `research.report` turns the results into `report.md`; `research.verdicts`
applies the rules. `regenerate` reruns a set of sweeps into one results root at one commit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence

import ml_collections

from research import report, spec
from research.results import (
  RESULT_ROOTS,
  SWEEP_JSON,
  append_result,
  config_dict,
  final_metrics,
  load_results,
  model_numbers,
  read_curve,
  read_results,
  run_dir,
  write_results,
)
from research.spec import Sweep, resolve_config, resolve_measure, select_variants
from transformer import util
from transformer.training import faults, provenance
from transformer.training.loop import train_and_evaluate
from transformer.training.state import weights
from transformer.training.workdir import load_run

WORKER_MODULE = 'experiments.sweep'  # `python -m` entry point that runs one (variant, seed)
# The checkout whose code runs: the one holding this package.
SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The source revision -----------------------------------------------------------------------
def run_source(ignore: Sequence[str] = (), source_dir: str = SOURCE_DIR) -> provenance.Source:
  """The checkout at `source_dir` with what a sweep's git check leaves out: RESULT_ROOTS and the
  paths in `ignore` (its workdir, a regenerated root). The sweep's check and each of its runs
  (`execute_run`) use it alike, so a run's revision is clean when the sweep's is."""
  return provenance.Source(source_dir, (*RESULT_ROOTS, *(os.path.abspath(p) for p in ignore)))


def source_state(ignore: Sequence[str] = (), source_dir: str = SOURCE_DIR) -> tuple[str, list[str]]:
  """(HEAD sha, changed files) of the git checkout holding `source_dir`; ('unknown', []) outside
  git. Untracked files count; those under RESULT_ROOTS or the paths in `ignore` do not."""
  source = run_source(ignore, source_dir)
  return provenance.source_state(source.directory, source.ignore)


def checked_revision(ignore: Sequence[str], allow_dirty: bool, source_dir: str = SOURCE_DIR) -> str:
  """The revision results will record: the HEAD sha of a clean tree, '<sha>-dirty' when
  `allow_dirty`; otherwise a tree with changes (or outside git) is one ValueError."""
  head, changed = source_state(ignore, source_dir)
  if head == 'unknown':
    if allow_dirty:
      return 'unknown'
    raise ValueError(
      f'cannot tell the source revision: {source_dir} is not in a git checkout; results must '
      "name their commit (or pass --allow_dirty to record 'unknown')"
    )
  if not changed:
    return head
  if allow_dirty:
    return f'{head}-dirty'
  shown = ', '.join(changed[:8]) + (f' and {len(changed) - 8} more' if len(changed) > 8 else '')
  raise ValueError(
    f'the source tree has uncommitted changes ({shown}); commit them first, so that the results '
    f'name the code that made them, or pass --allow_dirty to record {head[:12]}...-dirty'
  )


@dataclasses.dataclass
class MeasureContext:
  """What a measure function gets: the run's config and directories, and a checkpoint loader."""

  config: ml_collections.ConfigDict  # the resolved config of this run
  run_dir: str  # where this run's files (figures) go
  checkpoint_dir: str  # the trained run's workdir (run_dir, or that of an eval variant's source)
  variant: str
  seed: int
  scale: int
  trained: bool

  def load(self):
    """(Run, weights): this run's config (its eval overrides included) and trained weights: the
    parameters, plus a batchnorm model's running statistics (`training.state.weights`)."""
    if not os.path.exists(os.path.join(self.checkpoint_dir, 'config.json')):
      raise ValueError(f'no trained run in {self.checkpoint_dir!r} (no config.json)')
    run, state, _ = load_run(self.checkpoint_dir, config=self.config)
    return run, weights(state)


def finished_result(
  sweep: Sweep,
  variant: str,
  seed: int,
  workdir: str,
  lines: Sequence[dict] | None = None,
  steps: int | None = None,
) -> dict | None:
  """The run's line of results.jsonl (`lines`, else read) if it has one with the same config
  (`steps`: as `run_config` cuts it short); raises if its config differs."""
  lines = read_results(workdir) if lines is None else lines
  found = [r for r in lines if r.get('variant') == variant and r.get('seed') == seed]
  if not found:
    return None
  result = found[-1]
  want = config_dict(run_config(sweep, variant, seed, steps))
  if result.get('config') != want:
    diff = _first_difference(result.get('config') or {}, want)
    raise ValueError(
      f'{os.path.join(workdir, "results.jsonl")} holds a finished run {variant} seed {seed} of '
      f'another config ({diff}); use another --workdir, or delete its line there and the '
      f'directory {run_dir(workdir, variant, seed)} to redo it'
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


def execute_run(
  sweep: Sweep,
  variant: str,
  seed: int,
  workdir: str,
  revision: str = 'unknown',
  ignore_changes: Sequence[str] = (),
  source_dir: str = SOURCE_DIR,
  steps: int | None = None,
) -> dict:
  """Trains (or resumes) one run, measures it and appends its line (`revision` its git_revision)
  to results.jsonl; returns the line. `steps` cuts the training short (`run_config`).

  The run's own record of its code, revisions.jsonl in its directory, leaves out what the
  sweep's check does (`run_source`: the workdir, RESULT_ROOTS and `ignore_changes`). Training
  adds a line at each start; measuring, or evaluating another run's checkpoint, adds one too
  (`provenance.record_measure`), so that every run directory names the code behind its numbers.

  A finished run (a line with the same config) is returned as it is. A run whose loss
  stops being finite (training.faults.NonFiniteError) is recorded with status 'diverged' and
  infinite losses rather than stopping the sweep.
  """
  done = finished_result(sweep, variant, seed, workdir, steps=steps)
  if done is not None:
    return done
  import jax

  config = run_config(sweep, variant, seed, steps)
  directory = run_dir(workdir, variant, seed)
  os.makedirs(directory, exist_ok=True)
  code = run_source([workdir, *ignore_changes], source_dir)
  source = sweep.eval_variants.get(variant, {}).get('from')
  checkpoint_dir = run_dir(workdir, source, seed) if source else directory
  start = time.time()
  status, error = 'ok', None
  if source is not None:
    source_result = finished_result(sweep, source, seed, workdir, steps=steps)
    if source_result is None:
      raise ValueError(f'eval variant {variant!r} needs the finished run of {source!r} first')
    curve = read_curve(checkpoint_dir)
  else:
    if sweep.train:
      try:
        train_and_evaluate(config, directory, code)
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
  if (measure is not None and status == 'ok') or source is not None or not sweep.train:
    provenance.record_measure(directory, code)  # nothing else records this run's code
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
  curve_path = os.path.join(checkpoint_dir, 'metrics.jsonl')
  result = {
    'variant': variant,
    'seed': seed,
    'status': status,
    'error': error,
    'metrics': metrics,
    'config': config_dict(config),
    'curve': os.path.relpath(curve_path, workdir) if os.path.exists(curve_path) else None,
    'run_dir': os.path.relpath(directory, workdir),
    'figures': [os.path.relpath(os.path.join(directory, f), workdir) for f in figures],
    'wall_time_s': wall,
    'params': int(numbers['params']),
    'flops_per_token': numbers['flops_per_token'],
    'backend': jax.default_backend(),
    'device': jax.devices()[0].device_kind,
    'git_revision': revision,
  }
  result = util.jsonable(result)
  append_result(workdir, result)
  return result


def run_config(sweep: Sweep, variant: str, seed: int, steps: int | None = None):
  """The run's config; with `steps`, a copy that trains `steps` steps, logging, evaluating and
  checkpointing at each (the logs a measurement reads included), its warmup within them."""
  config = resolve_config(sweep, variant, seed)
  if not steps:
    return config
  train = config.train
  train.steps = train.eval_every = train.checkpoint_every = steps
  train.log_every = 1
  for key in ('induction_every', 'head_entropy_every'):
    if train.get(key):
      train[key] = 1
  config.optim.warmup_steps = min(int(config.optim.warmup_steps), steps)
  return config


def preflight(
  paths: Sequence[str], workdir: str, steps: int = 8, log: Callable[[str], None] = print
) -> list[tuple[str, str, str]]:
  """Every variant of each sweep file in `paths`, seed 0, trained `steps` steps and measured as
  its sweep would, into `workdir`: whether each still runs at this commit, in minutes, before
  hours of regenerating. Returns (sweep, variant, the first line of its error) for each that
  fails; a skipped measurement (a kernel this backend cannot time) is not a failure."""
  failed = []
  for path in paths:
    sweep = spec.load_sweep(path)
    trained = [v for v in sweep.all_variants if v not in sweep.eval_variants]
    for variant in trained + list(sweep.eval_variants):
      start = time.time()
      try:
        result = execute_run(sweep, variant, 0, os.path.join(workdir, sweep.name), steps=steps)
        status, error = result['status'], result['error'] or ''
      except Exception as e:  # noqa: BLE001 - each failure is reported, then the next runs
        status, error = 'failed', f'{type(e).__name__}: {(str(e).splitlines() or [""])[0]}'
      log(f'{sweep.name} {variant}: {status} in {time.time() - start:.0f} s {error}'.rstrip())
      if status == 'failed':  # 'diverged' and 'skipped' are results the sweep records
        failed.append((sweep.name, variant, error))
  return failed


# The whole sweep -----------------------------------------------------------------------------
def sweep_metadata(sweep: Sweep, seeds: int, revision: str = 'unknown') -> dict:
  """What the report needs from the sweep file, stored as workdir/sweep.json (with the revision
  of the latest start)."""
  return util.jsonable(
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
      'preconditions': list(sweep.preconditions),
      'nulls': list(sweep.nulls),
      'groups': sweep.groups,
      'measure': sweep.measure_name,
      'measure_args': sweep.measure_args,
      'train': sweep.train,
      'plots': list(sweep.plots),
      'git_revision': revision,
    }
  )


def _prepare_workdir(sweep: Sweep, workdir: str, seeds: int, revision: str) -> None:
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
  util.write_json(path, sweep_metadata(sweep, seeds, revision))


def worker_command(
  sweep: Sweep,
  workdir: str,
  variant: str,
  seed: int,
  revision: str,
  ignore_changes: Sequence[str] = (),
  source_dir: str = SOURCE_DIR,
) -> list[str]:
  """The command that runs one (variant, seed) in its own process (see experiments/sweep.py)."""
  command = [
    sys.executable, '-m', WORKER_MODULE, f'--sweep={sweep.path}', f'--workdir={workdir}',
    f'--scale={sweep.scale}', f'--run={variant}:{seed}', f'--revision={revision}',
    f'--source_dir={source_dir}',
  ]  # fmt: skip
  if ignore_changes:
    command.append(f'--ignore_changes={",".join(os.path.abspath(p) for p in ignore_changes)}')
  return command


def run_sweep(
  sweep: Sweep,
  workdir: str,
  *,
  seeds: int = 1,
  parallel: int = 1,
  variants: Sequence[str] | None = None,
  log: Callable[[str], None] = print,
  allow_dirty: bool = False,
  ignore_changes: Sequence[str] = (),
  source_dir: str = SOURCE_DIR,
  allow_mixed: bool = False,
) -> list[dict]:
  """Runs every (variant, seed) without a line in workdir/results.jsonl yet; returns the lines.

  `parallel` > 1 runs that many worker processes at once, each logging to its run's log.txt
  (evaluation-only variants start once their source run is done). Runs start only from a clean
  git tree (`checked_revision`; changes under the workdir, RESULT_ROOTS and `ignore_changes`
  do not count) unless `allow_dirty`; each line records the revision. Runs are not added beside
  results of another revision unless `allow_mixed` (the report then lists the revisions).
  """
  if not isinstance(seeds, int) or seeds < 1:
    raise ValueError(f'seeds={seeds!r} must be a positive integer')
  if not isinstance(parallel, int) or parallel < 1:
    raise ValueError(f'parallel={parallel!r} must be a positive integer')
  names = select_variants(sweep, variants)
  jobs = [(v, s) for s in range(seeds) for v in names]
  lines = read_results(workdir)
  todo = [job for job in jobs if finished_result(sweep, *job, workdir, lines) is None]
  revision = 'unknown'
  if todo:  # the check comes before anything is written
    revision = checked_revision([workdir, *ignore_changes], allow_dirty, source_dir)
    _check_one_revision(workdir, lines, revision, allow_mixed)
  _prepare_workdir(sweep, workdir, seeds, revision)
  log(f'sweep {sweep.name}: {len(jobs)} runs, {len(jobs) - len(todo)} already finished')
  # Trained variants first: eval variants read their checkpoints.
  todo.sort(key=lambda job: job[0] in sweep.eval_variants)
  if parallel == 1:
    for i, (variant, seed) in enumerate(todo):
      log(f'[{i + 1}/{len(todo)}] {variant} seed {seed} -> {run_dir(workdir, variant, seed)}')
      result = execute_run(sweep, variant, seed, workdir, revision, ignore_changes, source_dir)
      log(f'  {variant} seed {seed}: {result["status"]}, {result["wall_time_s"]:.0f} s')
  else:
    _run_parallel(sweep, workdir, todo, parallel, log, revision, ignore_changes, source_dir)
  return write_results(workdir)


def _check_one_revision(workdir: str, lines: Sequence[Mapping], revision: str, allow_mixed: bool):
  """One ValueError when new runs would join results of another revision in `workdir`."""
  others = sorted({str(r.get('git_revision')) for r in lines} - {revision})
  if others and not allow_mixed:
    raise ValueError(
      f'{workdir} holds results of revision {", ".join(others)}, and this checkout is '
      f'{revision}: new runs would mix code revisions in one sweep. Use a new --workdir, rerun '
      'the whole sweep at this revision (python -m experiments.regenerate --only=NAME for a '
      'committed one), or pass --allow_mixed to add them anyway (the report lists the revisions)'
    )


def _run_parallel(
  sweep: Sweep,
  workdir: str,
  todo: list,
  parallel: int,
  log,
  revision: str,
  ignore_changes: Sequence[str] = (),
  source_dir: str = SOURCE_DIR,
) -> None:
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
          worker_command(sweep, workdir, variant, seed, revision, ignore_changes, source_dir),
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
  if failed:
    raise RuntimeError(f'{len(failed)} run(s) failed: {"; ".join(failed)}')


# Regenerating a results root -------------------------------------------------------------------
def seed_passes(sweep: Sweep, seeds: int | Mapping[str, int]) -> list[tuple[list | None, int]]:
  """[(variants or None for all, seeds)]: an int is every variant at that many seeds; a mapping
  gives some variants more seeds, '*' the rest (e.g. {'chosen': 5, '*': 1})."""
  if isinstance(seeds, int):
    return [(None, seeds)]
  named = {v: n for v, n in seeds.items() if v != '*'}
  select_variants(sweep, list(named))  # an unknown variant is one error
  passes = [([v for v in named if named[v] == n], n) for n in sorted(set(named.values()))]
  rest = [v for v in sweep.all_variants if v not in named and v not in sweep.eval_variants]
  if rest and '*' in seeds:
    passes.insert(0, (rest, seeds['*']))
  return passes


def chosen(seeds: Mapping[str, object], only: Sequence[str] | None) -> list[str]:
  """The sweeps `only` names (all of `seeds` without it); an unknown one is a ValueError."""
  names = list(only) if only else list(seeds)
  unknown = [n for n in names if n not in seeds]
  if unknown:
    raise ValueError(f'unknown sweep {unknown[0]!r}; choose from {", ".join(seeds)}')
  return names


def regenerate(
  seeds: Mapping[str, int | Mapping[str, int]],
  root: str,
  *,
  only: Sequence[str] | None = None,
  parallel: int = 1,
  gpu: bool = False,
  allow_dirty: bool = False,
  log: Callable[[str], None] = print,
  sweeps_dir: str = spec.SWEEPS_DIR,
  source_dir: str = SOURCE_DIR,
) -> str:
  """Reruns the sweeps of `seeds` (name -> seeds; `only` a subset) into root/<name>, all at the
  current commit, then writes every report and the index root/report.md; returns its path.

  `gpu` runs each at its sweep file's GPU_SCALE instead of scale 1. A sweep directory whose
  sweep.json names another revision or scale is removed first (its runs are from other code);
  one at this revision resumes. A dirty tree is one ValueError before anything runs.
  """
  names = chosen(seeds, only)
  revision = checked_revision([root], allow_dirty, source_dir)
  paths = {n: os.path.join(sweeps_dir, f'{n}.py') for n in names}
  scales = {n: spec.gpu_scale(p) if gpu else 1 for n, p in paths.items()}  # all errors first
  for i, name in enumerate(names):
    workdir = os.path.join(root, name)
    meta_path = os.path.join(workdir, SWEEP_JSON)
    if os.path.exists(meta_path):
      with open(meta_path) as f:
        meta = json.load(f)
      if (meta.get('git_revision'), meta.get('scale')) != (revision, scales[name]):
        log(f'removing {workdir}: its runs are from revision {meta.get("git_revision")} at scale '
            f'{meta.get("scale")}, not {revision} at scale {scales[name]}')  # fmt: skip
        shutil.rmtree(workdir)
    sweep = spec.load_sweep(paths[name], scales[name])
    for variants, n in seed_passes(sweep, seeds[name]):
      which = f' --variants={",".join(variants)}' if variants else ''
      log(f'[{i + 1}/{len(names)}] {name}: --seeds={n}{which} --scale={scales[name]} -> {workdir}')
      run_sweep(sweep, workdir, seeds=n, parallel=parallel, log=log, variants=variants,
                allow_dirty=allow_dirty, ignore_changes=[root], source_dir=source_dir)  # fmt: skip
  return report.write_report(root)


def rejudge(workdir: str, allow_dirty: bool = False) -> str:
  """Replaces the claim, description, compared metrics, rules, preconditions, nulls, groups and
  plots in sweep.json by those its sweep file states now, and records the revision they come from
  (`rules_revision`): the recorded numbers stay as they were run; only the judging (and the words)
  change. Returns that revision.

  Raises:
    ValueError: no results there, or (without `allow_dirty`) a source tree with changes.
  """
  meta, _ = load_results(workdir)
  sweep = spec.load_sweep(meta['path'], int(meta.get('scale', 1)))
  revision = checked_revision([workdir], allow_dirty)
  meta.update(
    claim=sweep.claim,
    description=sweep.description,
    metrics=list(sweep.metrics),
    rules=list(sweep.rules),
    preconditions=list(sweep.preconditions),
    nulls=list(sweep.nulls),
    groups=sweep.groups,
    plots=list(sweep.plots),
    rules_revision=revision,
  )
  util.write_json(os.path.join(workdir, SWEEP_JSON), meta)
  return revision
