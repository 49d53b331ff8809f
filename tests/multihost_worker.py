"""One process of a 2-process CPU job, or the 8-device single-process reference.

tests/test_sharding.py starts it:
  python tests/multihost_worker.py host PROCESS_ID PORT WORKDIR STEPS OUT_JSON   (4 devices each)
  python tests/multihost_worker.py reference STEPS OUT_JSON                      (8 devices)
"""

import json
import os
import sys

import xla_flags

MODE = sys.argv[1]
os.environ['XLA_FLAGS'] = (  # the suite's fast-compile flags (tests/xla_flags.py)
  f'--xla_force_host_platform_device_count={4 if MODE == "host" else 8} {xla_flags.fast_compile()}'
)
os.environ['JAX_PLATFORMS'] = 'cpu'

import jax  # noqa: E402
import numpy as np  # noqa: E402

from transformer import data, sharding  # noqa: E402
from transformer.training.loop import train_and_evaluate  # noqa: E402
from transformer.training.run import Run  # noqa: E402


def tiny_gpt(steps: int):
  from configs import gpt_tiny

  config = gpt_tiny.get_config()
  d = config.data
  d.tokenizer, d.vocab_multiple = 'byte', 8
  d.num_train_examples, d.num_eval_examples = 256, 16
  d.max_length, d.batch_size, d.eval_batch_size = 32, 8, 8
  config.model.max_length = 32
  t = config.train
  t.steps, t.log_every, t.eval_every, t.checkpoint_every = steps, 1, steps, 2
  t.eval_decode_examples = 0  # evaluate the loss only: decoding would add compile time
  # The same at any total steps: no warmup, which a shorter run would cut to its own length.
  config.optim.schedule, config.optim.learning_rate, config.optim.warmup_steps = 'constant', 3e-3, 0
  config.mesh.shape = (2, 2, 2)  # the data axis spans both processes
  return config


def host(process_id: int, port: int, workdir: str, steps: int, out: str) -> None:
  sharding.initialize_distributed(f'127.0.0.1:{port}', 2, process_id)
  assert jax.process_count() == 2 and jax.device_count() == 8, jax.devices()
  result = train_and_evaluate(tiny_gpt(steps), workdir)
  if jax.process_index() == 0:
    with open(out, 'w') as f:
      json.dump({s['step']: s['loss'] for s in result['train']}, f)


def reference(steps: int, out: str) -> None:
  """The same global batches on one process: the rows of process 0, then those of process 1."""
  config = tiny_gpt(steps)
  run = Run(config, None)
  shards = [
    data.build(run.experiment.data, family='causal_lm', workdir=None, seed=config.seed, **where)
    for where in ({'process_index': i, 'process_count': 2} for i in range(2))
  ]
  iterators = [task.train_iterator() for task in shards]
  state = run.init_state()
  rng = run.replicate(jax.random.PRNGKey(config.seed + 1))  # as train_and_evaluate seeds it
  losses = {}
  for step in range(1, steps + 1):
    parts = [next(it) for it in iterators]
    batch = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    state, metrics = run.train_step(state, run.place(batch), rng)
    losses[step] = float(metrics['loss']) / max(float(metrics['denominator']), 1.0)
  with open(out, 'w') as f:
    json.dump(losses, f)


if __name__ == '__main__':
  if MODE == 'host':
    host(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6])
  else:
    reference(int(sys.argv[2]), sys.argv[3])
