"""Hierarchical compression attention against a float64 NumPy reference: outputs, gradients
(central differences of the reference), one-step decoding, segments and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_reference import greedy_uncached_continue
from model_helpers import random_model

from transformer.kernels.masks import MaskSpec
from transformer.model import compressed_attention as ca


def reference(q, k, v, block, causal, seg=None):
  """float64: each query's softmax over the keys of its own block and the means of the other
  blocks (the earlier ones when causal), written as one dense attention over T keys + C means."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, H = q.shape
  K, C = k.shape[2], T // block
  G = N // K
  seg = np.ones((B, T), int) if seg is None else np.asarray(seg)
  out = np.zeros((B, T, N, H))
  for b in range(B):
    means_k = k[b].reshape(C, block, K, H).mean(1)  # [C, K, H]
    means_v = v[b].reshape(C, block, K, H).mean(1)
    for i in range(T):
      if seg[b, i] == 0:
        continue
      c = i // block
      keys = [j for j in range(c * block, (c + 1) * block)
              if (not causal or j <= i) and seg[b, j] == seg[b, i]]  # fmt: skip
      blocks = [d for d in range(C) if (d < c if causal else d != c)
                and all(seg[b, d * block:(d + 1) * block] == seg[b, i])]  # fmt: skip
      for n in range(N):
        kv = n // G
        logits = [q[b, i, n] @ k[b, j, kv] for j in keys]
        logits += [q[b, i, n] @ means_k[d, kv] for d in blocks]
        values = [v[b, j, kv] for j in keys] + [means_v[d, kv] for d in blocks]
        z = np.asarray(logits) / np.sqrt(H)
        p = np.exp(z - z.max())
        out[b, i, n] = (p / p.sum()) @ np.asarray(values)
  return out


def _inputs(seed, B=2, T=12, N=6, K=3, H=5):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal((B, T, n, H)).astype(np.float32) for n in (N, K, K)]


@pytest.mark.parametrize('block', [1, 3, 4, 12])
@pytest.mark.parametrize('causal', [True, False])
def test_matches_the_float64_reference(block, causal):
  q, k, v = _inputs(block)
  out = ca.compressed_attention(q, k, v, block=block, mask=MaskSpec(causal=causal))
  np.testing.assert_allclose(out, reference(q, k, v, block, causal), rtol=2e-5, atol=2e-5)


def test_segments_keep_documents_apart_even_through_summaries():
  q, k, v = _inputs(7)
  seg = np.array([[1] * 5 + [2] * 5 + [0] * 2, [1] * 8 + [3] * 4])  # packing and padding
  mask = MaskSpec(causal=True, q_segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(seg))
  out = ca.compressed_attention(q, k, v, block=4, mask=mask)
  np.testing.assert_allclose(out, reference(q, k, v, 4, True, seg), rtol=2e-5, atol=2e-5)
  assert np.all(np.asarray(out)[0, 10:] == 0)  # padding queries see nothing
  # Block 1 (positions 4-7) mixes documents 1 and 2: no query reads its summary. Changing
  # document 2's keys leaves document 1's outputs as they were.
  k2 = k.copy()
  k2[0, 5:10] += 3.0
  again = ca.compressed_attention(q, k2, v, block=4, mask=mask)
  np.testing.assert_array_equal(np.asarray(again)[0, :5], np.asarray(out)[0, :5])


