"""ALiBi (Press et al. 2022) against independent float64 NumPy references: the slopes, every
attention path that takes them, and a CausalLM past its training length, full pass vs KV cache."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.config import ModelConfig
from transformer.data import BOS_ID
from transformer.model import decode, models
from transformer.model import positions as P
from transformer.model.attention import MaskSpec, dot_product_attention


def paper_slopes(n: int) -> list[float]:
  """`get_slopes` of the paper's reference code (ofirpress/attention_with_linear_biases)."""

  def power_of_2(n):
    start = 2 ** (-(2 ** -(math.log2(n) - 3)))
    return [start * start**i for i in range(n)]

  if math.log2(n).is_integer():
    return power_of_2(n)
  closest = 2 ** math.floor(math.log2(n))
  return power_of_2(closest) + paper_slopes(2 * closest)[0::2][: n - closest]


def reference_attention(q, k, v, slopes, causal: bool) -> np.ndarray:
  """Hand-written ALiBi attention in float64: q [B, T, N, H], k/v [B, S, K, H] -> [B, T, N, H].

  Head n reads kv head n // (N / K) and adds -slopes[n] * (i - j) for key j <= query i (the
  paper's causal bias); without causal, -slopes[n] * |i - j| (this codebase's choice).
  """
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  out = np.zeros((B, T, N, H))
  i, j = np.arange(T)[:, None], np.arange(S)[None, :]
  for n in range(N):
    kv = n // (N // K)
    logits = np.einsum('bth,bsh->bts', q[:, :, n], k[:, :, kv]) / math.sqrt(H)  # [B, T, S]
    distance = (i - j) if causal else np.abs(i - j)
    logits = logits - slopes[n] * distance
    if causal:
      logits = np.where(j <= i, logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    out[:, :, n] = np.einsum('bts,bsh->bth', p / p.sum(-1, keepdims=True), v[:, :, kv])
  return out


@pytest.mark.parametrize('n', [1, 2, 3, 5, 6, 7, 8, 12, 16, 24])
def test_slopes_match_the_papers_code(n):
  np.testing.assert_allclose(np.asarray(P.alibi_slopes(n)), paper_slopes(n), rtol=1e-6)


def qkv(B, T, S, N, K, H, seed=0):
  rng = np.random.default_rng(seed)
  # Large enough logits that a wrong bias sign or distance moves the output well past tolerance.
  q = rng.standard_normal((B, T, N, H)) * 2
  k, v = rng.standard_normal((B, S, K, H)) * 2, rng.standard_normal((B, S, K, H))
  return (jnp.asarray(x, jnp.float32) for x in (q, k, v))


# (T, S, N, K, causal): odd lengths, head counts that are not powers of two, grouped kv heads.
SHAPES = [(13, 13, 6, 2, True), (29, 29, 5, 1, True), (7, 11, 3, 3, False), (40, 40, 12, 4, True)]


@pytest.mark.parametrize('T,S,N,K,causal', SHAPES)
@pytest.mark.parametrize(
  'implementation,chunk_size', [('xla', 128), ('chunked', 3), ('chunked', 8)]
)
def test_attention_paths_match_reference(T, S, N, K, causal, implementation, chunk_size):
  q, k, v = qkv(2, T, S, N, K, 8)
  slopes = P.alibi_slopes(N)
  got = dot_product_attention(
    q,
    k,
    v,
    mask=MaskSpec(causal=causal),
    alibi_slopes=slopes,
    implementation=implementation,
    chunk_size=chunk_size,
  )
  want = reference_attention(q, k, v, np.asarray(paper_slopes(N)), causal)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_bias_is_not_a_no_op():
  """The reference tells ALiBi apart from no bias and from the opposite sign at these shapes."""
  q, k, v = qkv(2, 13, 13, 6, 2, 8)
  slopes = np.asarray(paper_slopes(6))
  want = reference_attention(q, k, v, slopes, causal=True)
  for wrong in (0 * slopes, -slopes):
    assert np.abs(reference_attention(q, k, v, wrong, causal=True) - want).max() > 0.1


def test_pallas_and_cudnn_refuse_alibi_here():
  """Pallas has no ALiBi; cuDNN needs a GPU. Neither may silently drop the bias."""
  q, k, v = qkv(1, 8, 8, 2, 2, 8)
  for implementation, message in (('pallas', 'not supported'), ('cudnn', 'needs an NVIDIA GPU')):
    if implementation == 'cudnn' and jax.default_backend() == 'gpu':
      continue
    with pytest.raises(ValueError, match=message):
      dot_product_attention(
        q, k, v, mask=MaskSpec(causal=True), alibi_slopes=P.alibi_slopes(2),
        implementation=implementation,
      )  # fmt: skip


# A CausalLM past its training length ------------------------------------------------------------
TRAINED, LONG = 8, 23  # max_length of the config, and the length it is run at


def tiny_alibi_lm(**overrides) -> ModelConfig:
  base = dict(
    family='causal_lm', vocab_size=37, d_model=24, num_heads=6, num_kv_heads=2, d_ff=48,
    num_layers=2, max_length=TRAINED, dropout_rate=0.0, position='alibi', norm_placement='pre',
    tie_output=False,
  )  # fmt: skip
  base.update(overrides)
  return ModelConfig(**base)


def random_params(model, seed=0):
  """Normal(0, 0.3) weights (large enough for sharp, position-dependent attention)."""
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), **model.dummy_inputs())['params']
  rng = np.random.default_rng(seed)
  fill = lambda x: jnp.asarray(0.3 * rng.standard_normal(x.shape), x.dtype)
  return jax.tree.map(fill, jax.tree.map(lambda x: x, shapes))


