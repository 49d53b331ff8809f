"""Compile every GPU path for a GPU this machine does not have: ptxas's report of each attention
kernel, and the compiled memory per device of the presets' training steps on 1 and 8 GPUs.

XLA compiles for a `GpuTargetConfig` with no device present, through LLVM and ptxas to sm_90a
cubins. That proves compilation, registers, spills, shared memory and memory per device, not
speed: nothing is autotuned. Needs the CUDA plugin (`pip install
'jax-cuda12-plugin[with-cuda]'` at jax's version) and `ENVIRONMENT` set before jax is imported.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import multiprocessing
import os
import shutil
import tempfile
import time
import traceback

from bench import ptxas

GiB = 2**30
# Set before jax is imported: CUDA is the compile target only, the backend stays the CPU; ptxas
# logs its resources for nvJitLink-built kernels (Triton, XLA) on stderr.
ENVIRONMENT = {
  'CUDA_VISIBLE_DEVICES': '-1',
  'JAX_SKIP_CUDA_CONSTRAINTS_CHECK': '1',
  'JAX_PLATFORMS': 'cpu',
  'TF_CPP_MIN_LOG_LEVEL': '0',
  'TF_CPP_VMODULE': 'nvjitlink=3',
  'MOSAIC_GPU_DUMP_PTXAS': '1',
}
XLA_FLAG = '--xla_gpu_ptx_compiler_extra_flags=-v'
FIT_FRACTION = 0.9  # a step fits when it needs at most this share of the GPU's memory


@dataclasses.dataclass(frozen=True)
class Gpu:
  """What XLA needs to know of a GPU to compile for it."""

  kind: str  # device_description_str, also the device kind that kernels.target reads
  capability: tuple[int, int]
  sms: int
  smem_per_block_optin: int
  smem_per_sm: int
  memory_bytes: int
  bandwidth: float  # bytes/s
  clock_ghz: float
  l2_bytes: int

  def target_config(self) -> str:
    """The `xla.GpuTargetConfig` text proto of this GPU."""
    major, minor = self.capability
    return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.smem_per_sm}
  threads_per_core_limit: 2048
  core_count: {self.sms}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.bandwidth)}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes}
  shared_memory_per_block_optin: {self.smem_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 9 }}
device_description_str: "{self.kind}"
"""


TARGETS = {
  'h200': Gpu('NVIDIA H200', (9, 0), 132, 232448, 233472, 150754820096, 4.8e12, 1.98, 50 * 2**20),
  'h100': Gpu(
    'NVIDIA H100 80GB HBM3', (9, 0), 132, 232448, 233472, 85520809984, 3.35e12, 1.98, 50 * 2**20
  ),
  'a100': Gpu(
    'NVIDIA A100-SXM4-80GB', (8, 0), 108, 166912, 167936, 85899345920, 2.04e12, 1.41, 40 * 2**20
  ),
}


@functools.cache
def mesh_for(gpu: Gpu, num_devices: int = 1):
  """A one-axis mesh over `num_devices` GPUs of kind `gpu` in one host, with no GPU present."""
  from jax.experimental import topologies

  topo = topologies.get_topology_desc(
    platform='cuda', topology=f'1x1x{num_devices}', target_config=gpu.target_config()
  )
  return topologies.make_mesh(topo, (num_devices,), ('x',))


# --- Attention kernels -------------------------------------------------------------------------
IMPLEMENTATIONS = ('pallas_mosaic', 'pallas_triton', 'cudnn', 'chunked', 'xla')
MASKS = ('full', 'causal', 'segments', 'window')
WINDOW = (256, 0)


@dataclasses.dataclass(frozen=True)
class AttentionCase:
  implementation: str
  head_dim: int
  mask: str
  dtype: str
  backward: bool
  length: int = 2048
  kv_heads: int = 8  # of 8 query heads: 2 is GQA 4:1
  batch: int = 2

  @property
  def name(self) -> str:
    gqa = f' gqa{8 // self.kv_heads}:1' if self.kv_heads != 8 else ''
    return (
      f'{self.implementation} H={self.head_dim} {self.mask}{gqa} {self.dtype} '
      f'{"fwd+bwd" if self.backward else "fwd"} T={self.length}'
    )


