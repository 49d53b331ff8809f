"""Training-step speed: tokens/s, memory per device and model FLOP utilisation (MFU) for a config.

  python -m experiments.bench_train --config=configs/gpt_bench.py [--steps=10]
  python -m experiments.bench_train --config=configs/gpt_bench.py --config.mesh.shape='(1,2,4)'

The step is `transformer.training.run.Run.train_step`, jitted with the shardings of
`config.mesh` exactly as in training, on random tokens of the config's batch and length.
MFU = model FLOPs/s (transformer.model.models.flops_per_token) divided by the FLOP/s of a
large dense float32 matmul timed in the same process (on all devices at once, so it is only
meaningful on one device). Medians over
the timed steps; memory is XLA's compiled estimate for one device.
"""

import time

import numpy as np
from absl import flags

from experiments import cli
from transformer.research import timing

_CONFIG = cli.define_config('configs/gpt_bench.py')
_STEPS = flags.DEFINE_integer('steps', 10, 'Timed steps (after 2 warm-up steps).')
_MATMUL = flags.DEFINE_integer('matmul_size', 2048, 'Size n of the n x n x n reference matmul.')


def main():
  import jax

  from transformer.model import models
  from transformer.research import measures
  from transformer.training.run import Run

  config = _CONFIG.value
  run = Run(config, None, with_data=False)
  cfg = run.model_cfg
  batch_size = config.data.batch_size
  length = (
    config.data.max_length if cfg.family != 'encoder_decoder' else config.data.max_target_length
  )
  batch = run.place(measures.synthetic_batch(cfg, batch_size, length))
  state = run.init_state()
  step_fn = run.train_step
  key = run.replicate(jax.random.PRNGKey(1))
  peak_before = timing.matmul_flops_per_sec(_MATMUL.value)
  compiled = step_fn.lower(state, batch, key).compile()
  memory = compiled.memory_analysis()
  for _ in range(2):  # warm-up
    state, metrics = step_fn(state, batch, key)
  jax.block_until_ready(metrics)
  times = []
  for _ in range(_STEPS.value):
    start = time.perf_counter()
    state, metrics = step_fn(state, batch, key)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  step_time = float(np.median(times))
  tokens_per_step = batch_size * length
  flops = models.flops_per_token(cfg, length)['train'] * tokens_per_step
  peak_after = timing.matmul_flops_per_sec(_MATMUL.value)
  peak = max(peak_before, peak_after)  # the faster reference: the conservative MFU
  achieved = flops / step_time
  devices = jax.device_count()
  mem = 'n/a'
  if memory is not None:
    total = memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes
    mem = f'{total / 2**20:.0f} MiB per device (temp {memory.temp_size_in_bytes / 2**20:.0f})'
  rows = [
    ('config', config.name),
    ('backend / devices', f'{jax.default_backend()} x {devices}'),
    ('mesh (data, fsdp, tensor)', str(tuple(run.partitioner.mesh.shape.values()))),
    ('parameters', f'{models.count_params(cfg):,}'),
    ('batch x length', f'{batch_size} x {length}'),
    (
      'step time (median)',
      f'{step_time * 1e3:.1f} ms  [min {min(times) * 1e3:.1f}, '
      f'max {max(times) * 1e3:.1f}] over {len(times)} steps',
    ),
    (
      'tokens/s',
      f'{tokens_per_step / step_time:,.0f} '
      f'({tokens_per_step / step_time / devices:,.0f} per device)',
    ),
    ('model FLOPs/step', f'{flops:.4g}'),
    ('achieved FLOP/s', f'{achieved / 1e9:.1f} GFLOP/s'),
    (
      f'dense matmul {_MATMUL.value}^3',
      f'{peak / 1e9:.1f} GFLOP/s (before {peak_before / 1e9:.1f}, after {peak_after / 1e9:.1f})',
    ),
    ('MFU vs matmul', f'{100 * achieved / peak:.1f}%'),
    ('compiled memory', mem),
  ]
  width = max(len(r[0]) for r in rows)
  print('\n'.join(f'{name:<{width}}  {value}' for name, value in rows))


if __name__ == '__main__':
  cli.run(main)
