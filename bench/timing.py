"""Timing on any backend: synchronised medians, the dense-matmul FLOP/s that MFU is measured
against, the cost of one attention configuration, and a batch of random tokens to time a training
step on. The benchmarks and the sweeps share these."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np

from transformer.model.attention import MaskSpec, dot_product_attention
from transformer.training.state import model_inputs

NUM_HEADS = 8  # the attention benchmarks' heads
# The 'pallas' implementation with its GPU kernel pinned (benchmarks report both side by side).
PALLAS_KERNELS = {'pallas_triton': 'gpu', 'pallas_mosaic': 'mosaic_gpu'}


def compress_block(T: int) -> int:
  """The block of the 'compressed' rows: the power of two nearest sqrt(T), where the cost
  T * (block + T / block) is lowest; it divides T when T is a power of two."""
  return 2 ** round(math.log2(math.sqrt(T)))


def attention_fn(implementation: str, causal: bool) -> Callable:
  """`(q, k, v) -> out` for a `dot_product_attention` implementation, a `PALLAS_KERNELS` name,
  or 'compressed' (hierarchical compression attention at `compress_block(T)`)."""
  mask = MaskSpec(causal=causal)
  if implementation == 'compressed':
    from transformer.model.compressed_attention import compressed_attention

    return lambda q, k, v: compressed_attention(
      q, k, v, block=compress_block(q.shape[1]), mask=mask
    )
  if implementation in PALLAS_KERNELS:
    from transformer.kernels import flash_attention

    backend = PALLAS_KERNELS[implementation]
    return lambda q, k, v: flash_attention(q, k, v, causal=causal, backend=backend)
  return lambda q, k, v: dot_product_attention(q, k, v, mask=mask, implementation=implementation)


def median_seconds(fn: Callable, args: tuple, repeats: int) -> float:
  """Median wall time of `fn(*args)` until its outputs are ready, after one warm-up call."""
  import jax
  import numpy as np

  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def matmul_flops_per_sec(n: int, dtype=None, repeats: int = 10) -> float:
  """Median FLOP/s of a jitted dense [n, n] @ [n, n] matmul (float32 unless `dtype`)."""
  import jax
  import jax.numpy as jnp

  a, b = (jax.random.normal(jax.random.PRNGKey(i), (n, n), dtype or jnp.float32) for i in (0, 1))
  return 2 * n**3 / median_seconds(jax.jit(jnp.matmul), (a, b), repeats)


def skip_reason(implementation: str, backend: str) -> str | None:
  """Why `implementation` is not timed on `backend` ('cpu', 'gpu', 'tpu'), or None to time it."""
  import jax

  if implementation.startswith('pallas') and backend not in ('gpu', 'tpu'):
    return f'skipped: on {backend} Pallas runs only in its interpreter (too slow to time)'
  if implementation in PALLAS_KERNELS and backend != 'gpu':
    return f'skipped: {implementation} is a GPU kernel (backend is {backend})'
  if implementation == 'pallas_mosaic':
    capability = getattr(jax.devices()[0], 'compute_capability', None)
    if capability is None or float(capability) < 9.0:
      return f'skipped: pallas_mosaic needs a Hopper (sm90+) GPU (compute capability {capability})'
  if implementation == 'cudnn':
    version = getattr(jax.devices()[0].client, 'platform_version', '').lower()
    if backend != 'gpu' or 'cuda' not in version:
      return f'skipped: cudnn needs an NVIDIA GPU (backend is {backend})'
  return None


def attention_flops(B: int, N: int, T: int, S: int, H: int, causal: bool) -> tuple[float, float]:
  """(forward, forward + backward) FLOPs, FlashAttention convention: 4BNTSH, x3.5, causal / 2."""
  forward = 4.0 * B * N * T * S * H * (0.5 if causal else 1.0)
  return forward, 3.5 * forward


def measure(
  implementation: str, B: int, T: int, H: int, causal: bool, dtype, repeats: int, heads=NUM_HEADS
) -> dict:
  """Times and compiled temp memory of one configuration: forward, and forward + backward."""
  import jax

  attend = attention_fn(implementation, causal)

  def forward_backward(q, k, v, cot):
    out, pullback = jax.vjp(attend, q, k, v)
    return out, pullback(cot)  # (dq, dk, dv), each [B, T, N, H]

  keys = jax.random.split(jax.random.PRNGKey(T * 1000 + H), 4)
  q, k, v, cot = (jax.random.normal(key, (B, T, heads, H), dtype) for key in keys)
  row = {}
  for name, fn, args in (('fwd', attend, (q, k, v)), ('fwdbwd', forward_backward, (q, k, v, cot))):
    compiled = jax.jit(fn).lower(*args).compile()
    memory = compiled.memory_analysis()
    row[f'{name}_temp_mib'] = None if memory is None else memory.temp_size_in_bytes / 2**20
    row[f'{name}_ms'] = 1e3 * median_seconds(compiled, args, repeats)
  return row


def synthetic_batch(cfg, batch_size: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
  """A full training batch of random tokens for `cfg`'s family: [batch_size, length] arrays."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(5, cfg.vocab_size, size=(batch_size, length + 1)).astype(np.int32)
  ones = np.ones((batch_size, length), np.int32)
  positions = np.broadcast_to(np.arange(length, dtype=np.int32), (batch_size, length))
  batch = {
    'inputs': tokens[:, :-1],
    'targets': tokens[:, 1:],
    'decoder_inputs': tokens[:, :-1],
    'segments': ones,
    'inputs_segments': ones,
    'targets_segments': ones,
    'positions': positions,
    'inputs_positions': positions,
    'targets_positions': positions,
    'token_types': np.zeros_like(ones),
    'weights': np.ones((batch_size, length), np.float32),
  }
  needed = model_inputs(cfg.family, batch).keys() | {'targets', 'weights'}
  return {k: v for k, v in batch.items() if k in needed}
