"""Training-step speed with and without huge pages for host buffers (experiments/cli.py).

  python -m experiments.bench_huge_pages [--config=configs/gpt_tiny.py] [--steps=20] [--rounds=3]

The setting is made when a process starts, so each side is its own `experiments.bench_train`
process: 'off' runs under GLIBC_TUNABLES=glibc.malloc.hugetlb=0, 'on' as every command starts
(glibc.malloc.hugetlb=1 where the kernel gives transparent huge pages on request). The two
alternate for --rounds rounds, so both see the same load; the table gives each round's median
step time, the median over rounds, CPU-s/step, the process's minor page faults (compilation
included) and the ratio.
"""

import os
import re
import resource
import subprocess
import sys

import numpy as np
from absl import flags

from experiments import cli

_CONFIG = flags.DEFINE_string('config', 'configs/gpt_tiny.py', 'Config file for bench_train.')
_STEPS = flags.DEFINE_integer('steps', 20, 'Timed steps per process (bench_train --steps).')
_ROUNDS = flags.DEFINE_integer('rounds', 3, 'Alternating rounds of one process per side.')


def _bench(tunables: str | None) -> tuple[float, float, int]:
  """(median step ms, CPU-s/step, minor page faults) of one bench_train process."""
  env = {k: v for k, v in os.environ.items() if k != 'GLIBC_TUNABLES'}
  if tunables:
    env['GLIBC_TUNABLES'] = tunables
  command = [sys.executable, '-m', 'experiments.bench_train', f'--config={_CONFIG.value}']
  command.append(f'--steps={_STEPS.value}')
  faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
  out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
  faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - faults
  step = float(re.search(r'step time \(median\)\s+([0-9.]+) ms', out).group(1))
  cpu = float(re.search(r'CPU-s/step \(process\)\s+([0-9.]+)', out).group(1))
  return step, cpu, faults


def main():
  sides = {'off': 'glibc.malloc.hugetlb=0', 'on': None}
  results = {name: [] for name in sides}
  for _ in range(_ROUNDS.value):
    for name, tunables in sides.items():
      results[name].append(_bench(tunables))
  try:
    with open('/sys/kernel/mm/transparent_hugepage/enabled') as f:
      mode = f.read().strip()
  except OSError:
    mode = 'not Linux'
  print(f'{_CONFIG.value}, {_STEPS.value} steps per process, {_ROUNDS.value} rounds; THP: {mode}')
  print('| huge pages | step ms (median) | rounds | CPU-s/step | minor faults (process) |')
  print('|---|---|---|---|---|')
  medians = {}
  for name, rows in results.items():
    steps, cpus, faults = zip(*rows)
    medians[name] = float(np.median(steps))
    rounds = ', '.join(f'{s:.1f}' for s in steps)
    print(
      f'| {name} | {medians[name]:.1f} | {rounds} | {np.median(cpus):.3f} '
      f'| {int(np.median(faults)):,} |'
    )
  print(f'off / on step time: {medians["off"] / medians["on"]:.2f}x')


if __name__ == '__main__':
  cli.run(main)
