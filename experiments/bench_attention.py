"""Attention speed and memory: each `dot_product_attention` implementation over lengths and heads.

  python -m experiments.bench_attention [--lengths=256,1024] [--head_dims=64,128]
      [--dtype=float32|bfloat16] [--repeats=5] [--json=out.json]

Self attention (T = S), N = 8 heads, batch B = max(1, tokens // (N * T)) so that B * N * T stays
near a token budget (--tokens): 2^19 on GPU/TPU, 8192 on CPU (B = 1 from T = 1024 on). The
default CPU sweep (T = 256..4096, float32, xla, chunked and compressed) takes ~8 minutes on 2
cores, most of it at T = 4096 where B * N = 8 is the floor; --head_dims=64 halves that.
Times are medians of --repeats synchronised runs after one warm-up, of the forward and of forward
+ backward (jax.vjp, random cotangent). FLOPs follow FlashAttention: forward 4 * B * N * T * S * H,
forward + backward 3.5x that, causal counted as half; %mm is the fraction of a dense matmul's
FLOP/s in the bench dtype (n = --matmul_size, default 2048 on CPU, 8192 elsewhere). Memory is the
compiled temp size. 'pallas' is our kernel as `implementation='pallas'` chooses it (Mosaic GPU on
Hopper, Triton on older GPUs); 'pallas_triton' and 'pallas_mosaic' pin one GPU kernel each, so both
are reported side by side. Pallas is skipped on CPU (interpreter only), 'pallas_mosaic' below sm90,
'cudnn' except on NVIDIA GPUs; a size that fails (e.g. out of memory) keeps its row, with the error.
"""

import json

from absl import flags

from bench import timing
from experiments import cli

# 'compressed' is not a softmax kernel but hierarchical compression attention (its own block plus
# mean-pooled blocks, model.attention='compressed') at a block near sqrt(T): other numbers, another
# cost, T * (block + T / block); its FLOP columns count what dense attention would need.
IMPLEMENTATIONS = (
  'xla', 'chunked', 'pallas', 'pallas_triton', 'pallas_mosaic', 'cudnn', 'compressed',
)  # fmt: skip
NUM_HEADS = timing.NUM_HEADS

_LENGTHS = flags.DEFINE_list(
  'lengths', None, 'Sequence lengths T = S; default 256..4096 on CPU, 512..32768 elsewhere.'
)
_HEAD_DIMS = flags.DEFINE_list('head_dims', ['64', '128'], 'Head dims H.')
_DTYPE = flags.DEFINE_enum(
  'dtype',
  None,
  ['float32', 'bfloat16', 'float16'],
  'q/k/v dtype; default float32 on CPU, bfloat16 elsewhere.',
)
_IMPLS = flags.DEFINE_list('implementations', list(IMPLEMENTATIONS), 'Implementations to time.')
_TOKENS = flags.DEFINE_integer('tokens', None, 'Token budget B * N * T; default by backend.')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'Timed runs per measurement (after one warm-up).')
_JSON = flags.DEFINE_string('json', None, 'Also write the rows as a JSON list to this file.')
_MATMUL = flags.DEFINE_integer('matmul_size', None, 'Reference matmul size n; default by backend.')


def _ints(name: str, values: list[str]) -> list[int]:
  try:
    out = [int(v) for v in values]
  except ValueError:
    out = []
  if not out or min(out) < 1:
    raise ValueError(f'--{name}={",".join(values)} must be a comma-separated list of positive ints')
  return out


def _speedups(rows: list[dict], baseline: str) -> None:
  """Adds `{name}_vs_{baseline}` = baseline time / own time (> 1 is faster) where both ran."""
  done = {
    (r['T'], r['head_dim'], r['causal']): r
    for r in rows
    if r['implementation'] == baseline and r.get('fwd_ms')
  }
  for r in rows:
    base = done.get((r.get('T'), r.get('head_dim'), r.get('causal')))
    for name in ('fwd', 'fwdbwd'):
      if base and r.get(f'{name}_ms'):
        r[f'{name}_vs_{baseline}'] = base[f'{name}_ms'] / r[f'{name}_ms']


def _fmt(value, spec: str) -> str:
  return '-' if value is None else format(value, spec)


