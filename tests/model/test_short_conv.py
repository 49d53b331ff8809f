"""The short causal convolution before self attention (model.short_conv), against float64 NumPy."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_reference import greedy_uncached_continue
from model_helpers import random_model

from transformer.config import ModelConfig
from transformer.kernels.masks import MaskSpec
from transformer.model import decode
from transformer.model.short_conv import ShortConv


def reference(x, w, segments):
  """y[b, t] = sum_i w[i] * x[b, t - i] over t - i >= 0 in the same segment, in float64."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  B, T, _ = x.shape
  y = np.zeros_like(x)
  for b in range(B):
    for t in range(T):
      for i in range(len(w)):
        if t - i >= 0 and (segments is None or segments[b, t - i] == segments[b, t]):
          y[b, t] += w[i] * x[b, t - i]
  return y


def _segments(rng, B, T):
  """Packed rows: runs of ids 1, 2, ... of random lengths, then padding (0)."""
  out = np.zeros((B, T), np.int32)
  for b in range(B):
    t, seg = 0, 1
    while t < T - 2:
      n = int(rng.integers(1, 6))
      out[b, t : t + n] = seg
      t, seg = t + n, seg + 1
  return out


@pytest.mark.parametrize('taps, packed', [(1, False), (3, False), (4, True), (7, True)])
def test_outputs_and_gradients_equal_float64_numpy(taps, packed):
  rng = np.random.default_rng(taps)
  B, T, D = 3, 13, 5
  x = rng.standard_normal((B, T, D)).astype(np.float32)
  w = rng.standard_normal((taps, D)).astype(np.float32)
  segments = _segments(rng, B, T) if packed else None
  mask = MaskSpec(causal=True, q_segment_ids=None if segments is None else jnp.asarray(segments))
  conv = ShortConv(taps)
  apply = lambda w, x: conv.apply({'params': {'kernel': w}}, x, mask, None)
  np.testing.assert_allclose(apply(w, x), reference(x, w, segments), rtol=1e-5, atol=1e-5)
  # The conv is linear in x and in w, so the cotangents are convolutions of g, in float64.
  g = rng.standard_normal((B, T, D))
  loss = lambda w, x: jnp.sum(apply(w, x) * g)
  dw, dx = jax.grad(loss, argnums=(0, 1))(w, x)
  want_dw = np.stack([
    np.sum(reference(x, np.eye(taps)[i][:, None] * np.ones((1, D)), segments) * g, axis=(0, 1))
    for i in range(taps)
  ])  # fmt: skip
  eps = 1e-3  # dx by central differences of the float64 reference, on a few entries
  for b, t, d in [(0, 0, 0), (1, 6, 2), (2, 12, 4), (0, 9, 3)]:
    plus, minus = x.astype(np.float64), x.astype(np.float64)
    plus[b, t, d] += eps
    minus[b, t, d] -= eps
    want = np.sum(reference(plus, w, segments) * g) - np.sum(reference(minus, w, segments) * g)
    np.testing.assert_allclose(dx[b, t, d], want / (2 * eps), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(dw, want_dw, rtol=1e-4, atol=1e-4)


def test_starts_as_the_identity():
  conv = ShortConv(4)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 6, 3)), jnp.float32)
  params = nn.meta.unbox(conv.init(jax.random.PRNGKey(0), x, None, None))
  np.testing.assert_array_equal(params['params']['kernel'], [[1, 1, 1], [0] * 3, [0] * 3, [0] * 3])
  np.testing.assert_array_equal(conv.apply(params, x, None, None), x)


def _model(seed, **overrides):
  base = dict(family='causal_lm', vocab_size=40, d_model=32, num_heads=4, d_ff=64, num_layers=2,
              max_length=32, dropout_rate=0.0, tie_output=False, norm_placement='pre',
              position='rope', short_conv=3)  # fmt: skip
  return random_model(ModelConfig(**{**base, **overrides}), seed)


def test_in_a_model_the_past_is_causal_and_packed_examples_stay_apart():
  model, params = _model(seed=1)
  rng = np.random.default_rng(2)
  a, b = rng.integers(3, 40, 7), rng.integers(3, 40, 6)
  apply = jax.jit(model.apply)  # eager flax is slow on CPU
  logits = lambda tokens, **kw: np.asarray(apply({'params': params}, jnp.asarray(tokens), **kw))
  alone_a, alone_b = logits(a[None]), logits(b[None])
  packed = np.concatenate([a, b])[None]
  segments = np.array([[1] * 7 + [2] * 6])
  positions = np.array([list(range(7)) + list(range(6))])
  got = logits(packed, segments=segments, positions=positions)
  np.testing.assert_allclose(got[0, :7], alone_a[0], rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(got[0, 7:], alone_b[0], rtol=2e-5, atol=2e-5)
  later = a.copy()
  later[5] = (later[5] - 2) % 37 + 3  # changing token 5 leaves 0..4 and changes 5
  changed = logits(later[None])
  np.testing.assert_allclose(changed[0, :5], alone_a[0, :5], rtol=1e-6, atol=1e-6)
  assert not np.allclose(changed[0, 5], alone_a[0, 5])
  without = _model(seed=1, short_conv=0)[0]  # the conv does something once trained (random w)
  rest = {k: v for k, v in params.items()}
  rest['decoder'] = jax.tree.map(lambda x: x, params['decoder'])
  for layer in ('layer_0', 'layer_1'):
    rest['decoder']['stack'][layer] = {
      k: v for k, v in params['decoder']['stack'][layer].items() if k != 'short_conv'
    }
  plain = np.asarray(jax.jit(without.apply)({'params': rest}, jnp.asarray(a[None])))
  assert np.abs(plain - alone_a).max() > 1e-2


def test_kv_cache_decoding_equals_the_uncached_model_token_for_token():
  model, params = _model(seed=3, num_kv_heads=2)
  rng = np.random.default_rng(0)
  tokens = np.zeros((4, 9), np.int32)
  for row, n in enumerate((9, 4, 1, 6)):  # right-padded prompts of different lengths
    tokens[row, :n] = rng.integers(3, 40, n)
  tokens[:, 0] = 1
  tokens = jnp.asarray(tokens)
  got = decode.generate(model, params, tokens, max_new_tokens=11)
  want = greedy_uncached_continue(model, params, tokens, 11)
  np.testing.assert_array_equal(got, want)
  assert len(set(map(tuple, np.asarray(got).tolist()))) > 1  # not a constant model


@pytest.mark.parametrize(
  'overrides, message',
  [
    (dict(short_conv=-1), 'short_conv=-1 must be an integer >= 0'),
    (dict(short_conv=True), 'short_conv=True must be an integer >= 0'),
    (dict(family='bidirectional_lm'), "not family='bidirectional_lm'; set short_conv=0"),
  ],
)
def test_bad_knobs(overrides, message):
  base = dict(family='causal_lm', vocab_size=40, d_model=32, num_heads=4, d_ff=64, short_conv=3)
  with pytest.raises(ValueError, match=message):
    ModelConfig(**{**base, **overrides})
