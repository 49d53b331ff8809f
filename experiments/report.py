"""Write a sweep's report: python -m experiments.report --workdir=DIR

DIR/report.md gets loss curves with a band over seeds, final metrics with error bars, a table in
the layout of the paper's Table 3, and the verdict of the claim computed from the numbers by the
sweep's rules. A DIR whose subdirectories hold sweeps gets an index of their verdicts.

  python -m experiments.report --workdir=DIR --rejudge

first replaces the rules and preconditions recorded with the runs by those the sweep file states
at this (committed) revision, and says so in the report: the numbers stay as they were run.
"""

from absl import flags

from experiments import cli

_WORKDIR = flags.DEFINE_string('workdir', None, 'Sweep directory (or a directory of them).')
flags.mark_flag_as_required('workdir')
_REJUDGE = flags.DEFINE_bool(
  'rejudge', False, "Judge the recorded runs by the sweep file's current rules (one sweep DIR)."
)
_ALLOW_DIRTY = flags.DEFINE_bool(
  'allow_dirty', False, 'With --rejudge: allow uncommitted changes (recorded as <sha>-dirty).'
)


def main():
  from research import report

  if _REJUDGE.value:
    from research import sweeps

    revision = sweeps.rejudge(_WORKDIR.value, _ALLOW_DIRTY.value)
    print(f'rules of revision {revision} recorded in {_WORKDIR.value}')
  print(f'wrote {report.write_report(_WORKDIR.value)}')


if __name__ == '__main__':
  cli.run(main)