def format_table(rows: list[dict], with_cudnn: bool) -> str:
  """One text table; speedups are `fwd/fwd+bwd` time ratios (> 1 = faster than the baseline)."""
  ratio_cols = ['xla', 'cudnn'] if with_cudnn else ['xla']
  head = (
    f'{"impl":<13} {"T":>6} {"H":>4} {"causal":>6} {"B":>4}  {"fwd ms":>9} {"TFLOP/s":>8} '
    f'{"%mm":>5}  {"f+b ms":>9} {"TFLOP/s":>8} {"%mm":>5}  {"temp MiB f / f+b":>17}'
  )
  head += ''.join(f'  {"vs " + b + " f/f+b":>14}' for b in ratio_cols)
  lines = [head, '-' * len(head)]
  for r in rows:
    if 'T' not in r:  # an implementation skipped on this backend
      lines.append(f'{r["implementation"]:<13} {r["error"]}')
      continue
    line = f'{r["implementation"]:<13} {r["T"]:>6} {r["head_dim"]:>4} {str(r["causal"]):>6} '
    line += f'{r["batch"]:>4}  '
    if r.get('error'):
      lines.append(line + r['error'])
      continue
    for name in ('fwd', 'fwdbwd'):
      line += f'{r[f"{name}_ms"]:>9.2f} {r[f"{name}_tflops"]:>8.3f} '
      line += f'{100 * r[f"{name}_frac_matmul"]:>5.1f}  '
    temps = f'{_fmt(r["fwd_temp_mib"], ".1f")} / {_fmt(r["fwdbwd_temp_mib"], ".1f")}'
    line += f'{temps:>17}'
    for b in ratio_cols:
      pair = f'{_fmt(r.get(f"fwd_vs_{b}"), ".2f")}/{_fmt(r.get(f"fwdbwd_vs_{b}"), ".2f")}'
      line += f'  {pair:>14}'
    lines.append(line)
  return '\n'.join(lines)


def main():
  import jax
  import jax.numpy as jnp

  backend = jax.default_backend()
  on_cpu = backend == 'cpu'
  default_lengths = [256, 512, 1024, 2048, 4096] if on_cpu else [512 * 2**i for i in range(7)]
  lengths = default_lengths if _LENGTHS.value is None else _ints('lengths', _LENGTHS.value)
  head_dims = _ints('head_dims', _HEAD_DIMS.value)
  dtype_name = _DTYPE.value or ('float32' if on_cpu else 'bfloat16')
  dtype = jnp.dtype(dtype_name)
  tokens = (8192 if on_cpu else 2**19) if _TOKENS.value is None else _TOKENS.value
  if tokens < 1 or _REPEATS.value < 1:
    raise ValueError(f'--tokens={tokens} and --repeats={_REPEATS.value} must be positive ints')
  unknown = sorted(set(_IMPLS.value) - set(IMPLEMENTATIONS))
  if unknown:
    raise ValueError(f'--implementations has {unknown}; choose from {list(IMPLEMENTATIONS)}')

  rows, timed = [], []
  for name in [i for i in IMPLEMENTATIONS if i in _IMPLS.value]:
    reason = timing.skip_reason(name, backend)
    if reason:
      rows.append({'implementation': name, 'error': reason})
    else:
      timed.append(name)
  n = _MATMUL.value or (2048 if on_cpu else 8192)
  peak = timing.matmul_flops_per_sec(n, dtype)
  print(
    f'backend {backend} ({jax.devices()[0].device_kind}), {dtype_name}, N={NUM_HEADS}, '
    f'B*N*T ~ {tokens}, {_REPEATS.value} repeats; dense {n}^3 matmul: '
    f'{peak / 1e12:.3f} TFLOP/s (= 100 %mm)',
    flush=True,
  )
  for T in lengths:
    B = max(1, tokens // (NUM_HEADS * T))
    for H in head_dims:
      for causal in (False, True):
        for name in timed:
          row = {'implementation': name, 'T': T, 'head_dim': H, 'causal': causal, 'batch': B}
          if name == 'compressed':
            row['block'] = timing.compress_block(T)
          row |= {'heads': NUM_HEADS, 'dtype': dtype_name}
          try:
            row |= timing.measure(name, B, T, H, causal, dtype, _REPEATS.value)
          except Exception as error:  # e.g. out of memory: keep the row, say why
            lines = str(error).strip().splitlines() or [type(error).__name__]
            row['error'] = f'error: {lines[0][:100]}'
          else:
            flops = timing.attention_flops(B, NUM_HEADS, T, T, H, causal)
            for key, f in zip(('fwd', 'fwdbwd'), flops):
              row[f'{key}_tflops'] = f / (row[f'{key}_ms'] * 1e-3) / 1e12
              row[f'{key}_frac_matmul'] = row[f'{key}_tflops'] * 1e12 / peak
          rows.append(row)
          print(f'  done {name} T={T} H={H} causal={causal}', flush=True)
  _speedups(rows, 'xla')
  _speedups(rows, 'cudnn')
  print(format_table(rows, with_cudnn='cudnn' in timed))
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      json.dump(rows, f, indent=1)
    print(f'wrote {len(rows)} rows to {_JSON.value}')


if __name__ == '__main__':
  cli.run(main)
