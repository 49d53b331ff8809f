"""Training-step speed: tokens/s, memory per device and model FLOP utilisation (MFU) for a config.

  python -m experiments.bench_train --config=configs/gpt_bench.py [--steps=10]
  python -m experiments.bench_train --config=configs/gpt_bench.py --config.mesh.shape='(1,2,4)'
  python -m experiments.bench_train --config=configs/gpt_bench.py --compare=torch [--rounds=3]
  python -m experiments.bench_train --config=configs/char_lm.py --compare=torch --parts

The step is `transformer.training.run.Run.train_step`, jitted with the shardings of
`config.mesh` exactly as in training, on random tokens of the config's batch and length.
MFU = model FLOPs/s (transformer.model.models.flops_per_token) divided by the FLOP/s of a
large dense float32 matmul timed in the same process (on all devices at once, so it is only
meaningful on one device). Medians over the timed steps; memory is XLA's compiled estimate for
one device. `--compare=torch` also builds the same GPT in PyTorch eager (Hugging Face
GPT2LMHeadModel with SDPA, AdamW, the same threads) and alternates blocks of `--steps` steps of
each, `--rounds` times, so that both see the same machine load; CPU-s/step is the process CPU
time per step, steadier than wall time when other programs share the cores.

`--parts` (with --compare=torch) then splits the step the same way on both sides, alternating:
the forward pass alone, forward and backward (the gradient, no optimizer), and the whole step;
and times each distinct weight matmul of a block at the step's [B*T] rows, as the model runs it
(forward x @ W, input gradient g @ W^T, weight gradient x^T @ g) against torch.mm.
"""

import os
import resource
import time

import numpy as np
from absl import flags

from bench import timing
from experiments import cli

_CONFIG = cli.define_config('configs/gpt_bench.py')
_STEPS = flags.DEFINE_integer('steps', 10, 'Timed steps (after 2 warm-up steps), per round.')
_MATMUL = flags.DEFINE_integer('matmul_size', 2048, 'Size n of the n x n x n reference matmul.')
_COMPARE = flags.DEFINE_enum('compare', '', ['', 'torch'], 'Also time PyTorch eager, alternating.')
_ROUNDS = flags.DEFINE_integer('rounds', 3, 'With --compare: alternating rounds of --steps each.')
_PARTS = flags.DEFINE_bool(
  'parts', False, 'With --compare=torch: also time forward, gradient and weight matmuls.'
)


def _cpu_seconds() -> float:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def _timed_block(step, steps: int) -> tuple[list[float], float]:
  """Per-step wall times of `steps` calls of `step()` and the CPU seconds per step."""
  times, cpu = [], _cpu_seconds()
  for _ in range(steps):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
  return times, (_cpu_seconds() - cpu) / steps


