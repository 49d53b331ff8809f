"""Quality floors for the first commands of README: short runs of the default recipe and of
gpt_tiny must reach numbers that their known regressions miss, so a change that makes
`python -m experiments.train` worse turns CI red.

The floors come from measured runs (`python tests/training/test_quality.py` prints them, under
the suite's XLA flags); each constant below says what was measured.
"""

import re
import sys

import pytest

from configs import default, gpt_tiny
from transformer.training.loop import train_and_evaluate

# The default recipe (configs/default.py) cut to DEFAULT_STEPS at seed 0; its schedule follows
# the length. Measured at 300 steps under the suite's XLA flags: BLEU 98.24 at seed 0 and 99.32
# at seed 1, but 73.23 at seed 2 (a 300-step run is not seed-proof, so the test holds seed 0).
# The old recipe (rsqrt, peak 0.0051 at step 300; the code of 59b3678) gives 81.13 at seed 0,
# and its full 1000-step run 87.5: both fail the floor.
DEFAULT_STEPS = 300
BLEU_FLOOR = 95.0
# gpt_tiny cut to GPT_STEPS at seed 0: eval loss 1.682 (seed 0) and 1.688 (seed 1), 0.142 and
# 0.148 nats/token above the floor 1.540 (1000 steps end 0.031 above it; the unigram entropy,
# what a model that ignores context reaches, is 2.89 above).
GPT_STEPS = 200
GPT_TOLERANCE = 0.2  # nats/token above the grammar's entropy floor


def short(config, steps: int, seed: int = 0):
  """`config` cut to `steps`, evaluated and checkpointed once at the end."""
  config.seed = seed
  t = config.train
  t.steps = t.eval_every = t.checkpoint_every = t.log_every = steps
  t.num_samples = 1
  return config


def short_default(steps: int = DEFAULT_STEPS, seed: int = 0):
  return short(default.get_config(), steps, seed)


def short_gpt_tiny(steps: int = GPT_STEPS, seed: int = 0):
  return short(gpt_tiny.get_config(), steps, seed)


def entropy_floor(printed: str) -> float:
  """The floor the run prints: 'entropy floor 1.540 nats/token (unigram ...)'."""
  found = re.search(r'entropy floor ([0-9.]+) nats/token', printed)
  assert found, 'the run did not print its entropy floor'
  return float(found.group(1))


def test_a_short_default_run_reaches_the_bleu_floor(tmp_path):
  result = train_and_evaluate(short_default(), str(tmp_path))
  assert result['step'] == DEFAULT_STEPS
  bleu = result['eval']['bleu']
  assert bleu >= BLEU_FLOOR, (
    f'{DEFAULT_STEPS} steps of configs/default.py reach BLEU {bleu:.1f} < {BLEU_FLOOR}: the '
    'default run got worse (see docs/results/default_recipe for what it reached)'
  )


def test_a_short_gpt_tiny_run_nears_the_entropy_floor(tmp_path, capfd):
  result = train_and_evaluate(short_gpt_tiny(), str(tmp_path))
  floor = entropy_floor(capfd.readouterr().out)  # capfd: sentencepiece needs a real stderr
  assert floor == pytest.approx(1.540, abs=5e-4)  # configs/gpt_tiny.py's grammar, as README says
  gap = result['eval']['loss'] - floor
  assert 0 < gap <= GPT_TOLERANCE, (
    f'{GPT_STEPS} steps of configs/gpt_tiny.py end {gap:.3f} nats/token above the entropy floor '
    f'{floor:.3f}; the tolerance is {GPT_TOLERANCE}'
  )


if __name__ == '__main__':  # measures the floors: python tests/training/test_quality.py [seeds]
  import os
  import tempfile
  import time

  os.environ['XLA_FLAGS'] = '--xla_backend_optimization_level=0'  # as tests/conftest.py sets
  seeds = range(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
  for name, make in (('default', short_default), ('gpt_tiny', short_gpt_tiny)):
    for seed in seeds:
      start = time.time()
      with tempfile.TemporaryDirectory() as workdir:
        metrics = train_and_evaluate(make(seed=seed), workdir)['eval']
      wall = time.time() - start
      print(f'RESULT {name} seed {seed}: {metrics} ({wall:.0f} s)', flush=True)