def attention_cases(gpu: Gpu) -> list[AttentionCase]:
  """Every kernel configuration at T=2048, then the memory sweep over T at head dim 128."""
  hopper = gpu.capability[0] >= 9
  cases = []
  for impl in ('pallas_mosaic', 'pallas_triton'):
    if impl == 'pallas_mosaic' and not hopper:
      continue
    for h in (64, 128, 256):
      for mask in MASKS:
        for backward in (False, True):
          cases.append(AttentionCase(impl, h, mask, 'bfloat16', backward))
      for mask in ('causal', 'window'):
        cases.append(AttentionCase(impl, h, mask, 'bfloat16', True, kv_heads=2))
      cases.append(AttentionCase(impl, h, 'causal', 'float16', True))
      if impl == 'pallas_triton':
        cases.append(AttentionCase(impl, h, 'causal', 'float32', True))
  for impl in ('cudnn', 'chunked', 'xla'):
    for h in (64, 128, 256):
      for mask in MASKS:
        cases.append(AttentionCase(impl, h, mask, 'bfloat16', True))
      cases.append(AttentionCase(impl, h, 'causal', 'bfloat16', True, kv_heads=2))
      cases.append(AttentionCase(impl, h, 'causal', 'float16', True))
      if impl != 'cudnn':  # cuDNN's fused attention takes 16-bit inputs only
        cases.append(AttentionCase(impl, h, 'causal', 'float32', True))
  for impl in IMPLEMENTATIONS:
    if impl == 'pallas_mosaic' and not hopper:
      continue
    for length in (1024, 4096, 16384):
      cases.append(AttentionCase(impl, 128, 'causal', 'bfloat16', True, length=length, batch=1))
  return cases


def _attention_fn(case: AttentionCase):
  import jax.numpy as jnp

  from transformer.kernels import flash_attention
  from transformer.model.attention import MaskSpec, dot_product_attention

  causal, window = case.mask == 'causal', WINDOW if case.mask == 'window' else None
  segments = case.mask == 'segments'

  def attend(q, k, v, ids):
    if case.implementation.startswith('pallas'):
      backend = 'mosaic_gpu' if case.implementation == 'pallas_mosaic' else 'gpu'
      seg = dict(q_segment_ids=ids, kv_segment_ids=ids) if segments else {}
      return flash_attention(q, k, v, causal=causal, window=window, backend=backend, **seg)
    spec = MaskSpec(
      causal=causal,
      window=window,
      q_segment_ids=ids if segments else None,
      kv_segment_ids=ids if segments else None,
    )
    return dot_product_attention(q, k, v, mask=spec, implementation=case.implementation)

  if not case.backward:
    return attend

  import jax

  def loss(q, k, v, ids):
    return attend(q, k, v, ids).astype(jnp.float32).sum()

  return jax.grad(loss, argnums=(0, 1, 2))


def compile_attention(case: AttentionCase, mesh, dump_dir: str) -> dict:
  """Compiles one case for the mesh's GPU; its kernels as ptxas built them, and its memory."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec

  sharding = NamedSharding(mesh, PartitionSpec())
  dtype = jnp.dtype(case.dtype)
  q = jax.ShapeDtypeStruct((case.batch, case.length, 8, case.head_dim), dtype, sharding=sharding)
  kv_shape = (case.batch, case.length, case.kv_heads, case.head_dim)
  kv = jax.ShapeDtypeStruct(kv_shape, dtype, sharding=sharding)
  ids = jax.ShapeDtypeStruct((case.batch, case.length), jnp.int32, sharding=sharding)
  result = dataclasses.asdict(case) | {'name': case.name}
  return result | _compile(_attention_fn(case), (q, kv, kv, ids), mesh, dump_dir, sparrow_only=True)


def _compile(fn, args, mesh, dump_dir: str, sparrow_only: bool, jit=None) -> dict:
  """jit(fn).lower(*args).compile() for the mesh's GPU, with the kernels ptxas reported."""
  import jax

  shutil.rmtree(dump_dir, ignore_errors=True)
  os.makedirs(dump_dir)
  os.environ['MOSAIC_GPU_DUMP_TO'] = dump_dir
  start = time.perf_counter()
  try:
    with ptxas.captured_stderr() as log, jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      compiled = (jit or jax.jit(fn)).lower(*args).compile()
  except Exception as error:  # a path that does not compile is a finding, not a crash
    message = str(error).strip().splitlines()
    return {'ok': False, 'error': f'{type(error).__name__}: {message[0] if message else ""}'[:400]}
  seconds = time.perf_counter() - start
  kernels = ptxas.mosaic_kernels(dump_dir)  # Mosaic's own report first: it knows the SMEM
  kernels += [k for k in ptxas.parse_log(log[0]) if k.name not in {m.name for m in kernels}]
  if sparrow_only:
    kernels = [k for k in kernels if k.name.startswith('sparrow_')]
  memory = compiled.memory_analysis()
  return {
    'ok': True,
    'compile_s': round(seconds, 1),
    'kernels': [k.as_dict() for k in kernels],
    'xla_kernels': sum(1 for k in kernels if not k.name.startswith('sparrow_')),
    **_memory(memory),
  }