def tokens(B=2, T=LONG, seed=0):
  out = np.random.default_rng(seed).integers(3, 37, (B, T))
  out[:, 0] = BOS_ID
  return jnp.asarray(out, jnp.int32)


@functools.partial(jax.jit, static_argnums=0)
def cached_logits(model, params, x):
  """Prefills x[:, :TRAINED], then feeds x [B, LONG] one cached step per token at positions
  TRAINED..LONG-1. Returns the logits at TRAINED-1..LONG-1: float32 [B, LONG - TRAINED + 1, V]."""
  first, cache, step, _ = decode.prefill(model, params, x[:, :TRAINED], LONG - TRAINED + 1)

  def body(cache, t):
    logits, cache = step(x[:, t], jnp.full((x.shape[0],), t, jnp.int32), cache)
    return cache, logits  # [B, V]

  _, rest = jax.lax.scan(body, cache, jnp.arange(TRAINED, LONG))  # [LONG - TRAINED, B, V]
  return jnp.concatenate([first[:, None], jnp.moveaxis(rest, 0, 1)], axis=1)


def test_causal_lm_past_max_length_full_pass_equals_kv_cache():
  """Logits at every position past TRAINED of a LONG-token row (max_length TRAINED): the full pass
  of the dense and the chunked path (5 key blocks, prefill too), and the KV cache's steps."""
  cfg = tiny_alibi_lm(attention_impl='chunked', attention_chunk_size=5)
  model, dense = models.build(cfg), models.build(cfg.replace(attention_impl='xla'))
  params = random_params(model)
  x = tokens()
  full = np.asarray(jax.jit(dense.apply)({'params': params}, x))  # [B, LONG, V]
  np.testing.assert_allclose(jax.jit(model.apply)({'params': params}, x), full, atol=1e-4)
  got = cached_logits(model, params, x)
  np.testing.assert_allclose(got, full[:, TRAINED - 1 :], rtol=1e-4, atol=1e-4)


def test_packed_document_sees_only_relative_positions():
  """A document packed at offset s of a row gets the logits it gets alone: the full pass biases by
  i - j of the row, which within one segment equals the document's own i - j."""
  model = models.build(tiny_alibi_lm())
  params = random_params(model, seed=1)
  x, s = tokens(B=1), 6
  segments = jnp.asarray([[1] * s + [2] * (LONG - s)], jnp.int32)
  apply = jax.jit(model.apply)
  packed = np.asarray(apply({'params': params}, x, segments=segments))[:, s:]
  alone = np.asarray(apply({'params': params}, x[:, s:]))
  np.testing.assert_allclose(packed, alone, rtol=1e-4, atol=1e-4)
