"""Sweeps: one base config, a few variants of overrides, several seeds; results in one JSONL file.

A sweep file (`configs/sweeps/<name>.py`) defines `get_sweep(scale: int) -> dict` with the fields
of `Sweep`. `run_sweep(sweep, workdir, seeds)` trains every (variant, seed) in
`workdir/<variant>/seed_<k>` (one after another, or `parallel` worker processes at a time), runs
the sweep's `measure` on each, and collects one line per run into `workdir/results.jsonl`. A
finished run is skipped on rerun and an interrupted one resumes from its latest checkpoint.
`research.report` turns the results into `report.md`; `research.verdicts` applies the rules.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence

import ml_collections

from transformer import util
from transformer.research.results import (
  SWEEP_JSON,
  config_dict,
  final_metrics,
  model_numbers,
  read_curve,
  run_dir,
  write_results,
)
from transformer.research.spec import Sweep, resolve_config, resolve_measure, select_variants
from transformer.training import faults
from transformer.training.loop import train_and_evaluate
from transformer.training.workdir import load_run

WORKER_MODULE = 'experiments.sweep'  # `python -m` entry point that runs one (variant, seed)


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
    """(Run, params): this run's config (its eval overrides included) and trained params."""
    if not os.path.exists(os.path.join(self.checkpoint_dir, 'config.json')):
      raise ValueError(f'no trained run in {self.checkpoint_dir!r} (no config.json)')
    run, state, _ = load_run(self.checkpoint_dir, config=self.config)
    return run, state.params


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
  stops being finite (training.faults.NonFiniteError) is recorded with status 'diverged' and
  infinite losses rather than stopping the sweep.
  """
  done = finished_result(sweep, variant, seed, workdir)
  if done is not None:
    return done
  import jax

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
        train_and_evaluate(config, directory)
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
  util.write_json(curve_path, curve)
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
  util.write_json(os.path.join(directory, 'result.json'), util.jsonable(result))
  return result


# The whole sweep -----------------------------------------------------------------------------
def sweep_metadata(sweep: Sweep, seeds: int) -> dict:
  """What the report needs from the sweep file, stored as workdir/sweep.json."""
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
  util.write_json(path, sweep_metadata(sweep, seeds))


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
