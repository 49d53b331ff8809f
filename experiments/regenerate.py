"""Regenerate every committed sweep: python -m experiments.regenerate

  [--only=a,b] [--parallel=1] [--gpu] [--root=docs/results] [--preflight]

Reruns each sweep of SEEDS into ROOT/<name> with its seeds, at the current commit (a dirty tree
is refused), then writes every report and the index ROOT/report.md. A sweep directory from
another commit is removed first; rerunning after an interruption resumes. --gpu runs each sweep
at its file's GPU_SCALE, into docs/results_gpu unless --root says otherwise.

--preflight first: every variant of the chosen sweeps, seed 0, trains 8 steps and is measured as
its sweep would be, in a temporary directory (nothing under ROOT is touched), and the command
fails naming each variant that raised (docs/research.md: how long it takes).
"""

from absl import flags

from experiments import cli

# Sweep -> seeds of its committed results: the one table of them (README's commands agree, a test
# checks). Three at least: a rule counts only over 3 seeds (research.verdicts.MIN_SEEDS), unless
# it is exact (the compiled memory of attention_memory's every rule does not vary with the seed).
SEEDS = {
  'scaling': 3,
  'heads': 3,
  'positions': 3,
  'extrapolation': 3,
  'warmup': 3,  # one seed's warmup-against-none gaps moved with the code's random streams
  'label_smoothing': 3,  # one seed's ordering of training NLL moved with the random streams
  'dropout': 3,
  'norm_placement': 3,
  'attention_memory': 1,  # every rule is exact: XLA's compiled memory
  'remat': 3,  # its memory rule is exact; its time rule is not
  'model_scaling': 3,
  'cross_attention_alignment': 3,
  'bidirectional_vs_causal': 3,
  'long_context': 3,
  'recall_mqar': 3,  # its rules compare arms over seeds, each seed on its own data
  'induction': 3,  # a phase change at every seed, not at one
  'rope_scaling_vs_long_training': 3,
  'output_init': 3,
  'emergence': 3,  # a jump at one size must stand out from the seeds' noise
  'ood_generalization': 3,  # its preconditions and ceilings hold at every seed
  'data_repetition': 3,
  'residual_and_norm': 3,
  # The chosen recipe and the old one at five seeds, the screened candidates at seed 0.
  'default_recipe': {'cos3e-3_w100': 5, 'rsqrt': 5, '*': 1},
}
ROOT, GPU_ROOT = 'docs/results', 'docs/results_gpu'

_ONLY = flags.DEFINE_list('only', None, f'Only these sweeps (default: all): {", ".join(SEEDS)}.')
_PARALLEL = flags.DEFINE_integer('parallel', 1, 'Runs at once per sweep, each in its own process.')
_GPU = flags.DEFINE_bool('gpu', False, "Each sweep at its file's GPU_SCALE, into docs/results_gpu.")
_ROOT = flags.DEFINE_string('root', None, f'Results root (default {ROOT}; --gpu: {GPU_ROOT}).')
_PREFLIGHT = flags.DEFINE_bool(
  'preflight', False, 'Only check that every variant still runs: 8 steps each, in a temporary dir.'
)
_ALLOW_DIRTY = flags.DEFINE_bool(
  'allow_dirty', False, "Run from a tree with uncommitted changes; results record '<sha>-dirty'."
)


def main():
  from research import sweeps  # after flag parsing: keeps --help fast

  if _PREFLIGHT.value:
    _preflight(sweeps)
    return
  root = _ROOT.value or (GPU_ROOT if _GPU.value else ROOT)
  index = sweeps.regenerate(
    SEEDS,
    root,
    only=_ONLY.value,
    parallel=_PARALLEL.value,
    gpu=_GPU.value,
    allow_dirty=_ALLOW_DIRTY.value,
    log=lambda text: print(text, flush=True),
  )
  print(f'wrote {index}')


def _preflight(sweeps) -> None:
  import tempfile

  from research import spec

  names = sweeps.chosen(SEEDS, _ONLY.value)
  with tempfile.TemporaryDirectory(prefix='preflight-') as workdir:
    paths = [f'{spec.SWEEPS_DIR}/{name}.py' for name in names]
    failed = sweeps.preflight(paths, workdir, log=lambda text: print(text, flush=True))
  if failed:
    listed = '; '.join(f'{name} {variant} ({error})' for name, variant, error in failed)
    raise ValueError(f'{len(failed)} variants do not run at this commit: {listed}')
  print(f'every variant of {len(names)} sweeps runs')


if __name__ == '__main__':
  cli.run(main)
