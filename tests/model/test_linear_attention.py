"""Tests for transformer.model.linear_attention: its chunked, quadratic and recurrent forms and
their gradients against a float64 NumPy reference, decoding with the fixed-size state, and the
config errors."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_reference import greedy_uncached_continue, greedy_uncached_translate
from model_helpers import random_model

from transformer import config as config_lib
from transformer.config import ModelConfig
from transformer.model import decode
from transformer.model import linear_attention as linear
from transformer.model.attention import CacheMode, MaskSpec, MultiHeadAttention
from transformer.model.parts import parts

# phi and phi' in float64, written out independently of the JAX feature maps.
NP_FEATURES = {
  'elu': (lambda x: np.where(x > 0, x + 1.0, np.exp(x)), lambda x: np.where(x > 0, 1.0, np.exp(x))),
  'relu': (lambda x: np.maximum(x, 0.0), lambda x: (x > 0).astype(np.float64)),
  'softplus': (lambda x: np.log1p(np.exp(x)), lambda x: 1.0 / (1.0 + np.exp(-x))),
}


@dataclasses.dataclass(frozen=True)
class Case:
  B: int = 2
  T: int = 11
  S: int | None = None  # None: self attention
  N: int = 4
  K: int | None = None
  H: int = 5
  causal: bool = True
  q_seg: tuple | None = None
  kv_seg: tuple | None = None  # None with q_seg: the same ids
  feature_map: str = 'elu'


CASES = {
  'causal': Case(),
  'causal_gqa_odd': Case(T=13, N=6, K=2, H=3),
  'causal_packed': Case(q_seg=((1, 1, 1, 2, 2, 2, 2, 3, 3, 0, 0), (4,) * 9 + (0, 0))),
  'causal_mqa_relu': Case(T=9, N=3, K=1, feature_map='relu'),
  'bidirectional': Case(causal=False, H=7),
  'bidirectional_packed': Case(causal=False, q_seg=((1, 1, 2, 2, 2, 2, 2, 2, 3, 0, 0), (1,) * 11)),
  'cross': Case(causal=False, T=5, S=12, feature_map='softplus'),
  'cross_segments': Case(
    causal=False,
    T=5,
    S=12,
    K=2,
    q_seg=((1, 2, 2, 1, 0), (1,) * 5),  # any order: cross attention sums per id
    kv_seg=((2,) * 5 + (1,) * 4 + (0,) * 3, (1,) * 10 + (0, 0)),
  ),
}


def inputs(c: Case, seed=0):
  rng = np.random.default_rng(seed)
  S, K = c.S or c.T, c.K or c.N
  q = rng.normal(size=(c.B, c.T, c.N, c.H))
  k = rng.normal(size=(c.B, S, K, c.H))
  v = rng.normal(size=(c.B, S, K, c.H))
  dout = rng.normal(size=(c.B, c.T, c.N, c.H))
  q_seg = None if c.q_seg is None else np.array(c.q_seg, np.int32)
  kv_seg = None if c.q_seg is None else np.array(c.kv_seg or c.q_seg, np.int32)
  return q, k, v, dout, q_seg, kv_seg


def np_visible(c, q_seg, kv_seg):
  """bool [B, T, S] from the definition: causal j <= i, equal non-zero segment ids."""
  S = c.S or c.T
  vis = np.ones((c.B, c.T, S), bool)
  if c.causal:
    vis &= np.arange(S)[None, None, :] <= np.arange(c.T)[None, :, None]
  if q_seg is not None:
    vis &= (q_seg[:, :, None] == kv_seg[:, None, :]) & (q_seg[:, :, None] != 0)
  return vis


def np_linear_attention(c, q, k, v, dout, vis):
  """float64 quadratic form and its hand-written backward: (out, dq, dk, dv)."""
  phi, dphi = NP_FEATURES[c.feature_map]
  G = c.N // (c.K or c.N)
  kr, vr = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)  # [B, S, N, H]: kv head n // G
  fq, fk = phi(q), phi(kr)
  a = np.einsum('btnh,bsnh->bnts', fq, fk) * vis[:, None]  # [B, N, T, S]
  num = np.einsum('bnts,bsnh->btnh', a, vr)
  den = a.sum(-1).transpose(0, 2, 1)[..., None]  # [B, T, N, 1]
  seen = den > 0
  safe = np.where(seen, den, 1.0)
  out = np.where(seen, num / safe, 0.0)
  dnum = np.where(seen, dout / safe, 0.0)  # d out / d num = 1 / den
  dden = -np.sum(dnum * out, -1)  # d out / d den = -num / den^2: [B, T, N]
  da = (np.einsum('btnh,bsnh->bnts', dnum, vr) + dden.transpose(0, 2, 1)[..., None]) * vis[:, None]
  dq = np.einsum('bnts,bsnh->btnh', da, fk) * dphi(q)
  dkr = np.einsum('bnts,btnh->bsnh', da, fq) * dphi(kr)
  dvr = np.einsum('bnts,btnh->bsnh', a, dnum)
  fold = lambda x: x.reshape(*x.shape[:2], -1, G, x.shape[-1]).sum(3)  # G query heads -> kv head
  return out, dq, fold(dkr), fold(dvr)


def recurrent(q, k, v, *, mask=None, feature_map='elu'):
  """The causal recurrence, one position at a time with the library's `state` and `readout`, as
  decoding runs them.

  Like the chunked scan, a segment change resets the state and padding adds nothing.
  """
  mask = MaskSpec(causal=True) if mask is None else mask
  if not mask.causal:
    raise ValueError('the recurrent form is causal; pass a MaskSpec with causal=True')
  linear._check(q, k, v, mask)
  B, T = q.shape[:2]
  seg = mask.q_segment_ids
  seg = jnp.ones((B, T), jnp.int32) if seg is None else seg.astype(jnp.int32)

  def step(carry, x):
    kv, z, prev = carry
    q_t, k_t, v_t, s_t = x  # [B, 1, N, H], [B, 1, K, H] x 2, [B]
    same = (s_t == prev)[:, None, None, None]  # a new segment starts from an empty state
    kv_t, z_t = linear.state(k_t, v_t, s_t[:, None], feature_map)
    kv, z = jnp.where(same, kv, 0.0) + kv_t, jnp.where(same, z, 0.0) + z_t
    out = linear.readout(q_t, kv, z, feature_map) * (s_t != 0)[:, None, None, None]  # [B, 1, N, H]
    return (kv, z, s_t), out[:, 0]

  K, H = k.shape[2], k.shape[3]
  init = (
    jnp.zeros((B, K, H, H), jnp.float32),
    jnp.zeros((B, K, 1, H), jnp.float32),
    jnp.zeros((B,), jnp.int32),
  )
  split = lambda x: jnp.moveaxis(x, 1, 0)[:, :, None]  # [B, T, ...] -> [T, B, 1, ...]
  xs = (split(q), split(k), split(v), jnp.moveaxis(seg, 1, 0))
  _, out = jax.lax.scan(step, init, xs)  # [T, B, N, H]
  return jnp.moveaxis(out, 0, 1).astype(q.dtype)  # [B, T, N, H]


def forms(c: Case):
  """The JAX forms that apply to the case: name -> fn(q, k, v, mask)."""
  f = c.feature_map
  out = {'quadratic': functools.partial(linear.quadratic, feature_map=f)}
  for C in (1, 4, 128):  # ragged blocks, several blocks, one block
    out[f'chunked_C{C}'] = functools.partial(
      linear.linear_attention, feature_map=f, chunk_size=C, self_attention=c.S is None
    )
  if c.causal:
    out['recurrent'] = functools.partial(recurrent, feature_map=f)
  return out


@pytest.mark.parametrize('name', CASES)
def test_forms_and_gradients_match_float64_reference(name):
  c = CASES[name]
  q, k, v, dout, q_seg, kv_seg = inputs(c)
  want = np_linear_attention(c, q, k, v, dout, np_visible(c, q_seg, kv_seg))
  mask = MaskSpec(
    causal=c.causal,
    q_segment_ids=None if q_seg is None else jnp.asarray(q_seg),
    kv_segment_ids=None if kv_seg is None else jnp.asarray(kv_seg),
  )
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  for form, fn in forms(c).items():

    @jax.jit  # one compile per form: op-by-op dispatch of the scans took twice as long
    def forward_and_vjp(q, k, v, dout, fn=fn):
      out, vjp = jax.vjp(functools.partial(fn, mask=mask), q, k, v)
      return (out, *vjp(dout))

    got = forward_and_vjp(f32(q), f32(k), f32(v), f32(dout))
    for label, g, w in zip(('out', 'dq', 'dk', 'dv'), got, want):
      np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5, err_msg=f'{form} {label}')


def test_padding_contributes_nothing_and_padded_rows_are_zero():
  c = CASES['causal_packed']
  q, k, v, _, seg, _ = inputs(c)
  mask = MaskSpec(causal=True, q_segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(seg))
  out = linear.linear_attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), mask=mask)
  noisy = k.copy()
  noisy[seg == 0] = 1e3  # keys of padding: changing them changes nothing
  out2 = linear.linear_attention(*(jnp.asarray(x, jnp.float32) for x in (q, noisy, v)), mask=mask)
  np.testing.assert_array_equal(out, out2)
  assert np.all(np.asarray(out)[seg == 0] == 0)


def test_causal_memory_is_linear_in_length():
  """Compiled temp memory of forward + backward at 4x the length grows ~4x, not ~16x."""

  def temp(T):
    x = jax.ShapeDtypeStruct((1, T, 2, 16), jnp.float32)
    loss = lambda q, k, v: linear.linear_attention(q, k, v, mask=MaskSpec(causal=True)).sum()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  ratio = temp(4096) / temp(1024)
  assert 2.5 < ratio < 6, ratio


def test_errors():
  x = jnp.zeros((1, 4, 2, 4))
  with pytest.raises(ValueError, match=r'window=\(2, 0\) does not apply to linear attention'):
    linear.linear_attention(x, x, x, mask=MaskSpec(causal=True, window=(2, 0)))
  with pytest.raises(ValueError, match="feature_map='tanh' is not one of"):
    linear.linear_attention(x, x, x, feature_map='tanh')
  with pytest.raises(ValueError, match='the recurrent form is causal'):
    recurrent(x, x, x, mask=MaskSpec())
  assert sorted(linear.FEATURE_MAPS) == sorted(config_lib.LINEAR_FEATURE_MAPS)


@pytest.mark.parametrize(
  'overrides, message',
  [
    (dict(window=(8, 0)), r"window=\(8, 0\) needs attention='softmax'"),
    (dict(position='alibi'), "position='alibi' biases softmax logits"),
    (dict(attention_impl='chunked'), "attention_impl='chunked' picks a softmax kernel"),
    (dict(attention_dropout_rate=0.1), 'attention_dropout_rate=0.1 drops softmax probabilities'),
    (dict(linear_feature_map='tanh'), "linear_feature_map='tanh' is not valid"),
    (dict(attention='performer'), "attention='performer' is not valid; choose one of"),
  ],
)
def test_config_errors(overrides, message):
  with pytest.raises(ValueError, match=message):
    ModelConfig(attention=overrides.pop('attention', 'linear'), **overrides)


# Decoding with a fixed-size state -----------------------------------------------------------------
def test_state_steps_equal_parallel_attention():
  """Self (GQA, RoPE) and cross attention: a prefill of 3 tokens, then one step per token, gives
  the outputs of the whole sequence at once, and the state keeps its size."""
  cfg = ModelConfig(
    family='causal_lm', d_model=24, num_heads=4, num_kv_heads=2, head_dim=6, attention='linear',
    attention_chunk_size=4, position='rope', max_length=32,
  )  # fmt: skip
  rope = parts(cfg).relative_positions  # RoPE: self attention only
  kind = parts(cfg).attention
  self_attn = MultiHeadAttention(cfg, kind, relative_positions=rope)
  cross_attn = MultiHeadAttention(cfg, kind)
  rng = np.random.default_rng(0)
  B, T, P, S = 2, 9, 3, 7
  x = jnp.asarray(rng.standard_normal((B, T, 16)), jnp.float32)
  enc = jnp.asarray(rng.standard_normal((B, S, 16)), jnp.float32)
  kv_seg = jnp.asarray([[1] * 7, [1] * 4 + [0] * 3])
  causal = MaskSpec(causal=True)
  cross = lambda n: MaskSpec(q_segment_ids=jnp.ones((B, n), jnp.int32), kv_segment_ids=kv_seg)
  # Init and the full passes jitted: eager flax ran op by op.
  p_self = jax.jit(lambda key: self_attn.init(key, x, mask=causal)['params'])(jax.random.PRNGKey(0))
  p_cross = jax.jit(lambda key: cross_attn.init(key, x, enc, mask=cross(T))['params'])(
    jax.random.PRNGKey(1)
  )
  full_self = jax.jit(lambda p: self_attn.apply({'params': p}, x, mask=causal))(p_self)
  full_cross = jax.jit(lambda p: cross_attn.apply({'params': p}, x, enc, mask=cross(T)))(p_cross)

  mode = CacheMode('prefill', T)
  y, c_self = self_attn.apply(
    {'params': p_self}, x[:, :P], mask=causal, cache_mode=mode, mutable=True
  )
  outs_self = [y]
  y, c_cross = cross_attn.apply(
    {'params': p_cross}, x[:, :P], enc, mask=cross(P), cache_mode=mode, mutable=True
  )
  outs_cross = [y]
  shapes = jax.tree.map(jnp.shape, c_self['cache'])
  assert shapes == {'linear_state': (B, 2, 6, 6), 'linear_normalizer': (B, 2, 1, 6)}
  mode = CacheMode('step', T)  # each step jitted once: op by op, the steps took most of the test
  step_self = jax.jit(
    lambda cache, xt, t: self_attn.apply(
      {'params': p_self, 'cache': cache},
      xt,
      mask=causal,
      positions=jnp.full((B, 1), t),
      cache_mode=mode,
      mutable=True,
    )
  )
  step_cross = jax.jit(
    lambda cache, xt: cross_attn.apply(
      {'params': p_cross, 'cache': cache}, xt, enc, mask=cross(1), cache_mode=mode, mutable=True
    )
  )
  for t in range(P, T):
    y, c_self = step_self(c_self['cache'], x[:, t : t + 1], t)
    outs_self.append(y)
    y, c_cross = step_cross(c_cross['cache'], x[:, t : t + 1])
    outs_cross.append(y)
    assert jax.tree.map(jnp.shape, c_self['cache']) == shapes  # constant in the length
  np.testing.assert_allclose(jnp.concatenate(outs_self, 1), full_self, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(jnp.concatenate(outs_cross, 1), full_cross, rtol=1e-5, atol=1e-5)


def tiny(family, **overrides):
  base = dict(
    family=family,
    vocab_size=40,
    d_model=32,
    num_heads=4,
    d_ff=64,
    num_layers=2,
    max_length=32,
    dropout_rate=0.0,
    tie_output=False,
    norm_placement='pre',
    attention='linear',
    attention_chunk_size=4,
  )
  return ModelConfig(**{**base, **overrides})


@pytest.mark.parametrize(
  'family, overrides',
  [
    ('causal_lm', dict(position='rope', num_kv_heads=2, scan_layers=True)),
    # ~11 s; cross attention's state steps are in test_state_steps_equal_parallel_attention
    pytest.param('encoder_decoder', dict(position='learned', num_layers=1), marks=pytest.mark.slow),
  ],
)
def test_decoding_equals_the_parallel_form_token_for_token(family, overrides):
  model, params = random_model(tiny(family, **overrides), seed=3)
  rng = np.random.default_rng(0)
  tokens = np.zeros((4, 9), np.int32)
  for row, n in enumerate((9, 4, 1, 6)):  # right-padded rows of different lengths
    tokens[row, :n] = rng.integers(3, 40, n)
  tokens[:, 0] = np.where(family == 'causal_lm', 1, tokens[:, 0])  # CausalLM prompts start at bos
  tokens = jnp.asarray(tokens)
  if family == 'causal_lm':
    got = decode.generate(model, params, tokens, max_new_tokens=8)
    want = greedy_uncached_continue(model, params, tokens, 8)
    beams = decode.generate(model, params, tokens, max_new_tokens=8, beam_size=3)
  else:
    got = decode.translate(model, params, tokens, max_length=8)
    want = greedy_uncached_translate(model, params, tokens, 8)
    beams = decode.translate(model, params, tokens, max_length=8, beam_size=3)
  np.testing.assert_array_equal(got, want)
  assert len(set(map(tuple, np.asarray(got).tolist()))) > 1  # not a constant model
  assert beams.shape == got.shape


def test_bidirectional_lm_padding_changes_nothing_and_every_token_sees_the_future():
  model, params = random_model(tiny('bidirectional_lm', position='learned'), seed=1)
  rng = np.random.default_rng(0)
  tokens = rng.integers(5, 40, (2, 11)).astype(np.int32)
  segments = np.ones((2, 11), np.int32)
  segments[0, 7:] = 0  # padding, whatever its tokens
  apply = jax.jit(model.apply)  # eager flax is slow on CPU
  logits = lambda t: np.asarray(
    apply({'params': params}, jnp.asarray(t), segments=jnp.asarray(segments))
  )
  base = logits(tokens)
  other = tokens.copy()
  other[0, 7:] = rng.integers(5, 40, 4)
  np.testing.assert_allclose(logits(other)[0, :7], base[0, :7], rtol=1e-6, atol=1e-6)
  later = tokens.copy()
  later[1, 10] = (later[1, 10] - 4) % 35 + 5  # another token at the end moves the first output
  assert not np.allclose(logits(later)[1, 0], base[1, 0])
