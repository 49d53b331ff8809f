"""Claim: the memory of the 'xla' attention grows quadratically with the sequence length and that
of 'chunked' and 'pallas' linearly. Forward + backward of one attention call, no training."""

from research.rules import COMPILED_MEMORY

# --scale of the one-GPU run (an estimate, not measured: one H200, lengths 1024-8192 (x4), the
# pallas variant runs on the GPU; 3 variants, no training: ~3 min).
GPU_SCALE = 4

_LENGTHS = (256, 512, 1024, 2048)


def measure(ctx, lengths=_LENGTHS, head_dim: int = 64, repeats: int = 3) -> dict:
  """XLA's compiled temp memory and the median time of forward + backward at each length, via
  experiments.bench_attention (batch 1, its 8 heads, causal, float32 on CPU, bfloat16 elsewhere)."""
  import jax
  import jax.numpy as jnp

  from bench import timing

  implementation = ctx.config.model.attention_impl
  backend = jax.default_backend()
  reason = timing.skip_reason(implementation, backend)
  if reason:
    return {'skipped': reason}
  dtype = jnp.float32 if backend == 'cpu' else jnp.bfloat16
  out = {}
  for T in lengths:
    row = timing.measure(implementation, 1, T, head_dim, True, dtype, repeats)
    out[f'mib_T{T}'] = row['fwdbwd_temp_mib']
    out[f'ms_T{T}'] = row['fwdbwd_ms']
  return out


def get_sweep(scale: int = 1) -> dict:
  lengths = [n * scale for n in _LENGTHS]
  mib = [f'mib_T{n}' for n in lengths]
  rules = [
    dict(kind='fit_power_law', variant='xla', xs=lengths, metrics=mib, slope_between=(1.6, 2.4),
         exact=COMPILED_MEMORY, text='xla memory is quadratic'),
    dict(kind='fit_power_law', variant='chunked', xs=lengths, metrics=mib,
         slope_between=(0.6, 1.4),
         exact=COMPILED_MEMORY, text='chunked memory is linear'),
    dict(kind='fit_power_law', variant='pallas', xs=lengths, metrics=mib, slope_between=(0.6, 1.4),
         exact=COMPILED_MEMORY, text='pallas memory is linear'),
  ]  # fmt: skip
  plots = [
    dict(kind='series', metrics=mib, x=lengths, logx=True, logy=True,
         title='temp memory of forward + backward', xlabel='sequence length', ylabel='MiB'),
    dict(kind='series', metrics=[f'ms_T{n}' for n in lengths], x=lengths, logx=True, logy=True,
         title='time of forward + backward', xlabel='sequence length', ylabel='ms'),
  ]  # fmt: skip
  return dict(
    name='attention_memory',
    claim="Attention memory is quadratic in the sequence length for 'xla' and linear for "
    "'chunked' and 'pallas'.",
    description='One causal self-attention call, batch 1, 8 heads of 64, forward + backward; '
    "memory is XLA's compiled temporary buffer size (memory_analysis), time the median of 3 "
    "runs. The fitted exponent of memory against length should be ~2 for 'xla' and ~1 for the "
    "others. 'pallas' runs on GPU/TPU only.",
    base='configs/gpt_tiny.py',
    train=False,
    overrides={'model.vocab_size': 512},  # the model is not used; keeps its table sensible
    variants={name: {'model.attention_impl': name} for name in ('xla', 'chunked', 'pallas')},
    measure='measure',
    measure_args={'lengths': tuple(lengths)},
    metrics=[mib[0], mib[-1], f'ms_T{lengths[-1]}'],
    nulls=[
      dict(
        name='the compiled step',
        reason='nothing is trained: the compiled memory and time of one attention call do '
        'not depend on what any parameters learned, so there is no null that learns '
        'nothing (an untrained model has the same numbers, and every rule would hold '
        'on it though each could fail: an implementation could grow otherwise)',
        values={},
      ),
    ],  # fmt: skip
    rules=rules,
    plots=plots,
  )
