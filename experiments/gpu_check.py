"""The prepared device check: versions, correctness vs float64, attention and training speed.

  python -m experiments.gpu_check --out=DIR            # one H200: designed to end within 6 min
  python -m experiments.gpu_check --out=DIR --smoke    # tiny float32 shapes: the code path on CPU
  python -m experiments.gpu_check --deviceless --out=DIR [--target=h200] [--jobs=N]   # no GPU

Writes DIR/gpu_check.json and DIR/gpu_check.md (bench.device_check). With
--deviceless it compiles every attention path and the presets' training steps for the target GPU
on this machine, which needs only the CUDA plugin (`pip install 'jax-cuda12-plugin[with-cuda]'` at
jax's version), and writes DIR/deviceless.json and DIR/deviceless.md: ptxas's registers, spills,
SMEM and notes per kernel, memory per device per step. It exits with status 1 when a kernel
stops compiling, a Mosaic GPU kernel spills or gets a ptxas performance note, a Triton kernel
reaches 255 registers, or a preset's step stops fitting (bench.deviceless).
"""

import os
import sys

from absl import flags

from experiments import cli

_OUT = flags.DEFINE_string('out', None, 'Folder for gpu_check.json and gpu_check.md.')
_SMOKE = flags.DEFINE_bool('smoke', False, 'Tiny shapes and float32, so that it runs on CPU.')
_BUDGET = flags.DEFINE_float('budget_s', 330.0, 'Seconds the whole check aims to stay within.')
_REPEATS = flags.DEFINE_integer('repeats', 10, 'Timed runs per attention measurement.')
_DEVICELESS = flags.DEFINE_bool(
  'deviceless', False, 'Compile for --target on this machine (no GPU) instead of running.'
)
_TARGET = flags.DEFINE_enum('target', 'h200', ['h200', 'h100', 'a100'], 'GPU of --deviceless.')
_PARTS = flags.DEFINE_list('parts', 'attention,steps', '--deviceless: attention and/or steps.')
_JOBS = flags.DEFINE_integer(
  'jobs',
  min(4, os.cpu_count() or 1),
  '--deviceless: compiles at once, each in its own process (about one core and 2 GB each); '
  'default: the cores, at most 4.',
)


def deviceless() -> None:
  import importlib.util

  from bench import deviceless as dl  # imports no jax at module level

  bad = set(_PARTS.value) - {'attention', 'steps'}
  if bad or not _PARTS.value:
    raise ValueError(f'--parts={",".join(_PARTS.value)}: choose from attention, steps')
  if _JOBS.value < 1:
    raise ValueError(f'--jobs={_JOBS.value}: give a number of processes, 1 or more')
  try:
    plugin = importlib.util.find_spec('jax_plugins.xla_cuda12')
  except ModuleNotFoundError:  # no jax_plugins package at all
    plugin = None
  if plugin is None:
    raise ValueError(
      "--deviceless needs the CUDA plugin: pip install 'jax-cuda12-plugin[with-cuda]==V' with V "
      "jax's version (jax >= 0.11 needs Python >= 3.12)"
    )
  flags_now = os.environ.get('XLA_FLAGS', '')
  ready = (
    all(os.environ.get(k) == v for k, v in dl.ENVIRONMENT.items()) and dl.XLA_FLAG in flags_now
  )
  if not ready:  # jax reads these when it starts: start this command again with them set
    os.environ.update(dl.ENVIRONMENT)
    os.environ['XLA_FLAGS'] = f'{flags_now} {dl.XLA_FLAG}'.strip()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
  report = dl.run(_OUT.value, _TARGET.value, tuple(_PARTS.value), jobs=_JOBS.value)
  print(f'wrote {_OUT.value}/deviceless.json and deviceless.md in {report["seconds"]} s')
  if report['problems']:
    print('\n'.join(['problems:'] + report['problems']), file=sys.stderr)
    sys.exit(1)


def main():
  if not _OUT.value:
    raise ValueError('--out=DIR is required: the folder for gpu_check.json and gpu_check.md')
  if _DEVICELESS.value:
    return deviceless()
  if _BUDGET.value <= 0 or _REPEATS.value < 1:
    raise ValueError(f'--budget_s={_BUDGET.value} and --repeats={_REPEATS.value} must be positive')
  from bench import device_check

  report = device_check.run(
    _OUT.value, smoke=_SMOKE.value, budget_s=_BUDGET.value, repeats=_REPEATS.value
  )
  print(device_check.markdown(report))


if __name__ == '__main__':
  cli.run(main)
