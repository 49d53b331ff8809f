"""Run a sweep: python -m experiments.sweep --sweep=configs/sweeps/<name>.py --workdir=DIR

  [--seeds=3] [--scale=1] [--parallel=1] [--variants=a,b] [--allow_dirty] [--allow_mixed]

Each (variant, seed) trains in DIR/<variant>/seed_<k>; results collect in DIR/results.jsonl, and
`python -m experiments.report --workdir=DIR` writes the report. Rerunning the same command skips
finished runs and resumes interrupted ones. --parallel=N runs N worker processes at once (each
logs to its run's log.txt). Runs start only from a clean git tree (each result records the
commit); --allow_dirty records '<sha>-dirty' instead. New runs do not join results of another
commit in DIR unless --allow_mixed. A sweep file is Python code: run only
sweeps you trust.
"""

from absl import flags

from experiments import cli

_SWEEP = flags.DEFINE_string('sweep', None, 'Sweep file, e.g. configs/sweeps/scaling.py.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Sweep directory (runs, results.jsonl, report).')
_SEEDS = flags.DEFINE_integer('seeds', 1, 'Seeds per variant: 0 .. seeds-1.')
_SCALE = flags.DEFINE_integer('scale', 1, 'Size multiplier passed to get_sweep (steps, width).')
_PARALLEL = flags.DEFINE_integer('parallel', 1, 'Runs at once, each in its own process.')
_VARIANTS = flags.DEFINE_list('variants', None, 'Only these variants (default: all).')
_ALLOW_DIRTY = flags.DEFINE_bool(
  'allow_dirty', False, "Run from a tree with uncommitted changes; results record '<sha>-dirty'."
)
_ALLOW_MIXED = flags.DEFINE_bool(
  'allow_mixed', False, 'Add runs to a DIR whose results come from another commit.'
)
_RUN = flags.DEFINE_string('run', None, 'Internal: run one VARIANT:SEED (a --parallel worker).')
_REVISION = flags.DEFINE_string('revision', 'unknown', 'Internal: the git revision --run records.')
_SOURCE_DIR = flags.DEFINE_string(
  'source_dir', None, "Internal: the checkout --run's git check reads (default: this one)."
)
_IGNORE_CHANGES = flags.DEFINE_list(
  'ignore_changes', [], "Internal: paths besides --workdir that --run's git check leaves out."
)
flags.mark_flags_as_required(['sweep', 'workdir'])


def main():
  from research import spec, sweeps  # after flag parsing: keeps --help fast

  sweep = spec.load_sweep(_SWEEP.value, _SCALE.value)
  if _RUN.value:
    variant, _, seed = _RUN.value.rpartition(':')
    spec.select_variants(sweep, [variant])
    result = sweeps.execute_run(
      sweep, variant, int(seed), _WORKDIR.value, _REVISION.value, _IGNORE_CHANGES.value,
      _SOURCE_DIR.value or sweeps.SOURCE_DIR,
    )  # fmt: skip
    print(f'{variant} seed {seed}: {result["status"]}, {result["wall_time_s"]:.0f} s', flush=True)
    return
  results = sweeps.run_sweep(
    sweep,
    _WORKDIR.value,
    seeds=_SEEDS.value,
    parallel=_PARALLEL.value,
    variants=_VARIANTS.value,
    log=lambda text: print(text, flush=True),
    allow_dirty=_ALLOW_DIRTY.value,
    allow_mixed=_ALLOW_MIXED.value,
  )
  print(
    f'{len(results)} results in {_WORKDIR.value}/results.jsonl; report: python -m '
    f'experiments.report --workdir={_WORKDIR.value}'
  )


if __name__ == '__main__':
  cli.run(main)
