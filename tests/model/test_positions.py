"""Tests for transformer/positions.py against float64 NumPy references written here."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.config import ModelConfig
from transformer.model import positions as P
from transformer.model.layers import AddLearned

SCALINGS = [('none', 1.0), ('linear', 4.0), ('ntk', 8.0), ('yarn', 16.0)]


@pytest.mark.parametrize('d_model', [2, 6, 64])
def test_sinusoidal_matches_paper_formula(d_model):
  pos = np.array([[0, 1, 7, 50, 311], [3, 2, 1, 0, 499]])
  got = np.asarray(P.sinusoidal(jnp.asarray(pos), d_model))
  assert got.shape == (2, 5, d_model) and got.dtype == np.float32
  want = np.zeros((2, 5, d_model))
  for b in range(2):
    for t in range(5):
      for c in range(d_model):
        i = c // 2  # channel 2i is a sine, 2i+1 a cosine of the same angle
        angle = pos[b, t] / 10000.0 ** (2 * i / d_model)
        want[b, t, c] = math.sin(angle) if c % 2 == 0 else math.cos(angle)
  np.testing.assert_allclose(got, want, atol=1e-4)


def test_sinusoidal_odd_d_model_raises():
  with pytest.raises(ValueError, match='d_model=5'):
    P.sinusoidal(jnp.arange(3), 5)


def test_learned_positions_shape_param_and_limit():
  cfg = ModelConfig(vocab_size=11, d_model=6, num_heads=2, d_ff=8, num_layers=1, max_length=8)
  module = AddLearned(cfg)
  x, pos = jnp.zeros((2, 3, 6)), jnp.array([[0, 3, 7], [1, 1, 2]])
  params = nn.meta.unbox(module.init(jax.random.PRNGKey(0), x, pos))
  table = params['params']['positions']['embedding']
  assert table.shape == (8, 6)
  out = module.apply(params, x + 1.0, pos)
  np.testing.assert_array_equal(np.asarray(out), 1.0 + np.asarray(table)[np.asarray(pos)])
  with pytest.raises(ValueError, match='sequence length 9 exceeds max_length=8'):
    module.apply(params, jnp.zeros((2, 9, 6)), jnp.zeros((2, 9), jnp.int32))


def _rope_reference(x, pos, inv_freq, mscale):
  """float64 rotation of pairs (i, i + H/2) by pos * inv_freq[i]."""
  half = x.shape[-1] // 2
  angle = pos[:, :, None, None] * inv_freq[None, None, None, :]  # [B, T, 1, H/2]
  x1, x2 = x[..., :half], x[..., half:]
  c, s = np.cos(angle) * mscale, np.sin(angle) * mscale
  return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


@pytest.mark.parametrize('scaling,factor', SCALINGS)
def test_apply_rope_matches_reference(scaling, factor):
  inv_freq, mscale = P.rope_frequencies(8, scaling=scaling, factor=factor, original_max_length=64)
  x = np.random.default_rng(0).normal(size=(2, 5, 3, 8))
  pos = np.array([[0, 1, 2, 3, 4], [9, 40, 7, 100, 3]])
  got = P.apply_rope(jnp.asarray(x, jnp.float32), jnp.asarray(pos), inv_freq, mscale)
  want = _rope_reference(x, pos, np.asarray(inv_freq, np.float64), mscale)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-4)


@pytest.mark.parametrize('scaling,factor', SCALINGS)
def test_rope_scores_depend_only_on_offset(scaling, factor):
  head_dim = 16
  inv_freq, mscale = P.rope_frequencies(
    head_dim, scaling=scaling, factor=factor, original_max_length=128
  )
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.normal(size=(1, 1, 1, head_dim)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 1, 1, head_dim)), jnp.float32)

  def score(i, j):
    qi = P.apply_rope(q, jnp.array([i]), inv_freq, mscale)
    kj = P.apply_rope(k, jnp.array([j]), inv_freq, mscale)
    return float(jnp.sum(qi * kj))

  for i, j in [(5, 2), (0, 9), (13, 13)]:
    base = score(i, j)
    for shift in [1, 17, 230]:
      assert score(i + shift, j + shift) == pytest.approx(base, rel=1e-3, abs=1e-3)
  assert score(5, 2) != pytest.approx(score(5, 4), abs=1e-3)  # the offset does matter


def test_rope_position_zero_is_identity_and_keeps_dtype():
  inv_freq, _ = P.rope_frequencies(8)
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 2, 8), jnp.bfloat16)
  out = P.apply_rope(x, jnp.zeros((3,), jnp.int32), inv_freq)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(x, np.float32))


def test_rope_plain_frequencies_and_linear_scaling():
  inv_freq, mscale = P.rope_frequencies(10, theta=500.0)
  np.testing.assert_allclose(np.asarray(inv_freq), 500.0 ** -(np.arange(0, 10, 2) / 10), rtol=1e-6)
  assert mscale == 1.0
  linear, _ = P.rope_frequencies(10, theta=500.0, scaling='linear', factor=4.0)
  x = jax.random.normal(jax.random.PRNGKey(1), (1, 4, 2, 10))
  pos = jnp.array([1, 5, 30, 250])
  np.testing.assert_allclose(
    np.asarray(P.apply_rope(x, pos * 4, linear)),
    np.asarray(P.apply_rope(x, pos, inv_freq)),
    atol=1e-4,
  )


def test_ntk_keeps_high_frequency_and_interpolates_lowest():
  head_dim, factor = 64, 8.0
  plain, _ = P.rope_frequencies(head_dim)
  ntk, mscale = P.rope_frequencies(head_dim, scaling='ntk', factor=factor)
  plain, ntk = np.asarray(plain, np.float64), np.asarray(ntk, np.float64)
  assert ntk[0] == plain[0] == 1.0  # highest frequency unchanged
  ratio = ntk / plain
  assert np.all(np.diff(ratio) < 0)  # lower frequencies are stretched more
  assert ratio[1] > 0.9  # high frequencies barely move
  np.testing.assert_allclose(ratio[-1], 1 / factor, rtol=1e-5)  # the lowest one is interpolated
  assert mscale == 1.0


def test_yarn_by_parts():
  head_dim, factor, length = 64, 4.0, 256
  plain, _ = P.rope_frequencies(head_dim)
  yarn, mscale = P.rope_frequencies(
    head_dim, scaling='yarn', factor=factor, original_max_length=length
  )
  plain, yarn = np.asarray(plain, np.float64), np.asarray(yarn, np.float64)
  turns = length * plain / (2 * np.pi)
  fast, slow = turns > 32, turns < 1
  assert fast.any() and slow.any() and (~fast & ~slow).any()
  np.testing.assert_allclose(yarn[fast], plain[fast], rtol=1e-6)
  np.testing.assert_allclose(yarn[slow], plain[slow] / factor, rtol=1e-6)
  mid = ~fast & ~slow
  gamma = (turns[mid] - 1) / 31
  np.testing.assert_allclose(yarn[mid], plain[mid] * ((1 - gamma) / factor + gamma), rtol=1e-6)
  assert mscale == pytest.approx(0.1 * math.log(factor) + 1)


def test_rope_bad_inputs_raise():
  with pytest.raises(ValueError, match="'dynamic'.*'linear'"):
    P.rope_frequencies(8, scaling='dynamic')
  with pytest.raises(ValueError, match='factor=0.5'):
    P.rope_frequencies(8, scaling='linear', factor=0.5)
  with pytest.raises(ValueError, match='head_dim=7'):
    P.rope_frequencies(7)
  inv_freq, _ = P.rope_frequencies(8)
  with pytest.raises(ValueError, match='head_dim=6'):
    P.apply_rope(jnp.zeros((1, 2, 1, 6)), jnp.arange(2), inv_freq)


def _paper_slopes(n):
  """ALiBi rule written from its definition: powers of two are a geometric sequence from
  2^(-8/n) with that ratio; otherwise the largest power of two below n, then the odd-numbered
  slopes (1st, 3rd, ...) of twice that power."""

  def geo(m):
    return [2 ** (-8 * (k + 1) / m) for k in range(m)]

  if math.log2(n).is_integer():
    return geo(n)
  p = 2 ** math.floor(math.log2(n))
  extra = [s for idx, s in enumerate(geo(2 * p)) if idx % 2 == 0]
  return geo(p) + extra[: n - p]


@pytest.mark.parametrize('n', [1, 2, 6, 8, 12, 16])
def test_alibi_slopes(n):
  got = np.asarray(P.alibi_slopes(n))
  assert got.shape == (n,) and got.dtype == np.float32
  np.testing.assert_allclose(got, _paper_slopes(n), rtol=1e-6)


def test_alibi_slopes_known_values():
  np.testing.assert_allclose(np.asarray(P.alibi_slopes(8)), [2.0**-k for k in range(1, 9)])
  six = [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
  np.testing.assert_allclose(np.asarray(P.alibi_slopes(6)), six)
  with pytest.raises(ValueError, match='num_heads=0'):
    P.alibi_slopes(0)


def test_alibi_bias_definition():
  slopes = P.alibi_slopes(3)
  got = np.asarray(P.alibi_bias(slopes, jnp.arange(4), jnp.arange(6)))
  assert got.shape == (3, 4, 6)
  s = np.asarray(slopes, np.float64)
  for n in range(3):
    for i in range(4):
      for j in range(6):
        assert got[n, i, j] == pytest.approx(-s[n] * abs(i - j), rel=1e-6)


def test_llama3_scaling_matches_the_published_formula():
  """Llama 3.1's rope scaling, written out per frequency in float64 (Meta's reference loop)."""
  head_dim, theta, factor, low, high, original = 64, 500000.0, 8.0, 1.0, 4.0, 8192
  base = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  want = []
  for freq in base:
    wavelength = 2 * math.pi / freq
    if wavelength < original / high:
      want.append(freq)
    elif wavelength > original / low:
      want.append(freq / factor)
    else:
      smooth = (original / wavelength - low) / (high - low)
      want.append((1 - smooth) * freq / factor + smooth * freq)
  got, mscale = P.rope_frequencies(
    head_dim, theta=theta, scaling='llama3', factor=factor, original_max_length=original,
    low_freq_factor=low, high_freq_factor=high,
  )  # fmt: skip
  assert mscale == 1.0
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-6)
  regions = np.asarray(got) / base.astype(np.float32)
  assert (
    (regions > 0.99).any()
    and (regions < 0.13).any()
    and ((regions > 0.13) & (regions < 0.99)).any()
  )
  with pytest.raises(ValueError, match='0 < low_freq_factor < high_freq_factor'):
    P.rope_frequencies(8, scaling='llama3', factor=2.0, low_freq_factor=4.0, high_freq_factor=1.0)
