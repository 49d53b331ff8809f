"""Position information: the sinusoidal table, RoPE (with context scaling) and ALiBi (the learned
table is `layers.AddLearned`).

Frequency tables are computed in float64 NumPy (their sizes are static), then cast to float32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from transformer.config import ROPE_SCALINGS

Array = jax.Array


def sinusoidal(positions: Array, d_model: int) -> Array:
  """The paper's table: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(same angle).

  Args:
    positions: `[..., T]` integer positions.
    d_model: even model width D.

  Returns:
    `[..., T, D]` float32, sines on even channels and cosines on odd channels (interleaved).
  """
  if d_model <= 0 or d_model % 2:
    raise ValueError(f'sinusoidal positions need an even d_model > 0, got d_model={d_model}')
  exponents = np.arange(0, d_model, 2, dtype=np.float64) / d_model  # 2i/d for i < D/2
  inv_freq = jnp.asarray(10000.0**-exponents, jnp.float32)  # [D/2]
  angles = jnp.asarray(positions, jnp.float32)[..., None] * inv_freq  # [..., T, D/2]
  # Stacking on a new last axis and flattening interleaves: channel 2i = sin, 2i + 1 = cos.
  pe = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)  # [..., T, D/2, 2]
  return pe.reshape(*pe.shape[:-2], d_model)  # [..., T, D]


def rope_frequencies(
  head_dim: int,
  *,
  theta: float = 10000.0,
  scaling: str = 'none',
  factor: float = 1.0,
  original_max_length: int = 2048,
  low_freq_factor: float = 1.0,
  high_freq_factor: float = 4.0,
) -> tuple[Array, float]:
  """Inverse frequencies theta^(-2i/H) of RoPE, optionally scaled to reach a longer context.

  Scalings (`factor` = how many times longer than the trained context):
    'none':   the plain frequencies.
    'linear': position interpolation, every frequency divided by `factor`.
    'ntk':    NTK-aware, the base becomes theta * factor^(H / (H - 2)); the highest frequency is
              untouched and the lowest one ends up divided by `factor`.
    'yarn':   YaRN "NTK-by-parts": with r = original_max_length / wavelength (how many turns a
              frequency makes over the trained context), frequencies with r < 1 are interpolated,
              those with r > 32 are kept, and a linear ramp in r blends the two in between.
              Attention logits are also scaled by mscale^2 with mscale = 0.1 ln(factor) + 1.
    'llama3': Llama 3.1's scaling (Hugging Face's rope_type='llama3'): with L =
              original_max_length, wavelengths above L / low_freq_factor are divided by `factor`,
              those below L / high_freq_factor are kept, and in between
              s = (L / wavelength - low) / (high - low) blends them: (1 - s) f / factor + s f.

  Args:
    head_dim: even head dimension H.
    theta: RoPE base.
    scaling: one of ROPE_SCALINGS.
    factor: context extension factor, >= 1.
    original_max_length: the trained context length (used by 'yarn' and 'llama3').
    low_freq_factor, high_freq_factor: the two wavelength bounds of 'llama3' (low < high).

  Returns:
    (inv_freq `[H/2]` float32, mscale): mscale is 1.0 except for 'yarn'.
  """
  if head_dim <= 0 or head_dim % 2:
    raise ValueError(f'RoPE needs an even head_dim > 0, got head_dim={head_dim}')
  if scaling not in ROPE_SCALINGS:
    raise ValueError(f'unknown RoPE scaling={scaling!r}; choose one of {ROPE_SCALINGS}')
  if factor < 1.0:
    raise ValueError(f'RoPE scaling factor={factor} must be >= 1.0')
  if original_max_length <= 0:
    raise ValueError(f'original_max_length={original_max_length} must be > 0')

  # float64 on the host: theta^-x for H/2 static exponents; float32 would round the slowest ones.
  exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim  # 2i/H
  if scaling == 'ntk' and head_dim > 2:  # with H = 2 the only frequency is 1 whatever the base
    # The lowest frequency theta^-(H-2)/H is then divided by exactly `factor`.
    theta = theta * factor ** (head_dim / (head_dim - 2))
  inv_freq = theta**-exponents  # [H/2]
  mscale = 1.0
  if scaling == 'linear':  # position p looks like p / factor, inside the trained range
    inv_freq = inv_freq / factor
  elif scaling == 'yarn':
    beta_fast, beta_slow = 32.0, 1.0  # the YaRN paper's turn-count bounds for LLaMA
    turns = original_max_length * inv_freq / (2 * math.pi)  # r = L / wavelength
    keep = np.clip((turns - beta_slow) / (beta_fast - beta_slow), 0.0, 1.0)  # 1 = keep original
    inv_freq = (1.0 - keep) * inv_freq / factor + keep * inv_freq  # [H/2]
    # Interpolation flattens the softmax at long range; scaling q and k by mscale sharpens it.
    mscale = 0.1 * math.log(factor) + 1.0
  elif scaling == 'llama3':
    if not 0 < low_freq_factor < high_freq_factor:
      raise ValueError(
        f'llama3 RoPE scaling needs 0 < low_freq_factor < high_freq_factor; got '
        f'{low_freq_factor} and {high_freq_factor}'
      )
    wavelength = 2 * math.pi / inv_freq  # [H/2] tokens per full turn
    smooth = (original_max_length / wavelength - low_freq_factor) / (
      high_freq_factor - low_freq_factor
    )
    smooth = np.clip(smooth, 0.0, 1.0)  # 0 past L / low (divide by factor), 1 under L / high (keep)
    inv_freq = (1.0 - smooth) * inv_freq / factor + smooth * inv_freq  # [H/2]
  return jnp.asarray(inv_freq, jnp.float32), mscale


def _rotate_half(x: Array) -> Array:
  """(x1, x2) -> (-x2, x1) on the two halves of the last axis."""
  x1, x2 = jnp.split(x, 2, axis=-1)  # [..., H/2] each
  return jnp.concatenate([-x2, x1], axis=-1)  # [..., H]


def apply_rope(x: Array, positions: Array, inv_freq: Array, mscale: float = 1.0) -> Array:
  """Rotate channel pairs (i, i + H/2) of queries or keys by angle position * inv_freq[i].

  Uses the "rotate half" layout of GPT-NeoX / LLaMA: the first half of H holds the first
  coordinate of each pair and the second half the second. Angles are computed in float32.

  Args:
    x: `[B, T, N, H]` queries or keys.
    positions: `[B, T]` or `[T]` integer positions.
    inv_freq: `[H/2]` from `rope_frequencies`.
    mscale: multiplies cos and sin (YaRN attention scaling).

  Returns:
    `[B, T, N, H]` in x.dtype.
  """
  head_dim = x.shape[-1]
  if inv_freq.shape != (head_dim // 2,) or head_dim % 2:
    raise ValueError(
      f'inv_freq has shape {inv_freq.shape} but x has head_dim={head_dim}; '
      f'expected shape ({head_dim // 2},) from rope_frequencies({head_dim})'
    )
  positions = jnp.asarray(positions)
  if positions.ndim == 1:
    positions = positions[None, :]  # [1, T]
  angles = positions.astype(jnp.float32)[..., None] * inv_freq.astype(jnp.float32)  # [B, T, H/2]
  # Channels i and i + H/2 form a pair and share one angle; the new axis broadcasts over heads.
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, H]
  cos, sin = jnp.cos(angles) * mscale, jnp.sin(angles) * mscale  # [B, T, 1, H], broadcast over N
  # float32: angles reach position * inv_freq ~ 1e4 radians, where bfloat16 has no digits left.
  x32 = x.astype(jnp.float32)
  # Pair (a, b) = (x[i], x[i + H/2]) becomes (a cos - b sin, b cos + a sin): a 2D rotation.
  return (x32 * cos + _rotate_half(x32) * sin).astype(x.dtype)  # [B, T, N, H]


def alibi_slopes(num_heads: int) -> Array:
  """ALiBi head slopes (Press et al., 2022).

  For N a power of two: the geometric sequence 2^(-8/N), 2^(-16/N), ..., 2^(-8).
  Otherwise: the slopes for the largest power of two P < N, then every other slope of 2P
  (its 1st, 3rd, ...) until there are N.

  Returns:
    `[N]` float32.
  """
  if num_heads <= 0:
    raise ValueError(f'num_heads={num_heads} must be > 0 for ALiBi')

  def geometric(n: int) -> list[float]:
    # Slopes 2^(-8k/n), k = 1..n: each head looks back over a different distance.
    start = 2.0 ** (-8.0 / n)
    return [start ** (k + 1) for k in range(n)]

  if num_heads & (num_heads - 1) == 0:  # a power of two
    slopes = geometric(num_heads)
  else:
    closest = 2 ** int(math.floor(math.log2(num_heads)))  # P
    slopes = geometric(closest) + geometric(2 * closest)[0::2][: num_heads - closest]
  return jnp.asarray(slopes, jnp.float32)


def alibi_bias(slopes: Array, q_pos: Array, k_pos: Array) -> Array:
  """The ALiBi bias -slope[n] * |i - j| for the query at position i and the key at position j.

  The distance is symmetric, so it also serves bidirectional attention; a causal mask hides j > i.

  Args:
    slopes: `[N]` from `alibi_slopes`.
    q_pos: `[T]` query positions.
    k_pos: `[S]` key positions.

  Returns:
    `[N, T, S]` float32; head n = k * G + g of grouped attention reshapes it to `[K, G, T, S]`.
  """
  distance = jnp.abs(q_pos[:, None] - k_pos[None, :]).astype(jnp.float32)  # [T, S]
  return -slopes.astype(jnp.float32)[:, None, None] * distance  # [N, T, S]