def _memory(stats) -> dict:
  if stats is None:
    return {}
  total = (
    stats.argument_size_in_bytes
    + stats.output_size_in_bytes
    - stats.alias_size_in_bytes
    + stats.temp_size_in_bytes
  )
  return {
    'argument_bytes': stats.argument_size_in_bytes,
    'output_bytes': stats.output_size_in_bytes,
    'alias_bytes': stats.alias_size_in_bytes,
    'temp_bytes': stats.temp_size_in_bytes,
    'total_bytes': total,
  }


# --- Training steps ----------------------------------------------------------------------------
# Config file and its overrides here: bf16 (the GPU recipe) and GPT-2's vocabulary padded to
# 50304 (as gpt_1b has it), so that 4-way tensor parallelism splits it.
PRESETS = {  # configs/<name>.py and its overrides here
  'gpt2_small': {'model.dtype': 'bfloat16', 'data.batch_size': 16, 'model.vocab_size': 50304},
  'gpt_1b': {},
  'llama_7b': {},
}
# (data, fsdp, tensor) meshes of 8 GPUs; tensor parallelism splits heads, so 4 ways with data 2.
MESHES = {'1 GPU': (1, 1, 1), 'dp 8': (8, 1, 1), 'fsdp 8': (1, 8, 1), 'dp 2 x tp 4': (2, 1, 4)}
# Every preset's step, as configured, must keep fitting in FIT_FRACTION of the GPU's memory on
# every mesh (CI fails when one stops); the 7B on one GPU too: full remat leaves its float32
# weights, gradients and Adam moments (116 GB) the bulk of it.
IMPL_VARIANTS = ('pallas', 'cudnn')  # gpt2_small on one GPU; its own config takes 'xla'


def step_cases() -> list[tuple[str, str, str]]:
  """(preset, mesh, attention implementation) of every training step to compile."""
  cases = [(p, m, 'config') for p in PRESETS for m in MESHES]
  cases += [('gpt2_small', '1 GPU', impl) for impl in IMPL_VARIANTS]
  return cases


def load_preset(preset: str, implementation: str = 'config'):
  """The preset's config (`configs/<preset>.py`) with this check's overrides."""
  import importlib

  overrides = PRESETS[preset]
  config = importlib.import_module(f'configs.{preset}').get_config()
  for key, value in overrides.items():
    section, name = key.split('.')
    config[section][name] = value
  if implementation != 'config':  # dropout on attention probabilities would take the 'xla' path
    config.model.attention_impl = implementation
    config.model.attention_dropout_rate = 0.0
  return config


def compile_step(preset: str, mesh_name: str, implementation: str, gpu: Gpu, dump_dir: str) -> dict:
  """The preset's jitted train step (`transformer.training.run.Run`) compiled for `gpu` x N."""
  import jax

  from bench import timing
  from transformer.training.run import Run

  config = load_preset(preset, implementation)
  shape = MESHES[mesh_name]
  n = shape[0] * shape[1] * shape[2]
  config.mesh.shape = shape
  mesh = mesh_for(gpu, n)
  result = {
    'preset': preset,
    'mesh': mesh_name,
    'mesh_shape': list(shape),
    'attention': config.model.attention_impl or 'auto',
    'dtype': config.model.dtype,
    'remat': config.model.remat,
    'scan_layers': config.model.scan_layers,
    'batch': config.data.batch_size,
    'length': config.data.max_length,
    'must_fit': implementation == 'config',
  }
  try:  # under the target's mesh: the model's init traces attention, which checks the target
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      run = Run(config, None, list(mesh.devices.flat), with_data=False)
  except ValueError as error:
    return result | {'ok': False, 'error': f'ValueError: {error}'[:400]}
  host = timing.synthetic_batch(run.model_cfg, config.data.batch_size, config.data.max_length)
  batch_sharding = run.partitioner.batch_sharding()
  batch = {
    k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sharding) for k, v in host.items()
  }
  key = jax.ShapeDtypeStruct((2,), 'uint32', sharding=run.partitioner.replicated)
  result['parameters'] = sum(int(x.size) for x in jax.tree.leaves(run.abstract_state.params))
  args = (run.abstract_state, batch, key)
  out = _compile(None, args, run.partitioner.mesh, dump_dir, False, run.train_step)
  if out.get('ok'):
    out['fits'] = out['total_bytes'] <= FIT_FRACTION * gpu.memory_bytes
  return result | out


