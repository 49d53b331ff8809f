"""Tests for transformer/objectives.py against float64 NumPy references written here."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.data.masking import mlm_mask
from transformer.model import objectives as O


def _reference_ce(logits, targets, weights, label_smoothing):
  """float64: -sum_v q_v log softmax(logits)_v with an explicit smoothed distribution q."""
  logits = np.asarray(logits, np.float64)
  vocab = logits.shape[-1]
  shifted = logits - logits.max(-1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  low = label_smoothing / (vocab - 1) if label_smoothing else 0.0
  q = np.full(logits.shape, low)
  np.put_along_axis(q, targets[..., None], 1.0 - label_smoothing, axis=-1)
  per_token = -(q * log_probs).sum(-1)
  return (per_token * weights).sum(), weights.sum()


def _cross_entropy(logits, targets, weights=None, label_smoothing=0.0):
  """(smoothed loss sum, weight sum) of `compute_metrics`; weights None = all ones."""
  if weights is None:
    weights = jnp.ones(targets.shape, jnp.float32)
  sums = O.compute_metrics(logits, targets, weights, label_smoothing, accuracy=False)
  return sums['loss'], sums['denominator']


def _batch(seed=0, shape=(3, 5, 7)):
  rng = np.random.default_rng(seed)
  logits = rng.normal(scale=3.0, size=shape)
  targets = rng.integers(0, shape[-1], size=shape[:2])
  weights = np.ones(shape[:2])
  weights[0, 3:] = 0  # padding at the end of two rows
  weights[-1, 1:] = 0
  return logits, targets, weights


@pytest.mark.parametrize('label_smoothing', [0.0, 0.1, 0.4])
def test_cross_entropy_matches_reference(label_smoothing):
  logits, targets, weights = _batch()
  got_loss, got_weight = _cross_entropy(
    jnp.asarray(logits, jnp.float32), jnp.asarray(targets), jnp.asarray(weights), label_smoothing
  )
  want_loss, want_weight = _reference_ce(logits, targets, weights, label_smoothing)
  assert got_loss.dtype == jnp.float32
  assert float(got_loss) == pytest.approx(want_loss, rel=1e-5)
  assert float(got_weight) == want_weight == 9


def test_cross_entropy_default_weights_and_padding_ignored():
  logits, targets, weights = _batch(seed=1)
  loss, weight = _cross_entropy(jnp.asarray(logits), jnp.asarray(targets))
  assert float(weight) == targets.size
  assert float(loss) == pytest.approx(_reference_ce(logits, targets, np.ones_like(weights), 0)[0])
  # Changing logits or targets at padded positions changes nothing.
  noisy_logits, noisy_targets = logits.copy(), targets.copy()
  noisy_logits[weights == 0] = 100.0 * np.random.default_rng(2).normal(size=(6, 7))
  noisy_targets[weights == 0] = 0
  a = _cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights))[0]
  b = _cross_entropy(jnp.asarray(noisy_logits), jnp.asarray(noisy_targets), jnp.asarray(weights))
  assert float(a) == pytest.approx(float(b[0]), rel=1e-6)


def test_cross_entropy_bfloat16_logits():
  logits, targets, weights = _batch(seed=3, shape=(2, 6, 11))
  args = (jnp.asarray(targets), jnp.asarray(weights), 0.1)
  loss32, denominator = _cross_entropy(jnp.asarray(logits, jnp.float32), *args)
  loss16, _ = _cross_entropy(jnp.asarray(logits, jnp.bfloat16), *args)
  assert loss16.dtype == jnp.float32
  assert float(loss16 / denominator) == pytest.approx(float(loss32 / denominator), abs=1e-2)
  rounded = np.asarray(jnp.asarray(logits, jnp.bfloat16), np.float64)  # same inputs, in float64
  want, _ = _reference_ce(rounded, targets, weights, 0.1)
  assert float(loss16) == pytest.approx(want, rel=1e-5)  # the math itself ran in float32


def test_smoothing_raises_loss_of_confident_correct_model():
  targets = np.array([[1, 4, 2]])
  logits = jnp.asarray(20.0 * np.eye(6)[targets])  # [1, 3, 6], all mass on the target
  plain, _ = _cross_entropy(logits, jnp.asarray(targets))
  smoothed, _ = _cross_entropy(logits, jnp.asarray(targets), label_smoothing=0.1)
  assert float(plain) < 1e-6
  assert float(smoothed) > float(plain) + 1.0


@pytest.mark.parametrize('vocab,label_smoothing', [(5, 0.1), (32, 0.3), (2, 0.2)])
def test_smoothing_constant_is_the_minimum(vocab, label_smoothing):
  rng = np.random.default_rng(4)
  targets = rng.integers(0, vocab, size=(2, 3))
  low = label_smoothing / (vocab - 1)
  q = np.full((2, 3, vocab), low)
  np.put_along_axis(q, targets[..., None], 1 - label_smoothing, axis=-1)
  constant = -(q[0, 0] * np.log(q[0, 0])).sum()  # the entropy of q: the lowest loss per token
  best, weight = _cross_entropy(jnp.asarray(np.log(q)), jnp.asarray(targets), None, label_smoothing)
  assert float(best) / float(weight) == pytest.approx(constant, rel=1e-5)
  worse = np.log(q) + rng.normal(scale=0.5, size=q.shape)
  other, _ = _cross_entropy(jnp.asarray(worse), jnp.asarray(targets), None, label_smoothing)
  assert float(other) / float(weight) > constant


def test_compute_metrics_and_summarize():
  logits, targets, weights = _batch(seed=5)
  targets[1, 2] = int(np.argmax(logits[1, 2]))  # at least one hit
  metrics = O.compute_metrics(
    jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights), label_smoothing=0.2
  )
  correct = ((logits.argmax(-1) == targets) * weights).sum()
  assert float(metrics['correct']) == correct >= 1
  assert float(metrics['denominator']) == weights.sum()
  want_loss = _reference_ce(logits, targets, weights, 0.2)[0]
  want_nll = _reference_ce(logits, targets, weights, 0.0)[0]
  assert float(metrics['loss']) == pytest.approx(want_loss, rel=1e-5)
  assert float(metrics['nll']) == pytest.approx(want_nll, rel=1e-5)

  summary = O.summarize(metrics)
  denominator = weights.sum()
  assert summary['loss'] == pytest.approx(want_loss / denominator, rel=1e-5)
  assert summary['nll'] == pytest.approx(want_nll / denominator, rel=1e-5)
  assert summary['accuracy'] == pytest.approx(correct / denominator)
  assert summary['perplexity'] == pytest.approx(math.exp(want_nll / denominator), rel=1e-4)


def test_summarize_zero_denominator():
  empty = {'loss': 0.0, 'nll': 0.0, 'correct': 0.0, 'denominator': 0.0}
  assert O.summarize(empty) == {'loss': 0.0, 'nll': 0.0, 'accuracy': 0.0, 'perplexity': 1.0}


def test_bad_label_smoothing_raises():
  logits, targets, _ = _batch()
  with pytest.raises(ValueError, match='label_smoothing=1.0'):
    _cross_entropy(jnp.asarray(logits), jnp.asarray(targets), label_smoothing=1.0)
  with pytest.raises(ValueError, match='vocab_size=1'):
    _cross_entropy(jnp.zeros((1, 2, 1)), jnp.zeros((1, 2), jnp.int32), label_smoothing=0.1)


SPECIALS = (0, 1, 2, 3, 4)  # pad, bos, eos, unk, mask
MASK_ID = 4


def _tokens(seed=0, shape=(256, 128), vocab=1000):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, size=shape)  # includes some specials mid-sequence
  lengths = rng.integers(0, shape[1] + 1, size=shape[0])
  tokens[np.arange(shape[1])[None, :] >= lengths[:, None]] = 0  # right padding
  tokens[0, :] = 0  # an all-padding row
  tokens[1, :] = 0
  tokens[1, 5] = vocab - 1  # a row with a single real token
  return tokens


def test_mlm_mask_statistics():
  vocab = 1000
  tokens = _tokens(vocab=vocab)
  inputs, targets, weights = mlm_mask(
    np.random.default_rng(0), tokens, mask_id=MASK_ID, vocab_size=vocab, special_ids=SPECIALS
  )
  assert inputs.shape == targets.shape == weights.shape == tokens.shape
  assert inputs.dtype == tokens.dtype and weights.dtype == np.float32
  np.testing.assert_array_equal(targets, tokens)
  chosen = weights == 1
  assert set(np.unique(weights)) <= {0.0, 1.0}
  real = ~np.isin(tokens, SPECIALS)
  assert not chosen[~real].any()  # never padding or specials
  np.testing.assert_array_equal(inputs[~chosen], tokens[~chosen])  # only chosen ones change
  assert chosen.sum() / real.sum() == pytest.approx(0.15, abs=0.01)
  assert chosen[1].sum() == 1 and chosen[1, 5]  # at least one per row with a real token
  assert not chosen[0].any()

  masked = inputs[chosen] == MASK_ID
  unchanged = inputs[chosen] == tokens[chosen]
  replaced = ~masked & ~unchanged
  assert masked.mean() == pytest.approx(0.8, abs=0.02)
  assert unchanged.mean() == pytest.approx(0.1, abs=0.02)
  assert replaced.mean() == pytest.approx(0.1, abs=0.02)
  assert not np.isin(inputs[chosen][replaced], SPECIALS).any()  # no special is inserted
  assert inputs.max() < vocab


def test_mlm_mask_is_deterministic():
  tokens = _tokens(seed=1, shape=(8, 33), vocab=50)
  kwargs = dict(mask_id=MASK_ID, vocab_size=50, special_ids=SPECIALS)
  first = mlm_mask(np.random.default_rng(7), tokens, **kwargs)
  second = mlm_mask(np.random.default_rng(7), tokens, **kwargs)
  other = mlm_mask(np.random.default_rng(8), tokens, **kwargs)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(a, b)
  assert not np.array_equal(first[2], other[2])


def test_mlm_mask_bad_inputs_raise():
  rng = np.random.default_rng(0)
  kwargs = dict(mask_id=MASK_ID, vocab_size=50, special_ids=SPECIALS)
  with pytest.raises(ValueError, match='mask_prob=0.0'):
    mlm_mask(rng, np.ones((2, 3), int), mask_prob=0.0, **kwargs)
  with pytest.raises(ValueError, match=r'shape \(3,\)'):
    mlm_mask(rng, np.ones((3,), int), **kwargs)
  with pytest.raises(ValueError, match='vocab_size=50'):
    mlm_mask(rng, np.full((2, 3), 50), **kwargs)
  with pytest.raises(ValueError, match='mask_id=60'):
    mlm_mask(rng, np.ones((2, 3), int), mask_id=60, vocab_size=50, special_ids=SPECIALS)


@pytest.mark.parametrize('label_smoothing', [0.0, 0.1, 0.3])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_cross_entropy_gradient_matches_autodiff_of_the_definition(label_smoothing, dtype):
  rng = np.random.default_rng(7)
  B, T, V = 2, 5, 11
  logits = jnp.asarray(rng.normal(size=(B, T, V)) * 3, dtype)
  targets = jnp.asarray(rng.integers(0, V, size=(B, T)), jnp.int32)
  weights = jnp.asarray(rng.integers(0, 2, size=(B, T)), jnp.float32)

  def reference(x):  # smoothed target distribution built explicitly, autodiff through log_softmax
    q = (
      jnp.full((B, T, V), label_smoothing / (V - 1))
      .at[jnp.arange(B)[:, None], jnp.arange(T)[None], targets]
      .set(1.0 - label_smoothing)
    )
    nll = -jnp.sum(q * jax.nn.log_softmax(x.astype(jnp.float32)), axis=-1)
    return jnp.sum(nll * weights)

  def ours(x):
    return _cross_entropy(x, targets, weights, label_smoothing)[0]

  def both(x):  # the nll entry gets its own cotangent in compute_metrics
    sums = O.compute_metrics(x, targets, weights, label_smoothing)
    return sums['loss'] + 0.5 * sums['nll']

  def both_reference(x):
    plain = -jnp.take_along_axis(jax.nn.log_softmax(x.astype(jnp.float32)), targets[..., None], -1)
    return reference(x) + 0.5 * jnp.sum(plain[..., 0] * weights)

  tol = 1e-5 if dtype == jnp.float32 else 1e-2
  for f, g in [(ours, reference), (both, both_reference)]:
    np.testing.assert_allclose(f(logits), g(logits), rtol=tol, atol=tol)
    np.testing.assert_allclose(
      np.asarray(jax.grad(f)(logits), np.float32),
      np.asarray(jax.grad(g)(logits), np.float32),
      rtol=tol,
      atol=tol,
    )


# The fused head + loss ---------------------------------------------------------------------------
def _reference_head(hidden, table, bias, targets, weights, label_smoothing, g_loss, g_nll):
  """float64: (loss, nll) of logits = hidden @ table.T + bias, and the gradient of
  g_loss * loss + g_nll * nll in hidden, table and bias: d logits = w (g_loss (p - q) + g_nll
  (p - onehot)), with q the smoothed target distribution."""
  h, t = np.asarray(hidden, np.float64), np.asarray(table, np.float64)
  logits = np.einsum('btd,vd->btv', h, t) + (0.0 if bias is None else np.asarray(bias, np.float64))
  vocab = logits.shape[-1]
  loss, _ = _reference_ce(logits, targets, weights, label_smoothing)
  nll, _ = _reference_ce(logits, targets, weights, 0.0)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  onehot = np.zeros(logits.shape)
  np.put_along_axis(onehot, targets[..., None], 1.0, axis=-1)
  low = label_smoothing / (vocab - 1) if label_smoothing else 0.0
  q = onehot * (1.0 - label_smoothing - low) + low
  d_logits = weights[..., None] * (g_loss * (p - q) + g_nll * (p - onehot))  # [B, T, V]
  grads = (
    np.einsum('btv,vd->btd', d_logits, t),
    np.einsum('btv,btd->vd', d_logits, h),
    d_logits.sum((0, 1)),
  )
  return loss, nll, grads


def _relative(got, want):
  return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


@pytest.mark.parametrize('chunk_size', [1, 6, 23, 64])  # V = 23: remainders, exact, one chunk
@pytest.mark.parametrize('label_smoothing', [0.0, 0.1])
@pytest.mark.parametrize('with_bias', [False, True])
def test_head_cross_entropy_matches_float64_reference(chunk_size, label_smoothing, with_bias):
  rng = np.random.default_rng(chunk_size)
  B, T, D, V = 3, 5, 7, 23
  hidden = rng.normal(size=(B, T, D))
  table = rng.normal(size=(V, D))
  bias = rng.normal(size=(V,)) if with_bias else None
  targets = rng.integers(0, V, size=(B, T))
  weights = (rng.random((B, T)) > 0.3).astype(np.float64)
  g_loss, g_nll = 0.7, 0.2  # both outputs carry a cotangent

  def objective(h, t, b):
    sums = O.head_cross_entropy(
      h, t, b, jnp.asarray(targets), jnp.asarray(weights), label_smoothing, chunk_size
    )
    return g_loss * sums['loss'] + g_nll * sums['nll'], sums

  f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
  argnums = (0, 1, 2) if with_bias else (0, 1)
  (_, sums), grads = jax.value_and_grad(objective, argnums=argnums, has_aux=True)(
    f32(hidden), f32(table), f32(bias)
  )
  loss, nll, want = _reference_head(
    hidden, table, bias, targets, weights, label_smoothing, g_loss, g_nll
  )
  assert float(sums['loss']) == pytest.approx(loss, rel=1e-5)
  assert float(sums['nll']) == pytest.approx(nll, rel=1e-5)
  assert float(sums['denominator']) == weights.sum()
  for got, expected in zip(grads, want):
    assert _relative(got, expected) < 1e-5


def test_head_cross_entropy_equals_compute_metrics_at_lm_scale():
  # Realistic magnitudes (a GPT at init: |logits| of a few units) and a vocabulary of 1000 rows
  # cut into chunks of 384: the fused path and the logits path agree on loss and gradients.
  rng = np.random.default_rng(0)
  B, T, D, V = 2, 9, 48, 1000
  hidden = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
  table = jnp.asarray(rng.normal(scale=0.3, size=(V, D)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, V, size=(B, T)))
  weights = jnp.ones((B, T))

  def logits_path(h, t):
    logits = jnp.einsum('btd,vd->btv', h, t)
    return O.compute_metrics(logits, targets, weights, 0.1, accuracy=False)['loss']

  def fused_path(h, t):
    return O.head_cross_entropy(h, t, None, targets, weights, 0.1, chunk_size=384)['loss']

  want, want_grads = jax.jit(jax.value_and_grad(logits_path, argnums=(0, 1)))(hidden, table)
  got, got_grads = jax.jit(jax.value_and_grad(fused_path, argnums=(0, 1)))(hidden, table)
  assert float(got) == pytest.approx(float(want), rel=1e-5)
  for g, w in zip(got_grads, want_grads):
    assert _relative(g, np.asarray(w, np.float64)) < 1e-5


@pytest.mark.parametrize(
  'change, message',
  [
    ({'chunk_size': 0}, 'chunk_size=0'),
    ({'targets': jnp.zeros((2, 4), jnp.int32)}, 'must be \\[B, T, D\\]'),
    ({'label_smoothing': 1.0}, 'label_smoothing=1.0'),
  ],
)
def test_head_cross_entropy_bad_input_is_a_clear_error(change, message):
  args = dict(
    hidden=jnp.zeros((2, 3, 4)),
    table=jnp.zeros((5, 4)),
    bias=None,
    targets=jnp.zeros((2, 3), jnp.int32),
    weights=jnp.ones((2, 3)),
    label_smoothing=0.0,
    chunk_size=2,
  )
  args.update(change)
  with pytest.raises(ValueError, match=message):
    O.head_cross_entropy(**args)