def main():
  import jax

  from bench import torch_reference
  from transformer import sharding
  from transformer.model import models
  from transformer.training.run import Run

  sharding.use_every_core()  # as experiments.train: on CPU, the batch split over the cores
  config = _CONFIG.value
  torch = None
  if _COMPARE.value == 'torch':
    torch, missing = torch_reference.load_torch()
    if missing:
      print(missing)
      return
  run = Run(config, None, with_data=False)
  cfg = run.model_cfg
  batch_size = config.data.batch_size
  length = (
    config.data.max_length if cfg.family != 'encoder_decoder' else config.data.max_target_length
  )
  host_batch = timing.synthetic_batch(cfg, batch_size, length)
  batch = run.place(host_batch)
  state = run.init_state()
  key = run.replicate(jax.random.PRNGKey(1))
  peak_before = timing.matmul_flops_per_sec(_MATMUL.value)
  compiled = run.train_step.lower(state, batch, key).compile()
  memory = compiled.memory_analysis()
  holder = {'state': state}

  def sparrow_step():
    holder['state'], metrics = compiled(holder['state'], batch, key)
    jax.block_until_ready(metrics)

  for _ in range(2):  # warm-up
    sparrow_step()
  torch_step = None
  if torch is not None:
    threads = len(os.sched_getaffinity(0))
    reference = torch_reference.TorchGPTStep(config, cfg.vocab_size, threads)
    inputs, targets = reference.batch(host_batch['inputs'], host_batch['targets'])
    torch_step = lambda: reference.step(inputs, targets)
    for _ in range(2):
      torch_step()
  rounds = _ROUNDS.value if torch_step else 1
  blocks = {'sparrow': [], 'torch': []}
  for _ in range(rounds):  # alternate, so both see the same load
    blocks['sparrow'].append(_timed_block(sparrow_step, _STEPS.value))
    if torch_step:
      blocks['torch'].append(_timed_block(torch_step, _STEPS.value))
  peak_after = timing.matmul_flops_per_sec(_MATMUL.value)
  peak = max(peak_before, peak_after)  # the faster reference: the conservative MFU
  torch_peak = None
  if torch_step:
    torch_peak = torch_reference.torch_matmul_flops_per_sec(_MATMUL.value)
    peak = max(peak, torch_peak)
  tokens_per_step = batch_size * length
  flops = models.flops_per_token(cfg, length)['train'] * tokens_per_step
  devices = run.partitioner.mesh.devices.size

  def summary(name):
    per_round = [float(np.median(times)) for times, _ in blocks[name]]
    step_time = float(np.median(per_round))
    cpu = float(np.median([c for _, c in blocks[name]]))
    return step_time, per_round, cpu

  mem = 'n/a'
  if memory is not None:
    total = memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes
    mem = f'{total / 2**20:.0f} MiB per device (temp {memory.temp_size_in_bytes / 2**20:.0f})'
  step_time, per_round, cpu = summary('sparrow')
  times = [t for block, _ in blocks['sparrow'] for t in block]
  achieved = flops / step_time
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
    ('CPU-s/step (process)', f'{cpu:.2f}'),
    ('model FLOPs/step', f'{flops:.4g}'),
    ('achieved FLOP/s', f'{achieved / 1e9:.1f} GFLOP/s'),
    (
      f'dense matmul {_MATMUL.value}^3',
      f'{peak / 1e9:.1f} GFLOP/s (jax before {peak_before / 1e9:.1f}, after '
      f'{peak_after / 1e9:.1f}' + (f', torch {torch_peak / 1e9:.1f})' if torch_peak else ')'),
    ),
    ('MFU vs matmul', f'{100 * achieved / peak:.1f}%'),
    ('compiled memory', mem),
  ]
  width = max(len(r[0]) for r in rows)
  print('\n'.join(f'{name:<{width}}  {value}' for name, value in rows))
  if not torch_step:
    return
  print(
    f'\nside by side: {rounds} alternating rounds of {_STEPS.value} steps, '
    f'{reference.num_params:,} PyTorch parameters ({reference.attention} attention), '
    f'{threads} threads each'
  )
  print('| | tokens/s (median) | rounds | CPU-s/step | MFU vs matmul |')
  print('|---|---|---|---|---|')
  speeds = {}
  for name in ('sparrow', 'torch'):
    step_time, per_round, cpu = summary(name)
    speeds[name] = tokens_per_step / step_time
    rounds_text = ', '.join(f'{tokens_per_step / t:.0f}' for t in per_round)
    mfu = 100 * flops / step_time / peak
    print(f'| {name} | {speeds[name]:.0f} | {rounds_text} | {cpu:.2f} | {mfu:.1f}% |')
  print(f'sparrow / torch tokens/s: {speeds["sparrow"] / speeds["torch"]:.2f}x')
  if _PARTS.value:
    _parts(run, config, state_params(holder['state']), batch, reference, inputs, targets)


def state_params(state):
  """A copy of the parameters: the step donates the state it is given."""
  import jax

  return jax.tree_util.tree_map(lambda x: x.copy(), state.params)


def _alternate(pairs: dict, steps: int, rounds: int) -> dict[str, float]:
  """Median seconds of each callable, in alternating blocks of `steps` calls, `rounds` times."""
  times = {name: [] for name in pairs}
  for fn in pairs.values():
    fn()  # warm-up (and compile)
  for _ in range(rounds):
    for name, fn in pairs.items():
      times[name].append(float(np.median(_timed_block(fn, steps)[0])))
  return {name: float(np.median(t)) for name, t in times.items()}