# --- The whole check ---------------------------------------------------------------------------
# Known limits, measured (`python -m experiments.gpu_check --deviceless`): kernels allowed to spill
# up to these bytes. The check fails when any other kernel spills or when one of these spills more.
# Mosaic GPU at head dim 256 keeps forward-only guarantees: its dQ and dK/dV hold [64, 256] float32
# accumulators in 255 registers. Triton in float32 (not a GPU training dtype) and its head-dim-256
# dK/dV sit at the register ceiling.
def allowed_spill(case: dict, kernel: dict) -> int:
  name, h = kernel['name'], case['head_dim']
  if case['implementation'] == 'pallas_mosaic':
    if h == 256 and ('_dkv' in name or '_dq' in name):
      return 2048 if '_dkv' in name else 384
    return 0
  if case['dtype'] == 'float32':
    return 4096
  return 64 if h == 256 and '_dkv' in name else 0


def at_ceiling_allowed(case: dict, kernel: dict) -> bool:
  return case['dtype'] == 'float32' or (case['head_dim'] == 256 and '_dkv' in kernel['name'])


def problems(report: dict) -> list[str]:
  """What makes the check fail: a Pallas kernel that did not compile; a kernel that spills beyond
  `allowed_spill`; a Mosaic GPU kernel with a ptxas performance note (C75xx: register reallocation
  ignored, wgmma serialised) outside those limits; a Triton kernel at the register ceiling; or a
  preset's step that stopped fitting or compiling."""
  found = []
  for case in report['attention']:
    if not case['ok']:
      if case['implementation'].startswith('pallas') and case['dtype'] != 'float32':
        found.append(f'{case["name"]}: did not compile: {case["error"]}')
      continue
    for k in case['kernels']:
      limit = allowed_spill(case, k)
      if k['spill_stores'] > limit:
        found.append(
          f'{case["name"]}: {k["name"]} spills {k["spill_stores"]} bytes (limit {limit})'
        )
      if case['implementation'] == 'pallas_mosaic' and k['warnings'] and not limit:
        found.append(f'{case["name"]}: {k["name"]}: ptxas notes {k["warnings"]}')
      triton = case['implementation'] == 'pallas_triton'
      if triton and k['registers'] >= ptxas.REGISTER_CEILING and not at_ceiling_allowed(case, k):
        found.append(f'{case["name"]}: {k["name"]} uses {k["registers"]} registers')
  for step in report['steps']:
    if step['must_fit'] and not (step['ok'] and step['fits']):
      what = step.get('error') or f'{step.get("total_bytes", 0) / GiB:.1f} GiB per device'
      found.append(f'{step["preset"]} on {step["mesh"]}: does not fit or compile ({what})')
  return found


def compile_case(kind: str, case, target: str) -> dict:
  """One attention case or training step (`kind`: 'attention' or 'step'), compiled for
  `TARGETS[target]` in this process."""
  import jax

  jax.config.update('jax_enable_compilation_cache', False)  # every kernel built, so reported
  gpu = TARGETS[target]
  dump_dir = tempfile.mkdtemp(prefix='mosaic_dump_')
  try:
    if kind == 'attention':
      return compile_attention(case, mesh_for(gpu), dump_dir)
    preset, mesh_name, impl = case
    try:
      return compile_step(preset, mesh_name, impl, gpu, dump_dir)
    except Exception:
      error = traceback.format_exc(limit=2)[-400:]
      return {'preset': preset, 'mesh': mesh_name, 'ok': False, 'must_fit': True, 'error': error}
  finally:
    shutil.rmtree(dump_dir, ignore_errors=True)


