"""Prints the float16 softmax overflow measurement (seed §4.3) as a Markdown table.

python -m experiments.numerics [--max_logits=8,10,11,11.5,12,16]
"""

from absl import flags

from experiments import cli

_MAX_LOGITS = flags.DEFINE_list(
  'max_logits', ['8', '10', '11', '11.5', '12', '16'], 'Peak unscaled logits to test.'
)


def main():
  from research import numerics

  peaks = [float(m) for m in _MAX_LOGITS.value]
  got = numerics.softmax_overflow(peaks)
  paths = ('naive_fp16', 'stable_fp16', 'xla', 'chunked', 'rounding')
  heads = [f'{p}: inf/NaN rows, zero rows, max error' for p in paths[:-1]]
  heads += ['float16 rounding alone: max error']
  print('| peak logit | ' + ' | '.join(heads) + ' |')
  print('|---' * (len(paths) + 1) + '|')
  for m in peaks:
    cells = []
    for p in paths:
      err = f'{got[f"{p}.max_err@{m:g}"]:.2g}'
      if p != 'rounding':
        err = f'{got[f"{p}.nonfinite@{m:g}"]:.0%}, {got[f"{p}.zero_rows@{m:g}"]:.0%}, {err}'
      cells.append(err)
    print(f'| {m:g} | ' + ' | '.join(cells) + ' |')


if __name__ == '__main__':
  cli.run(main)
