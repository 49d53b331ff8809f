"""Write a sweep's report: python -m experiments.report --workdir=DIR

DIR/report.md gets loss curves with a band over seeds, final metrics with error bars, a table in
the layout of the paper's Table 3, and the verdict of the claim computed from the numbers by the
sweep's rules. A DIR whose subdirectories hold sweeps gets an index of their verdicts.
"""

from absl import flags

from experiments import cli

_WORKDIR = flags.DEFINE_string('workdir', None, 'Sweep directory (or a directory of them).')
flags.mark_flag_as_required('workdir')


def main():
  from transformer.research import report

  print(f'wrote {report.write_report(_WORKDIR.value)}')


if __name__ == '__main__':
  cli.run(main)