def test_gradients_match_central_differences_of_the_reference():
  q, k, v = _inputs(3, B=1, T=8, N=4, K=2, H=3)
  w = np.random.default_rng(9).standard_normal((1, 8, 4, 3))
  loss = lambda q, k, v: jnp.sum(
    ca.compressed_attention(q, k, v, block=4, mask=MaskSpec(causal=True)) * w
  )
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  rng = np.random.default_rng(4)
  eps = 1e-6
  for which, (x, g) in enumerate(zip((q, k, v), grads)):
    for _ in range(12):
      idx = tuple(rng.integers(0, s) for s in x.shape)
      plus, minus = (
        [np.asarray(a, np.float64) for a in (q, k, v)],
        [np.asarray(a, np.float64) for a in (q, k, v)],
      )
      plus[which][idx] += eps
      minus[which][idx] -= eps
      numeric = (np.sum(reference(*plus, 4, True) * w) - np.sum(reference(*minus, 4, True) * w)) / (
        2 * eps
      )
      np.testing.assert_allclose(np.asarray(g)[idx], numeric, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize('length', [12, 14])  # a cache of whole blocks, and one that is not
def test_one_step_decoding_equals_the_full_forward(length):
  q, k, v = _inputs(5)
  full = ca.compressed_attention(q, k, v, block=4, mask=MaskSpec(causal=True))
  rng = np.random.default_rng(6)
  for t in range(12):
    # Slots past t hold garbage, as an unwritten (or right-padded) cache does.
    cache_k = rng.standard_normal((2, length, 3, 5)).astype(np.float32) * 10
    cache_v = rng.standard_normal((2, length, 3, 5)).astype(np.float32) * 10
    cache_k[:, : t + 1], cache_v[:, : t + 1] = k[:, : t + 1], v[:, : t + 1]
    step = ca.attend_step(q[:, t : t + 1], cache_k, cache_v, jnp.full((2,), t), block=4)
    np.testing.assert_allclose(step[:, 0], full[:, t], rtol=2e-5, atol=2e-5)


def test_bad_input_is_one_clear_error():
  q, k, v = _inputs(0)
  with pytest.raises(ValueError, match='compress_block=5 does not divide the row length 12'):
    ca.compressed_attention(q, k, v, block=5, mask=MaskSpec(causal=True))
  with pytest.raises(ValueError, match='window=.* does not combine with compressed attention'):
    ca.compressed_attention(q, k, v, block=4, mask=MaskSpec(causal=True, window=(2, 0)))
  with pytest.raises(ValueError, match='is self attention'):
    ca.compressed_attention(q, k[:, :8], v[:, :8], block=4)
  with pytest.raises(ValueError, match='must be a positive integer'):
    ca.compressed_attention(q, k, v, block=0)


# In the model -----------------------------------------------------------------------------------
def _tiny(family, **overrides):
  from transformer.config import ModelConfig

  base = dict(family=family, vocab_size=40, d_model=32, num_heads=4, d_ff=64, num_layers=2,
              max_length=32, dropout_rate=0.0, tie_output=False, norm_placement='pre',
              attention='compressed', compress_block=4)  # fmt: skip
  return ModelConfig(**{**base, **overrides})


def test_kv_cache_decoding_equals_the_uncached_model_token_for_token():
  from transformer.model import decode

  model, params = random_model(_tiny('causal_lm', position='rope', num_kv_heads=2), seed=3)
  rng = np.random.default_rng(0)
  tokens = np.zeros((4, 9), np.int32)
  for row, n in enumerate((9, 4, 1, 6)):  # right-padded prompts that end inside a block
    tokens[row, :n] = rng.integers(3, 40, n)
  tokens[:, 0] = 1
  tokens = jnp.asarray(tokens)
  got = decode.generate(model, params, tokens, max_new_tokens=11)  # across 3 more blocks
  want = greedy_uncached_continue(model, params, tokens, 11)
  np.testing.assert_array_equal(got, want)
  assert len(set(map(tuple, np.asarray(got).tolist()))) > 1  # not a constant model


def test_bidirectional_lm_padding_changes_nothing():
  model, params = random_model(_tiny('bidirectional_lm', position='learned'), seed=1)
  rng = np.random.default_rng(0)
  tokens = rng.integers(5, 40, (2, 12)).astype(np.int32)
  segments = np.ones((2, 12), np.int32)
  segments[0, 7:] = 0  # padding, whatever its tokens
  apply = jax.jit(model.apply)  # eager flax is slow on CPU
  logits = lambda t: np.asarray(
    apply({'params': params}, jnp.asarray(t), segments=jnp.asarray(segments))
  )
  base = logits(tokens)
  other = tokens.copy()
  other[0, 7:] = rng.integers(5, 40, 5)
  np.testing.assert_allclose(logits(other)[0, :7], base[0, :7], rtol=1e-6, atol=1e-6)
  later = tokens.copy()
  later[1, 11] = (later[1, 11] - 4) % 35 + 5  # a token in the last block reaches the first
  assert not np.allclose(logits(later)[1, 0], base[1, 0])


@pytest.mark.parametrize(
  'overrides, message',
  [
    (dict(compress_block=5), 'compress_block=5 does not divide max_length=32'),
    (dict(compress_block=0), 'compress_block=0 must be a positive integer'),
    (dict(window=(8, 0)), r"window=\(8, 0\) does not combine with attention='compressed'"),
    (dict(position='alibi'), "position='alibi' biases each key by its distance"),
    (dict(attention_impl='chunked'), "attention_impl='chunked' picks a softmax kernel"),
    (dict(attention_dropout_rate=0.1), 'attention_dropout_rate=0.1 is not available'),
    (dict(family='encoder_decoder'), 'cross attention cannot use it'),
  ],
)
def test_config_errors(overrides, message):
  with pytest.raises(ValueError, match=message):
    _tiny(overrides.pop('family', 'causal_lm'), **overrides)


def test_a_row_length_the_block_does_not_divide_is_an_error_before_any_work():
  from configs import gpt_tiny
  from transformer.config.experiment import Config

  config = gpt_tiny.get_config()
  config.model.attention, config.model.compress_block = 'compressed', 8
  config.data.max_length = 60
  with pytest.raises(ValueError, match='compress_block=8 does not divide the row length'):
    Config.from_configdict(config)


@pytest.mark.parametrize('block', [16])
def test_a_model_with_blocks_longer_than_8_initialises_and_runs(block):
  """The initialising inputs are one whole block (a row of 8 tokens cannot be cut into 16s)."""
  from transformer.model import models

  cfg = _tiny('causal_lm', compress_block=block, max_length=2 * block)
  model = models.build(cfg)
  params = jax.jit(models.init_params, static_argnums=0)(model, jax.random.PRNGKey(0))
  logits = jax.jit(model.apply)({'params': params}, jnp.ones((2, 2 * block), jnp.int32))
  assert logits.shape == (2, 2 * block, cfg.vocab_size) and np.isfinite(logits).all()
