"""Tests for transformer.model.attention: every implementation against a float64 NumPy reference."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.model import attention
from transformer.model.attention import MaskSpec, dot_product_attention, select_implementation

CPU_IMPLEMENTATIONS = ['xla', 'chunked']


@dataclasses.dataclass(frozen=True)
class Case:
  B: int = 2
  T: int = 8
  S: int | None = None  # None: self attention, S = T
  N: int = 4
  K: int | None = None  # None: K = N
  H: int = 8
  causal: bool = False
  q_seg: tuple | None = None  # one row per batch element; 0 = padding
  kv_seg: tuple | None = None  # None with q_seg: same as q_seg
  window: tuple | None = None
  alibi: bool = False
  scale: float | None = None
  chunk_size: int = 4


CASES = {
  'no_mask': Case(),
  'causal': Case(T=9, causal=True),
  'padding': Case(q_seg=((1, 1, 1, 1, 1, 0, 0, 0), (1,) * 8), chunk_size=128),  # one chunk
  'packed': Case(q_seg=((1, 1, 1, 2, 2, 3, 0, 0), (1, 1, 2, 2, 2, 2, 2, 0))),
  'packed_causal': Case(causal=True, q_seg=((1, 1, 1, 2, 2, 3, 0, 0), (1,) * 6 + (0, 0))),
  'window': Case(T=11, window=(2, 1)),
  'window_causal_ragged': Case(T=13, causal=True, window=(3, 0), chunk_size=5),  # 13 = 5+5+3
  'cross': Case(T=5, S=13),
  'cross_causal_segments': Case(
    T=5,
    S=13,
    causal=True,
    q_seg=((1, 1, 2, 2, 0), (1,) * 5),
    kv_seg=((1,) * 6 + (2,) * 7, (1,) * 9 + (0,) * 4),
  ),
  'cross_window': Case(T=5, S=13, window=(1, 4)),
  'gqa': Case(N=6, K=2, causal=True),
  'mqa': Case(N=4, K=1, q_seg=((1, 1, 1, 2, 2, 3, 0, 0), (1,) * 8)),
  'odd_heads_no_scaling': Case(B=1, N=5, H=3, scale=1.0),
  'alibi_gqa': Case(N=6, K=3, alibi=True),
  'alibi_causal': Case(T=10, causal=True, alibi=True),
}


def make_inputs(c: Case, seed: int = 0):
  """float64 NumPy inputs q, k, v, cotangent, slopes, plus the MaskSpec of the case."""
  rng = np.random.default_rng(seed)
  S, K = c.S or c.T, c.K or c.N
  q = rng.normal(size=(c.B, c.T, c.N, c.H))
  k = rng.normal(size=(c.B, S, K, c.H))
  v = rng.normal(size=(c.B, S, K, c.H))
  dout = rng.normal(size=(c.B, c.T, c.N, c.H))
  slopes = rng.uniform(0.05, 1.0, size=c.N) if c.alibi else None
  q_seg = kv_seg = None
  if c.q_seg is not None:
    q_seg = np.array(c.q_seg, np.int32)
    kv_seg = np.array(c.kv_seg if c.kv_seg is not None else c.q_seg, np.int32)
  mask = MaskSpec(
    causal=c.causal,
    q_segment_ids=None if q_seg is None else jnp.asarray(q_seg),
    kv_segment_ids=None if kv_seg is None else jnp.asarray(kv_seg),
    window=c.window,
  )
  return q, k, v, dout, slopes, mask


def np_mask(c: Case, mask: MaskSpec) -> np.ndarray:
  """bool[B, T, S] built by loops from the definition."""
  S = c.S or c.T
  out = np.zeros((c.B, c.T, S), bool)
  q_seg, kv_seg = (
    (None, None)
    if mask.q_segment_ids is None
    else (np.asarray(mask.q_segment_ids), np.asarray(mask.kv_segment_ids))
  )
  for b in range(c.B):
    for i in range(c.T):
      for j in range(S):
        ok = not (c.causal and j > i)
        if c.window is not None:
          ok &= i - c.window[0] <= j <= i + c.window[1]
        if q_seg is not None:
          qs, ks = q_seg[b, i], kv_seg[b, j]
          ok &= qs != 0 and qs == ks
        out[b, i, j] = ok
  return out


def np_attention(c: Case, q, k, v, dout, slopes, visible):
  """float64 forward and backward: (out, probs, dq, dk, dv)."""
  N, K, H = q.shape[2], k.shape[2], q.shape[3]
  G = N // K
  scale = 1 / np.sqrt(H) if c.scale is None else c.scale
  kk, vv = k[:, :, np.arange(N) // G], v[:, :, np.arange(N) // G]  # kv head of each query head
  s = np.einsum('btnh,bsnh->bnts', q, kk) * scale
  if slopes is not None:
    i, j = np.arange(q.shape[1])[:, None], np.arange(k.shape[1])[None, :]
    s = s - slopes[None, :, None, None] * np.abs(i - j)
  vis = visible[:, None]  # [B, 1, T, S]
  s_max = np.where(vis, s, -np.inf).max(-1, keepdims=True)
  s_max = np.where(np.isfinite(s_max), s_max, 0.0)
  e = np.where(vis, np.exp(s - s_max), 0.0)
  denom = e.sum(-1, keepdims=True)
  p = e / np.where(denom > 0, denom, 1.0)  # fully masked rows: all zeros
  out = np.einsum('bnts,bsnh->btnh', p, vv)
  dp = np.einsum('btnh,bsnh->bnts', dout, vv)
  ds = p * (dp - (p * dp).sum(-1, keepdims=True))
  dq = scale * np.einsum('bnts,bsnh->btnh', ds, kk)
  dkk = scale * np.einsum('bnts,btnh->bsnh', ds, q)
  dvv = np.einsum('bnts,btnh->bsnh', p, dout)
  dk = dkk.reshape(*k.shape[:2], K, G, H).sum(3)  # sum over the query heads sharing a kv head
  dv = dvv.reshape(*v.shape[:2], K, G, H).sum(3)
  return out, p, dq, dk, dv


def run(c: Case, impl, q, k, v, dout, slopes, mask, dtype=jnp.float32):
  """Output and gradients w.r.t. (q, k, v[, slopes]) for the cotangent dout, jitted."""

  @jax.jit
  def f(q, k, v, slopes, mask, dout):
    def attend(q, k, v, slopes):
      kwargs = dict(scale=c.scale, implementation=impl, chunk_size=c.chunk_size)
      return dot_product_attention(q, k, v, mask=mask, alibi_slopes=slopes, **kwargs)

    out, vjp = jax.vjp(attend, q, k, v, slopes)
    return out, vjp(dout)

  args = [jnp.asarray(x, dtype) for x in (q, k, v)]
  args.append(None if slopes is None else jnp.asarray(slopes, jnp.float32))
  return f(*args, mask, jnp.asarray(dout, dtype))


def as_np(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


@pytest.mark.parametrize('name', CASES)
def test_dense_mask_matches_definition(name):
  c = CASES[name]
  mask = make_inputs(c)[-1]
  dense = mask.dense(c.T, c.S or c.T)
  expected = np_mask(c, mask)
  assert dense.dtype == jnp.bool_ and dense.ndim == 4 and dense.shape[1] == 1
  np.testing.assert_array_equal(np.broadcast_to(dense[:, 0], expected.shape), expected)


@pytest.mark.parametrize('name', CASES)
def test_implementations_match_reference_and_each_other(name):
  """Forward and gradients: each CPU implementation vs float64 NumPy, and vs 'xla'."""
  c = CASES[name]
  q, k, v, dout, slopes, mask = make_inputs(c)
  ref = np_attention(c, q, k, v, dout, slopes, np_mask(c, mask))
  results = {impl: run(c, impl, q, k, v, dout, slopes, mask) for impl in CPU_IMPLEMENTATIONS}
  for impl, (out, grads) in results.items():
    assert out.shape == q.shape and out.dtype == jnp.float32, impl
    for got, want in zip((out, *grads[:3]), (ref[0], *ref[2:])):  # out, dq, dk, dv
      np.testing.assert_allclose(as_np(got), want, rtol=1e-5, atol=1e-5, err_msg=impl)
  out_x, grads_x = results['xla']
  for impl, (out, grads) in results.items():
    np.testing.assert_allclose(as_np(out), as_np(out_x), rtol=1e-5, atol=1e-6, err_msg=impl)
    for got, want in zip(grads, grads_x):  # dq, dk, dv and (ALiBi) d slopes
      if want is not None:
        np.testing.assert_allclose(as_np(got), as_np(want), rtol=1e-5, atol=1e-6, err_msg=impl)


@pytest.mark.parametrize(
  'name, dtype',
  [
    ('packed_causal', jnp.bfloat16),
    ('cross_window', jnp.bfloat16),
    ('gqa', jnp.float16),
    ('alibi_causal', jnp.bfloat16),
  ],
)
def test_chunked_matches_xla_low_precision(name, dtype):
  c = CASES[name]
  inputs = make_inputs(c, seed=2)
  out_x, grads_x = run(c, 'xla', *inputs, dtype=dtype)
  out_c, grads_c = run(c, 'chunked', *inputs, dtype=dtype)
  assert out_c.dtype == dtype and all(g.dtype == dtype for g in grads_c[:3])
  np.testing.assert_allclose(as_np(out_c), as_np(out_x), rtol=1e-2, atol=1e-2)
  for got, want in zip(grads_c[:3], grads_x[:3]):
    np.testing.assert_allclose(as_np(got), as_np(want), rtol=1e-2, atol=1e-2)
  # Low precision inputs, float32 softmax: still close to the float64 reference.
  ref_out = np_attention(c, *inputs[:5], np_mask(c, inputs[5]))[0]
  np.testing.assert_allclose(as_np(out_c), ref_out, rtol=5e-2, atol=5e-2)


def test_xla_probs_match_reference():
  c = CASES['cross_causal_segments']
  q, k, v, dout, slopes, mask = make_inputs(c)
  ref_probs = np_attention(c, q, k, v, dout, slopes, np_mask(c, mask))[1]
  out, probs = dot_product_attention(
    *(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), mask=mask, return_probs=True
  )
  assert out.dtype == jnp.bfloat16 and probs.dtype == jnp.float32
  assert probs.shape == (c.B, c.N, c.T, c.S)
  np.testing.assert_allclose(np.asarray(probs), ref_probs, atol=2e-2)
  rows = np.asarray(probs).sum(-1)
  np.testing.assert_allclose(rows, ref_probs.sum(-1), atol=1e-5)  # 1, or 0 on fully masked rows


@pytest.mark.parametrize('impl', CPU_IMPLEMENTATIONS)
def test_fully_masked_rows_are_zero(impl):
  # Batch 0 has padded queries (rows 5..7); batch 1 has only padded keys, so every row is empty.
  c = Case(T=8, S=11, N=4, K=2, causal=True, q_seg=((1,) * 5 + (0,) * 3, (1,) * 8), alibi=True)
  c = dataclasses.replace(c, kv_seg=((1,) * 11, (0,) * 11))
  q, k, v, dout, slopes, mask = make_inputs(c)
  out, (dq, dk, dv, dslopes) = run(c, impl, q, k, v, dout, slopes, mask)
  for g in (out, dq, dk, dv, dslopes):
    assert np.all(np.isfinite(np.asarray(g)))
  empty = ~np_mask(c, mask).any(-1)  # [B, T]
  assert empty[0, 5:].all() and empty[1].all()
  assert np.all(np.asarray(out)[empty] == 0.0)
  assert np.all(np.asarray(dq)[empty] == 0.0)
  assert np.all(np.asarray(dk)[1] == 0.0) and np.all(np.asarray(dv)[1] == 0.0)
  assert np.any(np.asarray(out)[~empty] != 0.0)


def _largest_intermediate(jaxpr) -> int:
  """Largest number of elements of any value in a jaxpr, including nested jaxprs."""
  biggest = 0
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      biggest = max(biggest, int(np.prod(getattr(var.aval, 'shape', ()))))
    for param in eqn.params.values():
      for sub in param if isinstance(param, tuple | list) else (param,):
        sub = getattr(sub, 'jaxpr', sub)  # ClosedJaxpr -> Jaxpr
        if hasattr(sub, 'eqns'):
          biggest = max(biggest, _largest_intermediate(sub))
  return biggest


def test_chunked_memory_is_linear_in_length():
  B, T, N, H = 1, 2048, 2, 8
  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
  mask = MaskSpec(causal=True)
  dense_bytes = B * N * T * T * 4  # one float32 [B, N, T, S] tensor

  def loss(impl):
    f = lambda q, k, v: dot_product_attention(q, k, v, mask=mask, implementation=impl).sum()
    return jax.grad(f, argnums=(0, 1, 2))  # forward and backward

  jaxpr = jax.make_jaxpr(loss('chunked'))(q, q, q)
  assert _largest_intermediate(jaxpr.jaxpr) < B * N * T * T // 8
  assert _largest_intermediate(jax.make_jaxpr(loss('xla'))(q, q, q).jaxpr) >= B * N * T * T
  temp = {}
  for impl in CPU_IMPLEMENTATIONS:
    stats = jax.jit(loss(impl)).lower(q, q, q).compile().memory_analysis()
    if stats is None:
      pytest.skip('memory_analysis is unavailable on this backend')
    temp[impl] = stats.temp_size_in_bytes
  assert temp['xla'] >= dense_bytes  # the check can see a dense tensor when there is one
  assert temp['chunked'] < dense_bytes // 2


def test_mask_spec_is_a_pytree_with_static_fields():
  ids = jnp.array([[1, 1, 2, 0]])
  mask = MaskSpec(causal=True, q_segment_ids=ids, kv_segment_ids=ids, window=[1, 0])
  assert mask.window == (1, 0)
  leaves, treedef = jax.tree_util.tree_flatten(mask)
  assert len(leaves) == 2 and all(leaf is ids for leaf in leaves)
  traces = []

  @jax.jit
  def f(q, mask):
    traces.append(mask.causal)
    return dot_product_attention(q, q, q, mask=mask)

  q = jnp.asarray(np.random.default_rng(0).normal(size=(1, 4, 2, 4)), jnp.float32)
  out1 = f(q, mask)
  out2 = f(q, mask.replace(q_segment_ids=ids + 1, kv_segment_ids=ids + 1))  # same trace
  assert len(traces) == 1
  f(q, mask.replace(causal=False))  # static field: retraces
  assert traces == [True, False]
  assert not np.allclose(out1, out2)  # segment 0 became 1, so the last row changed
  c = Case(B=1, T=4, N=2, H=4, causal=True, window=(1, 0))
  vis = np_mask(c, mask)
  ref = np_attention(c, *(np.asarray(q, np.float64),) * 3, np.zeros((1, 4, 2, 4)), None, vis)[0]
  np.testing.assert_allclose(np.asarray(out1), ref, rtol=1e-5, atol=1e-6)


def test_auto_selection():
  assert select_implementation(16, 16) == 'xla'
  assert select_implementation(1024, 1024) == 'xla'
  assert select_implementation(2048, 1024) == 'chunked'
  assert select_implementation(4096, 4096, return_probs=True) == 'xla'
  c = CASES['packed']
  q, k, v, dout, slopes, mask = make_inputs(c)
  q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
  out, probs = dot_product_attention(q, k, v, mask=mask, return_probs=True)
  np.testing.assert_array_equal(out, dot_product_attention(q, k, v, mask=mask))


def test_register_implementation(monkeypatch):
  monkeypatch.setattr(attention, '_IMPLEMENTATIONS', dict(attention._IMPLEMENTATIONS))
  seen = {}

  def fake(q, k, v, *, mask, scale, alibi_slopes, chunk_size):
    seen.update(scale=scale, chunk_size=chunk_size)
    return attention._IMPLEMENTATIONS['xla'](
      q, k, v, mask=mask, scale=scale, alibi_slopes=alibi_slopes, chunk_size=chunk_size
    )

  attention.register_implementation('pallas', fake)
  x = jnp.ones((1, 3, 2, 4))
  out = dot_product_attention(x, x, x, implementation='pallas', chunk_size=7)
  np.testing.assert_allclose(out, x)  # identical values: the mean of identical rows
  assert seen == {'scale': 0.5, 'chunk_size': 7}


def test_a_registered_implementation_can_be_chosen_from_a_config(monkeypatch):
  from transformer import config as config_lib

  monkeypatch.setattr(attention, '_IMPLEMENTATIONS', dict(attention._IMPLEMENTATIONS))
  monkeypatch.setattr(
    config_lib, 'ATTENTION_IMPLEMENTATIONS', list(config_lib.ATTENTION_IMPLEMENTATIONS)
  )
  with pytest.raises(ValueError, match="attention_impl='mine' is not valid"):
    config_lib.ModelConfig(attention_impl='mine')
  attention.register_implementation('mine', attention._IMPLEMENTATIONS['xla'])
  assert config_lib.ModelConfig(attention_impl='mine').attention_impl == 'mine'


def _ones(*shape):
  return jnp.ones(shape, jnp.float32)


ERRORS = {
  'rank': (dict(q=_ones(2, 8, 4)), 'q must have rank 4'),
  'batch': (dict(k=_ones(3, 8, 4, 8), v=_ones(3, 8, 4, 8)), 'must agree in batch'),
  'head_dim': (dict(k=_ones(2, 8, 4, 4), v=_ones(2, 8, 4, 4)), 'head_dim'),
  'kv_shapes': (dict(v=_ones(2, 9, 4, 8)), 'k and v must have the same shape'),
  'kv_heads': (
    dict(q=_ones(2, 8, 8, 8), k=_ones(2, 8, 3, 8), v=_ones(2, 8, 3, 8)),
    'num_kv_heads=3 does not divide num_heads=8',
  ),
  'q_segment_shape': (
    dict(mask=MaskSpec(q_segment_ids=jnp.ones((2, 7)), kv_segment_ids=jnp.ones((2, 8)))),
    r'q_segment_ids must have shape \[2, 8\]',
  ),
  'kv_segment_shape': (
    dict(mask=MaskSpec(q_segment_ids=jnp.ones((2, 8)), kv_segment_ids=jnp.ones((1, 8)))),
    r'kv_segment_ids must have shape \[2, 8\]',
  ),
  'one_segment_ids': (
    dict(mask=MaskSpec(q_segment_ids=jnp.ones((2, 8)))),
    'needs both q_segment_ids and kv_segment_ids',
  ),
  'mask_type': (dict(mask=jnp.ones((2, 1, 8, 8), bool)), 'mask must be a MaskSpec'),
  'unknown_implementation': (
    dict(implementation='flash'),
    r"implementation='flash' is not one of \['chunked', 'cudnn', 'pallas', 'xla'\]",
  ),
  'probs_not_xla': (
    dict(implementation='chunked', return_probs=True),
    "return_probs=True needs implementation='xla'",
  ),
  'alibi_shape': (dict(alibi_slopes=jnp.ones(3)), r'alibi_slopes must have shape \[4\]'),
  'chunk_size': (dict(chunk_size=0), 'chunk_size=0 must be a positive int'),
}


@pytest.mark.parametrize('name', ERRORS)
def test_validation_errors(name):
  kwargs = dict(q=_ones(2, 8, 4, 8), k=_ones(2, 8, 4, 8), v=_ones(2, 8, 4, 8))
  overrides, message = ERRORS[name]
  kwargs.update(overrides)
  with pytest.raises(ValueError, match=message):
    dot_product_attention(kwargs.pop('q'), kwargs.pop('k'), kwargs.pop('v'), **kwargs)


@pytest.mark.parametrize(
  'window, message',
  [((1, -1), 'non-negative'), ((1,), 'pair of ints'), ((1.5, 2), 'pair of ints')],
)
def test_window_validation(window, message):
  with pytest.raises(ValueError, match=message):
    MaskSpec(window=window)


PALLAS_CASES = {
  # name: (T, S, N, K, mask factory, tolerance); the kernel runs interpreted on CPU.
  'causal_gqa_padding': (
    20,
    20,
    4,
    2,
    lambda B, T, S: MaskSpec(
      causal=True,
      q_segment_ids=jnp.asarray([[1] * 17 + [0] * 3, [1] * 20]),
      kv_segment_ids=jnp.asarray([[1] * 17 + [0] * 3, [1] * 20]),
    ),
  ),
  'packed_window': (
    24,
    24,
    2,
    1,
    lambda B, T, S: MaskSpec(
      q_segment_ids=jnp.asarray([[1] * 10 + [2] * 9 + [0] * 5] * 2),
      kv_segment_ids=jnp.asarray([[1] * 10 + [2] * 9 + [0] * 5] * 2),
      window=(4, 1),
    ),
  ),
  'cross_attention': (12, 33, 2, 2, lambda B, T, S: MaskSpec()),
}


@pytest.mark.parametrize('case', sorted(PALLAS_CASES))
def test_pallas_through_the_core_matches_xla(case):
  T, S, N, K, make_mask = PALLAS_CASES[case]
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.normal(size=(2, T, N, 32)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(2, S, K, 32)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(2, S, K, 32)), jnp.float32)
  cot = jnp.asarray(rng.normal(size=(2, T, N, 32)), jnp.float32)
  mask = make_mask(2, T, S)

  # Jitted: the interpreted kernel, run op by op, took twice as long as its compile.
  @functools.partial(jax.jit, static_argnames='impl')
  def run(q, k, v, cot, mask, impl):
    out, vjp = jax.vjp(
      lambda *x: dot_product_attention(*x, mask=mask, implementation=impl), q, k, v
    )
    return (out, *vjp(cot))

  for got, want in zip(run(q, k, v, cot, mask, 'pallas'), run(q, k, v, cot, mask, 'xla')):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_pallas_rejects_alibi():
  x = _ones(1, 4, 2, 8)
  with pytest.raises(ValueError, match="alibi_slopes are not supported by implementation='pallas'"):
    dot_product_attention(x, x, x, implementation='pallas', alibi_slopes=jnp.ones((2,)))


@pytest.mark.skipif(jax.default_backend() == 'gpu', reason='the error is for non-GPU backends')
def test_cudnn_needs_gpu():
  x = _ones(1, 4, 2, 8)
  with pytest.raises(ValueError, match="'cudnn' needs an NVIDIA GPU.*'xla' or 'chunked'"):
    dot_product_attention(x, x, x, implementation='cudnn')
