"""The one GPU check: versions, every attention implementation against float64, attention and
training-step speed (TFLOP/s, tokens/s, MFU) against its speed targets, as JSON and markdown.

`smoke=True` shrinks every part to tiny float32 shapes so the same code path runs on CPU.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import time

import numpy as np

from bench import timing

IMPLEMENTATIONS = ('xla', 'chunked', 'cudnn', 'pallas_triton', 'pallas_mosaic')
PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16 tensor-core FLOP/s
MASKS = {
  'none': {},
  'causal': dict(causal=True),
  'segments': dict(segments=True),
  'window': dict(window=(48, 16)),
  'causal+segments+window': dict(causal=True, segments=True, window=(40, 0)),
}
SMOKE_MASKS = ('none', 'causal+segments+window')  # the code path, at the least compile time
TOLERANCE = {'float32': 1e-4, 'bfloat16': 2e-2}  # relative L2 error vs float64


def versions() -> dict:
  """jax, jaxlib, CUDA, cuDNN and the device, as far as this install can tell."""
  import jax
  import jaxlib

  device = jax.devices()[0]
  out = {
    'python': platform.python_version(),
    'jax': jax.__version__,
    'jaxlib': jaxlib.__version__,
    'backend': jax.default_backend(),
    'device': device.device_kind,
    'device_count': jax.device_count(),
    'compute_capability': getattr(device, 'compute_capability', None),
    'platform_version': getattr(device.client, 'platform_version', None),
  }
  try:
    from jax._src.lib import cuda_versions

    if cuda_versions is not None:
      out['cuda_runtime'] = cuda_versions.cuda_runtime_get_version()
      out['cudnn'] = cuda_versions.cudnn_get_version()
  except Exception as error:  # no CUDA plugin: say so instead of failing
    out['cuda'] = f'unavailable ({type(error).__name__})'
  return out


def _attend(implementation: str, mask: dict, q_seg, kv_seg):
  """`(q, k, v) -> out` for one implementation and mask kind."""
  import jax.numpy as jnp

  from transformer.kernels import flash_attention
  from transformer.model.attention import MaskSpec, dot_product_attention

  causal, window = mask.get('causal', False), mask.get('window')
  segs = mask.get('segments', False)
  if implementation in timing.PALLAS_KERNELS:
    backend = timing.PALLAS_KERNELS[implementation]
    ids = dict(q_segment_ids=jnp.asarray(q_seg), kv_segment_ids=jnp.asarray(kv_seg)) if segs else {}
    return lambda q, k, v: flash_attention(
      q, k, v, causal=causal, window=window, backend=backend, **ids
    )
  spec = MaskSpec(
    causal=causal,
    window=window,
    q_segment_ids=jnp.asarray(q_seg) if segs else None,
    kv_segment_ids=jnp.asarray(kv_seg) if segs else None,
  )
  return lambda q, k, v: dot_product_attention(q, k, v, mask=spec, implementation=implementation)


def correctness(smoke: bool) -> list[dict]:
  """Forward and gradient relative errors of each implementation vs float64, every mask kind."""
  import jax
  import jax.numpy as jnp

  from transformer.kernels.reference import attention_float64

  backend = jax.default_backend()
  dtype_name = 'float32' if smoke else 'bfloat16'
  B, T, N, K = (1, 40, 2, 1) if smoke else (2, 200, 4, 2)  # awkward lengths, GQA
  head_dims = (64,) if smoke else (64, 128)
  rng = np.random.default_rng(0)
  q_seg = np.repeat([[1, 2, 0]], [T // 2, T - T // 2 - 5, 5], axis=1).astype(np.int32)
  q_seg = np.repeat(q_seg, B, axis=0)  # two packed documents, then padding
  rows = []
  for impl in IMPLEMENTATIONS:
    reason = timing.skip_reason(impl, backend)
    if reason:
      rows.append({'implementation': impl, 'error': reason})
      continue
    for H in head_dims:
      shapes = ((B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H))
      q, k, v, g = (jnp.asarray(rng.standard_normal(s), dtype_name) for s in shapes)
      for name, mask in MASKS.items():
        if smoke and name not in SMOKE_MASKS:
          continue
        row = {'implementation': impl, 'head_dim': H, 'mask': name, 'dtype': dtype_name}
        try:
          out, pullback = jax.vjp(_attend(impl, mask, q_seg, q_seg), q, k, v)
          grads = pullback(g)
          segs = dict(q_seg=q_seg, kv_seg=q_seg) if mask.get('segments') else {}
          ref_out, ref_grads = attention_float64(
            q, k, v, g, causal=mask.get('causal', False), window=mask.get('window'), **segs
          )
          for key, x, ref in zip(('out', 'dq', 'dk', 'dv'), (out, *grads), (ref_out, *ref_grads)):
            x = np.asarray(x.astype(jnp.float32), np.float64)
            row[f'{key}_rel_err'] = float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))
          row['ok'] = all(
            row[f'{k}_rel_err'] <= TOLERANCE[dtype_name] for k in ('out', 'dq', 'dk', 'dv')
          )
        except Exception as error:  # keep the row, say why
          row['error'] = f'error: {(str(error).strip().splitlines() or [type(error).__name__])[0]}'
          row['ok'] = False
        rows.append(row)
  return rows


def attention_speed(smoke: bool, repeats: int, deadline: float) -> tuple[float, list[dict]]:
  """(same-run bf16 matmul FLOP/s, rows): T in 1k/4k/16k with B*T = 16k, H 64/128, causal or not.

  Heads N = 2048 / H (a d_model-2048 layer). Rows past `deadline` (time.time()) are skipped.
  """
  import jax
  import jax.numpy as jnp

  backend = jax.default_backend()
  dtype = jnp.float32 if smoke else jnp.bfloat16
  lengths, tokens, width = ((64,), 256, 64) if smoke else ((4096, 16384, 1024), 16384, 2048)
  impls = ('xla', 'chunked') if smoke else ('pallas_mosaic', 'cudnn', 'pallas_triton')
  matmul = timing.matmul_flops_per_sec(256 if smoke else 8192, dtype)
  rows = []
  timed = []
  for impl in impls:
    reason = timing.skip_reason(impl, backend)
    if reason:
      rows.append({'implementation': impl, 'error': reason})
    else:
      timed.append(impl)
  # Shapes outermost, the targets' shapes first, so a cut by the budget drops whole shapes.
  for T, H, causal in itertools.product(lengths, (64,) if smoke else (128, 64), (False, True)):
    for impl in timed:
      B, N = tokens // T, width // H
      row = dict(implementation=impl, T=T, batch=B, heads=N, head_dim=H, causal=causal)
      if time.time() > deadline:
        rows.append(row | {'error': 'skipped: past the time budget'})
        continue
      try:
        row |= timing.measure(impl, B, T, H, causal, dtype, repeats, heads=N)
      except Exception as error:  # e.g. out of memory: keep the row, say why
        row['error'] = f'error: {(str(error).strip().splitlines() or ["?"])[0][:120]}'
      else:
        for key, flops in zip(('fwd', 'fwdbwd'), timing.attention_flops(B, N, T, T, H, causal)):
          row[f'{key}_tflops'] = flops / (row[f'{key}_ms'] * 1e-3) / 1e12
          row[f'{key}_vs_matmul'] = row[f'{key}_tflops'] * 1e12 / matmul
      rows.append(row)
  done = {
    (r['T'], r['head_dim'], r['causal']): r
    for r in rows
    if r['implementation'] == 'cudnn' and 'fwd_ms' in r
  }
  for r in rows:
    base = done.get((r.get('T'), r.get('head_dim'), r.get('causal')))
    if base and 'fwd_ms' in r:
      for key in ('fwd', 'fwdbwd'):
        r[f'{key}_vs_cudnn'] = base[f'{key}_ms'] / r[f'{key}_ms']  # > 1: faster than cuDNN
  return matmul, rows


def _train_config(name: str, smoke: bool):
  """gpt2_small or gpt_1b in bf16 with the Pallas kernel (tiny float32 'xla' when smoke)."""
  import importlib

  config = importlib.import_module(f'configs.{name}').get_config()
  m = config.model
  m.dropout_rate = m.attention_dropout_rate = 0.0  # attention dropout needs the 'xla' path
  m.dtype, m.attention_impl = 'bfloat16', 'pallas'
  if name == 'gpt2_small':
    m.vocab_size = 50304  # a multiple of 64
    config.data.batch_size = 16
  if smoke:
    m.d_model, m.num_heads, m.d_ff, m.num_layers, m.vocab_size = 64, 2, 128, 1, 256
    m.dtype, m.attention_impl, m.max_length = 'float32', 'xla', 64
    config.data.max_length, config.data.batch_size = 64, 2
  return config


def train_speed(name: str, smoke: bool, steps: int, matmul: float) -> dict:
  """Median train-step time of a preset: tokens/s and MFU against 989 TFLOP/s and the matmul."""
  import jax

  from transformer.model import models
  from transformer.training.run import Run

  config = _train_config(name, smoke)
  run = Run(config, None, with_data=False)
  cfg, B, T = run.model_cfg, config.data.batch_size, config.data.max_length
  batch = run.place(timing.synthetic_batch(cfg, B, T))
  state, key = run.init_state(), run.replicate(jax.random.PRNGKey(1))
  for _ in range(2):  # compile and warm up
    state, metrics = run.train_step(state, batch, key)
  jax.block_until_ready(metrics)
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    state, metrics = run.train_step(state, batch, key)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  step = float(np.median(times))
  flops = models.flops_per_token(cfg, T)['train'] * B * T / step
  return {
    'config': name,
    'parameters': models.count_params(cfg),
    'batch': B,
    'length': T,
    'dtype': cfg.dtype,
    'attention': config.model.attention_impl,
    'step_ms': 1e3 * step,
    'tokens_per_s': B * T / step,
    'model_tflops': flops / 1e12,
    'mfu_vs_989': flops / PEAK_BF16,
    'mfu_vs_matmul': flops / matmul,
    'loss': float(metrics['loss']),
  }


def targets(attention: list[dict], training: list[dict]) -> list[dict]:
  """The speed targets, each with the measured value and whether it holds."""
  out = []
  mosaic = [
    r
    for r in attention
    if r['implementation'] == 'pallas_mosaic' and 'fwd_ms' in r and r['head_dim'] == 128
  ]
  for r in mosaic:
    if r['T'] >= 4096:
      label = f'T={r["T"]} causal={r["causal"]}'
      out.append(dict(target=f'fwd >= 0.75x matmul ({label})', value=r['fwd_vs_matmul'], need=0.75))
      if 'fwd_vs_cudnn' in r:
        out.append(dict(target=f'fwd >= 1.0x cuDNN ({label})', value=r['fwd_vs_cudnn'], need=1.0))
    out.append(
      dict(
        target=f'fwd+bwd >= 0.6x matmul (T={r["T"]} causal={r["causal"]})',
        value=r['fwdbwd_vs_matmul'],
        need=0.6,
      )
    )
  for r in training:
    if 'mfu_vs_989' in r:
      out.append(dict(target=f'{r["config"]} MFU >= 45% of 989', value=r['mfu_vs_989'], need=0.45))
  for t in out:
    t['met'] = bool(t['value'] >= t['need'])
  return out


def _table(rows: list[dict], columns: list[str]) -> str:
  def cell(value):
    if isinstance(value, float):
      return f'{value:.4g}'
    return '-' if value is None else str(value)

  lines = ['| ' + ' | '.join(columns) + ' |', '|' + '---|' * len(columns)]
  lines += ['| ' + ' | '.join(cell(r.get(c)) for c in columns) + ' |' for r in rows]
  return '\n'.join(lines)


def markdown(report: dict) -> str:
  """The report as markdown: one section per part, errors kept in their rows."""
  v = report['versions']
  parts = [
    f'# GPU check ({report["command"]})',
    f'{v["device"]} x {v["device_count"]}, jax {v["jax"]}, jaxlib {v["jaxlib"]}, '
    f'CUDA {v.get("cuda_runtime", "-")}, cuDNN {v.get("cudnn", "-")}, '
    f'wall time {report["wall_s"]:.0f} s. Same-run dense matmul: '
    f'{report["matmul_tflops"]:.1f} TFLOP/s.',
    '## Correctness vs float64 (relative L2 error)',
    _table(
      report['correctness'],
      [
        'implementation',
        'head_dim',
        'mask',
        'dtype',
        'out_rel_err',
        'dq_rel_err',
        'dk_rel_err',
        'dv_rel_err',
        'ok',
        'error',
      ],
    ),
    '## Attention speed (medians after warm-up; FLOPs 4BNT^2H, x3.5 fwd+bwd, causal / 2)',
    _table(
      report['attention'],
      [
        'implementation',
        'T',
        'batch',
        'heads',
        'head_dim',
        'causal',
        'fwd_ms',
        'fwd_tflops',
        'fwd_vs_matmul',
        'fwd_vs_cudnn',
        'fwdbwd_ms',
        'fwdbwd_tflops',
        'fwdbwd_vs_matmul',
        'fwdbwd_vs_cudnn',
        'error',
      ],
    ),
    '## Training step',
    _table(
      report['training'],
      [
        'config',
        'parameters',
        'batch',
        'length',
        'dtype',
        'attention',
        'step_ms',
        'tokens_per_s',
        'model_tflops',
        'mfu_vs_989',
        'mfu_vs_matmul',
        'error',
      ],
    ),
    '## Targets',
    _table(report['targets'], ['target', 'value', 'need', 'met']),
    '',
    '## Mosaic GPU kernels as built here (compare `gpu_check --deviceless`)',
    _table(
      report.get('kernels', []),
      ['name', 'registers', 'spill_stores', 'spill_loads', 'smem_bytes', 'setmaxnreg_in_sass'],
    ),
  ]
  return '\n\n'.join(parts) + '\n'


def built_kernels(dump_dir: str) -> list[dict]:
  """Each Mosaic GPU kernel the run built: ptxas's registers and spills, and whether its SASS
  holds SETMAXNREG (register reallocation that reached the binary)."""
  import glob

  from bench import ptxas

  rows = []
  for k in ptxas.mosaic_kernels(dump_dir):
    base = k.name.removesuffix('_mosaic_gpu_kernel')
    sass = ''
    for path in glob.glob(os.path.join(dump_dir, f'{base}_*.sass')):
      with open(path, errors='replace') as f:
        sass += f.read()
    rows.append(
      k.as_dict() | {'setmaxnreg_in_sass': 'SETMAXNREG' in sass.upper() if sass else None}
    )
  return rows


def run(out_dir: str, *, smoke: bool = False, budget_s: float = 330.0, repeats: int = 10) -> dict:
  """Runs every part and writes `gpu_check.json` and `gpu_check.md` into `out_dir`."""
  start = time.time()
  os.makedirs(out_dir, exist_ok=True)
  report = {'command': 'python -m experiments.gpu_check' + (' --smoke' if smoke else '')}
  # Mosaic GPU writes ptxas's log and the SASS of every kernel it builds here, so the device run
  # records what `gpu_check --deviceless` reports from the same toolchain, and whether setmaxnreg
  # reached the binary.
  dump_dir = os.path.join(out_dir, 'mosaic_dump')
  os.environ.update(
    MOSAIC_GPU_DUMP_TO=dump_dir, MOSAIC_GPU_DUMP_PTXAS='1', MOSAIC_GPU_DUMP_SASS='1'
  )
  report['versions'] = versions()
  report['correctness'] = correctness(smoke)
  # Attention may use what the training steps leave; they take ~2 minutes on one H200.
  deadline = start + budget_s * (1.0 if smoke else 0.55)
  matmul, report['attention'] = attention_speed(smoke, 2 if smoke else repeats, deadline)
  report['matmul_tflops'] = matmul / 1e12
  report['training'] = []
  for name in ('gpt2_small', 'gpt_1b'):
    try:
      report['training'].append(train_speed(name, smoke, 1 if smoke else 5, matmul))
    except Exception as error:  # e.g. out of memory: keep the row, say why
      msg = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
      report['training'].append({'config': name, 'error': f'error: {msg}'})
  report['targets'] = targets(report['attention'], report['training'])
  report['kernels'] = built_kernels(dump_dir)
  report['wall_s'] = time.time() - start
  with open(os.path.join(out_dir, 'gpu_check.json'), 'w') as f:
    json.dump(report, f, indent=1, default=str)
  with open(os.path.join(out_dir, 'gpu_check.md'), 'w') as f:
    f.write(markdown(report))
  return report
