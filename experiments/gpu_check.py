"""The prepared device check: versions, correctness vs float64, attention and training speed.

  python -m experiments.gpu_check --out=DIR            # one H200: designed to end within 6 min
  python -m experiments.gpu_check --out=DIR --smoke    # tiny float32 shapes: the code path on CPU

Writes DIR/gpu_check.json and DIR/gpu_check.md (transformer.research.device_check).
"""

from absl import flags

from experiments import cli

_OUT = flags.DEFINE_string('out', None, 'Folder for gpu_check.json and gpu_check.md.')
_SMOKE = flags.DEFINE_bool('smoke', False, 'Tiny shapes and float32, so that it runs on CPU.')
_BUDGET = flags.DEFINE_float('budget_s', 330.0, 'Seconds the whole check aims to stay within.')
_REPEATS = flags.DEFINE_integer('repeats', 10, 'Timed runs per attention measurement.')


def main():
  from transformer.research import device_check

  if not _OUT.value:
    raise ValueError('--out=DIR is required: the folder for gpu_check.json and gpu_check.md')
  if _BUDGET.value <= 0 or _REPEATS.value < 1:
    raise ValueError(f'--budget_s={_BUDGET.value} and --repeats={_REPEATS.value} must be positive')
  report = device_check.run(
    _OUT.value, smoke=_SMOKE.value, budget_s=_BUDGET.value, repeats=_REPEATS.value
  )
  print(device_check.markdown(report))


if __name__ == '__main__':
  cli.run(main)
