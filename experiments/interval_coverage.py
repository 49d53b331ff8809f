"""How often the verdicts' 95% bootstrap intervals cover the truth at 3 seeds.

python -m experiments.interval_coverage [--sweeps=400]

Simulates sweeps whose true statistic is known (research/coverage.py) and prints, per case, the
share whose interval holds it: sparrow's (`estimates.bootstrap_interval`, `logistic.fit_rise`)
beside a plain percentile bootstrap of the same draws.
"""

from absl import flags

from experiments import cli

_SWEEPS = flags.DEFINE_integer('sweeps', 400, 'Simulated sweeps per case.')


def main():
  from research import coverage

  print(f'coverage of the 95% interval, {_SWEEPS.value} simulated sweeps of {coverage.SEEDS} seeds')
  print('| case | sparrow | plain percentile bootstrap |')
  print('|---|---|---|')
  for name, row in coverage.coverage(_SWEEPS.value).items():
    print(f'| {name} | {row["sparrow"]:.3f} | {row["plain"]:.3f} |')


if __name__ == '__main__':
  cli.run(main)