def run(
  out_dir: str,
  target: str = 'h200',
  parts: tuple[str, ...] = ('attention', 'steps'),
  jobs: int = 1,
  log=print,
) -> dict:
  """Compiles every case for `TARGETS[target]` in `jobs` processes (one compile is about one
  core's work); writes out_dir/deviceless.{json,md} and summary.md. With jobs > 1, a script
  that calls this needs Python's `if __name__ == '__main__':` guard (the processes are spawned)."""
  import jax

  gpu = TARGETS[target]
  os.makedirs(out_dir, exist_ok=True)
  # The training steps first: they take 20-100 s each on one core, a kernel a few seconds, so
  # the kernels fill in behind them.
  tasks = [('step', c) for c in step_cases()] if 'steps' in parts else []
  tasks += [('attention', c) for c in attention_cases(gpu)] if 'attention' in parts else []
  results = [None] * len(tasks)

  def done(i: int, result: dict) -> None:
    results[i] = result
    log(_step_line(result) if tasks[i][0] == 'step' else _line(result))

  start = time.perf_counter()
  if jobs <= 1:
    for i, (kind, case) in enumerate(tasks):
      done(i, compile_case(kind, case, target))
  else:  # fresh interpreters: each starts JAX with this process's environment
    context = multiprocessing.get_context('spawn')
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
      futures = {pool.submit(compile_case, k, c, target): i for i, (k, c) in enumerate(tasks)}
      for future in concurrent.futures.as_completed(futures):
        done(futures[future], future.result())
  report = {
    'target': target,
    'device': gpu.kind,
    'capability': '.'.join(map(str, gpu.capability)),
    'memory_bytes': gpu.memory_bytes,
    'jax': jax.__version__,
    'jobs': jobs,
    'attention': [r for (kind, _), r in zip(tasks, results) if kind == 'attention'],
    'steps': [r for (kind, _), r in zip(tasks, results) if kind == 'step'],
  }
  report['seconds'] = round(time.perf_counter() - start, 1)
  report['problems'] = problems(report)
  with open(os.path.join(out_dir, 'deviceless.json'), 'w') as f:
    json.dump(report, f, indent=1)
  with open(os.path.join(out_dir, 'deviceless.md'), 'w') as f:
    f.write(markdown(report))
  with open(os.path.join(out_dir, 'summary.md'), 'w') as f:
    f.write(summary_markdown(report))
  return report


def _line(case: dict) -> str:
  if not case['ok']:
    return f'{case["name"]}: FAILED {case["error"][:160]}'
  ks = ', '.join(
    f'{k["name"]} {k["registers"]} regs spill {k["spill_stores"]}' for k in case['kernels']
  )
  return f'{case["name"]}: {case["compile_s"]} s, temp {case["temp_bytes"] / 2**20:.0f} MiB {ks}'


def _step_line(step: dict) -> str:
  if not step['ok']:
    return f'{step["preset"]} {step["mesh"]}: FAILED {step["error"][:200]}'
  return (
    f'{step["preset"]} {step["mesh"]} {step["attention"]}: {step["compile_s"]} s, '
    f'{step["total_bytes"] / GiB:.2f} GiB per device, fits {step["fits"]}'
  )


def markdown(report: dict) -> str:
  """The kernel and step tables of a report."""
  gib = lambda b: f'{b / GiB:.2f}'
  lines = [
    f'# Compiled for the {report["device"]} (sm{report["capability"].replace(".", "")}), no GPU',
    '',
    f'jax {report["jax"]}; {report["seconds"]} s. Registers per thread, spills and SMEM as ptxas '
    'built each kernel; a step fits when it needs at most '
    f'{FIT_FRACTION:.0%} of {gib(report["memory_bytes"])} GiB.',
    '',
  ]
  kernel_rows = [c for c in report['attention'] if c['implementation'].startswith('pallas')]
  if kernel_rows:
    lines += [
      '## Pallas kernels (T=2048, B=2, 8 query heads)',
      '',
      '| case | kernel | registers | spill stores / loads (bytes) | SMEM (bytes) | ptxas notes |',
      '|---|---|---|---|---|---|',
    ]
    for case in kernel_rows:
      if case['length'] != 2048:
        continue
      if not case['ok']:
        lines.append(f'| {case["name"]} | did not compile | | | | {case["error"][:120]} |')
        continue
      for k in case['kernels']:
        short = k['name'].removeprefix('sparrow_').removesuffix('_mosaic_gpu_kernel')
        notes = '; '.join(w.split(':')[0] + ': ' + w.split(':', 1)[-1][:60] for w in k['warnings'])
        lines.append(
          f'| {case["name"].rsplit(" T=", 1)[0]} | {short} | {k["registers"]} | '
          f'{k["spill_stores"]} / {k["spill_loads"]} | {k["smem_bytes"]} | {notes or "none"} |'
        )
    lines.append('')
  lines += [
    '## Every attention path: compiled memory (fwd+bwd, temp MiB)',
    '',
    '| case | compiles | temp (MiB) |',
    '|---|---|---|',
  ]
  for case in report['attention']:
    if case['implementation'].startswith('pallas') and case['length'] == 2048:
      continue
    temp = f'{case["temp_bytes"] / 2**20:.0f}' if case['ok'] else ''
    lines.append(f'| {case["name"]} | {"yes" if case["ok"] else case["error"][:100]} | {temp} |')
  lines += ['', '## Training steps: compiled memory per device', '', steps_table(report)]
  lines += ['', '## Problems', '']
  lines += [f'- {p}' for p in report['problems']] or ['none']
  return '\n'.join(lines) + '\n'