def _parts(run, config, params, batch, reference, inputs, targets) -> None:
  """Forward, gradient and step, then each weight matmul, sparrow beside PyTorch."""
  import jax

  from transformer.training import steps
  from transformer.training.run import loss_chunk_size

  cfg = run.model_cfg
  chunk = loss_chunk_size(run.experiment.train, cfg, jax.devices()[0])
  rng = jax.random.PRNGKey(0)
  loss = lambda p: steps.loss_sums(
    run.model, run.family, p, batch, rng, label_smoothing=0.0, loss_chunk_size=chunk
  )['loss']
  forward, gradient = jax.jit(loss), jax.jit(jax.grad(loss))
  ready = lambda fn: lambda: jax.block_until_ready(fn(params))
  n, rounds = _STEPS.value, _ROUNDS.value
  parts = _alternate(
    {
      'sparrow forward': ready(forward),
      'torch forward': lambda: reference.forward(inputs, targets),
      'sparrow forward + backward': ready(gradient),
      'torch forward + backward': lambda: reference.gradient(inputs, targets),
    },
    n,
    rounds,
  )
  print(f'\nparts of the step ({rounds} alternating rounds of {n}; medians in ms):')
  print('| part | sparrow | torch | sparrow / torch time |')
  print('|---|---|---|---|')
  for part in ('forward', 'forward + backward'):
    a, b = parts[f'sparrow {part}'], parts[f'torch {part}']
    print(f'| {part} | {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.2f}x |')

  rows = batch['inputs'].shape[0] * batch['inputs'].shape[1]
  d, heads = cfg.d_model, cfg.num_heads * cfg.head_size
  shapes = {'query/key/value/out': (d, heads), 'mlp in': (d, cfg.d_ff), 'mlp out': (cfg.d_ff, d)}
  print(f'\nweight matmuls at {rows} rows (medians in us; GFLOP/s in brackets):')
  print('| matmul | x @ W sparrow / torch | g @ W^T sparrow / torch | x^T @ g sparrow / torch |')
  print('|---|---|---|---|')
  for name, (k, m) in shapes.items():
    print(_matmul_row(name, rows, k, m, max(n, 20), rounds))


def _matmul_row(name: str, rows: int, k: int, m: int, n: int, rounds: int) -> str:
  """One table row: x @ W, g @ W^T and x^T @ g for [rows, k] x [k, m], sparrow / torch."""
  import jax
  import jax.numpy as jnp
  import torch
  from jax import lax

  gen = np.random.default_rng(0)
  x, w, g = (gen.standard_normal(s).astype(np.float32) for s in ((rows, k), (k, m), (rows, m)))
  jx, jw, jg = map(jnp.asarray, (x, w, g))
  tx, tw, tg = map(torch.from_numpy, (x, w, g))
  mm, dx = jax.jit(jnp.matmul), jax.jit(lambda g, w: g @ w.T)
  dw = jax.jit(lambda x, g: lax.dot_general(x, g, (((0,), (0,)), ((), ()))))  # as layers.cpu_matmul
  t = _alternate(
    {
      'jf': lambda: mm(jx, jw).block_until_ready(),
      'tf': lambda: torch.mm(tx, tw),
      'jd': lambda: dx(jg, jw).block_until_ready(),
      'td': lambda: torch.mm(tg, tw.t()),
      'jw': lambda: dw(jx, jg).block_until_ready(),
      'tw': lambda: torch.mm(tx.t(), tg),
    },
    n,
    rounds,
  )
  flops = 2 * rows * k * m

  def cell(a, b):
    rate = lambda key: flops / t[key] / 1e9
    return f'{t[a] * 1e6:.0f} [{rate(a):.0f}] / {t[b] * 1e6:.0f} [{rate(b):.0f}]'

  return (
    f'| {name} [{rows}, {k}] x [{k}, {m}] | {cell("jf", "tf")} | {cell("jd", "td")} | '
    f'{cell("jw", "tw")} |'
  )


if __name__ == '__main__':
  cli.run(main)
