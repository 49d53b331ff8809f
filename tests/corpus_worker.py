"""One process of a 2-process CPU run on llm.c shards, or a single process with all 8 devices.

tests/training/test_corpus_run.py starts it:
  python tests/corpus_worker.py host PROCESS_ID PORT SHARDS WORKDIR STEPS OUT_JSON  (4 devices each)
  python tests/corpus_worker.py single SHARDS WORKDIR STEPS OUT_JSON                (8 devices)
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

from transformer import sharding  # noqa: E402
from transformer.training.loop import train_and_evaluate  # noqa: E402


def tiny_speedrun(shards: str, steps: int):
  from configs import gpt2_speedrun

  config = gpt2_speedrun.get_config()
  m, d, t = config.model, config.data, config.train
  m.d_model, m.num_heads, m.d_ff, m.num_layers, m.max_length = 32, 2, 64, 1, 32
  m.dtype = 'float32'
  d.train_path, d.eval_path = f'{shards}/fineweb_train_*.bin', f'{shards}/fineweb_val_*.bin'
  d.max_length, d.batch_size, d.eval_batch_size, d.eval_batches = 32, 8, 8, 1
  t.steps, t.grad_accum_steps, t.log_every, t.eval_every, t.checkpoint_every = steps, 1, 1, 100, 2
  # The same at any total steps: no warmup, which a shorter run would cut to its own length.
  config.optim.schedule, config.optim.learning_rate, config.optim.warmup_steps = 'constant', 3e-3, 0
  config.mesh.shape = (2, 2, 2)  # the data axis spans both processes
  return config


def main() -> None:
  if MODE == 'host':
    process_id, port, shards, workdir, steps, out = sys.argv[2:]
    sharding.initialize_distributed(f'127.0.0.1:{port}', 2, int(process_id))
  else:
    shards, workdir, steps, out = sys.argv[2:]
  import jax

  result = train_and_evaluate(tiny_speedrun(shards, int(steps)), workdir)
  if jax.process_index() == 0:
    with open(out, 'w') as f:
      json.dump({s['step']: s['loss'] for s in result['train']}, f)


if __name__ == '__main__':
  main()