def summary_markdown(report: dict) -> str:
  """The short form for docs: per Pallas kernel the worst case over masks, dtypes and GQA; memory
  over T per attention path; the training steps."""
  worst: dict[tuple, dict] = {}
  for case in report['attention']:
    if not (case['ok'] and case['implementation'].startswith('pallas') and case['length'] == 2048):
      continue
    if case['dtype'] == 'float32':
      continue
    for k in case['kernels']:
      short = k['name'].removeprefix('sparrow_').removesuffix('_mosaic_gpu_kernel')
      row = worst.setdefault(
        (case['implementation'], case['head_dim'], short),
        {'registers': 0, 'spills': 0, 'smem': 0, 'notes': set(), 'cases': 0},
      )
      row['registers'] = max(row['registers'], k['registers'])
      row['spills'] = max(row['spills'], k['spill_stores'])
      row['smem'] = max(row['smem'], k['smem_bytes'])
      row['notes'] |= {w.split()[0] for w in k['warnings']}
      row['cases'] += 1
  lines = [
    '| path | head dim | kernel | cases | registers (max) | spill stores (max bytes) | '
    'SMEM (max KiB) | ptxas notes |',
    '|---|---|---|---|---|---|---|---|',
  ]
  for (impl, h, name), row in sorted(worst.items()):
    lines.append(
      f'| {impl} | {h} | {name} | {row["cases"]} | {row["registers"]} | {row["spills"]} | '
      f'{row["smem"] / 1024:.0f} | {", ".join(sorted(row["notes"])) or "none"} |'
    )
  sweep: dict[str, dict[int, str]] = {}
  for case in report['attention']:
    if case['head_dim'] == 128 and case['mask'] == 'causal' and case['batch'] == 1:
      temp = f'{case["temp_bytes"] / 2**20:,.0f}' if case['ok'] else 'fails'
      sweep.setdefault(case['implementation'], {})[case['length']] = temp
  lengths = sorted({t for row in sweep.values() for t in row})
  lines += [
    '',
    '| attention, fwd+bwd, B=1, 8 heads of 128, causal, bf16 | '
    + ' | '.join(f'T={t} temp (MiB)' for t in lengths)
    + ' |',
    '|---|' + '---|' * len(lengths),
  ]
  for impl, row in sweep.items():
    lines.append(f'| {impl} | ' + ' | '.join(row.get(t, '') for t in lengths) + ' |')
  lines += ['', steps_table(report)]
  return '\n'.join(lines) + '\n'


def steps_table(report: dict) -> str:
  """The training steps' memory per device, one row per preset, mesh and attention path."""
  gib = lambda b: f'{b / GiB:.2f}'
  lines = [
    '| preset | mesh (data, fsdp, tensor) | attention | batch x length | arguments (GiB) | '
    'temporaries (GiB) | total per device (GiB) | fits |',
    '|---|---|---|---|---|---|---|---|',
  ]
  for s in report['steps']:
    if not s['ok']:
      lines.append(
        f'| {s["preset"]} | {s["mesh"]} | | | | | did not compile: {s["error"][:80]} | no |'
      )
      continue
    lines.append(
      f'| {s["preset"]} | {s["mesh"]} {tuple(s["mesh_shape"])} | {s["attention"]} | '
      f'{s["batch"]} x {s["length"]} | {gib(s["argument_bytes"])} | {gib(s["temp_bytes"])} | '
      f'{gib(s["total_bytes"])} | {"yes" if s["fits"] else "no"} |'
    )
  return '\n'.join(lines)
