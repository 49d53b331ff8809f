"""model.norm='batchnorm': the norm against a float64 NumPy reference on padded batches, its
running statistics, the models that thread the padding mask to every norm, and its errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_reference import greedy_uncached_continue

from transformer.config import ModelConfig
from transformer.model import decode, hooks, models
from transformer.model.norms import BATCHNORM_MOMENTUM, BatchNorm
from transformer.model.scan import unscan_params

B, T, D = 3, 7, 24
LENGTHS = (7, 4, 1)  # real tokens per row: each row padded differently, one with a single token
EPS = 1e-6
VOCAB = 40


def _segments(lengths=LENGTHS, length=T) -> np.ndarray:
  """[B, T] int32: 1 for a row's first lengths[b] tokens, 0 (padding) after."""
  return (np.arange(length)[None] < np.array(lengths)[:, None]).astype(np.int32)


def _inputs(seed: int) -> np.ndarray:
  """x [B, T, D] float32 whose features have their own scales and offsets."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((B, T, D)) * rng.uniform(0.5, 3.0, D) + rng.uniform(-2.0, 2.0, D)
  return x.astype(np.float32)


def _params(seed: int, use_bias: bool) -> dict:
  rng = np.random.default_rng(seed)
  params = {'scale': rng.uniform(0.5, 1.5, D).astype(np.float32)}
  if use_bias:
    params['bias'] = rng.standard_normal(D).astype(np.float32)
  return params


def _fresh_stats() -> dict:
  return {'mean': np.zeros(D, np.float32), 'var': np.ones(D, np.float32)}


def reference(x, segments, params, mean=None, var=None):
  """Float64 BatchNorm: (y, mean, var); the statistics over the real tokens (segments > 0) only,
  unless `mean` and `var` (running statistics) are given."""
  x = np.asarray(x, np.float64)
  if mean is None:
    tokens = x[np.asarray(segments) > 0]  # [N, D]: the real tokens, padding dropped
    mean, var = tokens.mean(axis=0), tokens.var(axis=0)  # biased variance
  y = (x - mean) / np.sqrt(np.asarray(var, np.float64) + EPS) * params['scale']
  return y + params.get('bias', 0.0), mean, var


def _train(params, stats, x, segments, use_bias=True):
  """A training-mode call: (y, updated batch_stats)."""
  norm = BatchNorm(EPS, use_bias=use_bias)
  y, updates = norm.apply(
    {'params': params, 'batch_stats': stats},
    jnp.asarray(x),
    None if segments is None else jnp.asarray(segments),
    deterministic=False,
    mutable=['batch_stats'],
  )
  return np.asarray(y), jax.tree.map(np.asarray, updates['batch_stats'])


# The norm alone ----------------------------------------------------------------------------------
@pytest.mark.parametrize('use_bias', [True, False])
def test_training_forward_equals_the_reference_on_a_padded_batch(use_bias):
  x, segments, params = _inputs(0), _segments(), _params(1, use_bias)
  y, _ = _train(params, _fresh_stats(), x, segments, use_bias)
  want, mean, _ = reference(x, segments, params)
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
  # The padding would move the statistics: the reference over every token is another answer.
  everything, _, _ = reference(x, np.ones_like(segments), params)
  assert np.abs(everything - want)[segments > 0].max() > 0.05
  y_unpadded, _ = _train(params, _fresh_stats(), x, None, use_bias)  # segments=None: all real
  np.testing.assert_allclose(y_unpadded, everything, rtol=1e-5, atol=1e-5)


def test_padded_values_change_nothing_at_real_positions():
  x, segments, params = _inputs(0), _segments(), _params(1, True)
  y, stats = _train(params, _fresh_stats(), x, segments)
  other = np.where(segments[..., None] > 0, x, 1e6 * _inputs(5))
  other[2, 3, 0] = np.nan  # whatever a padded slot holds, even NaN
  y_other, stats_other = _train(params, _fresh_stats(), other, segments)
  real = segments > 0
  np.testing.assert_array_equal(y_other[real], y[real])
  jax.tree.map(np.testing.assert_array_equal, stats_other, stats)


def test_running_statistics_move_by_the_momentum_after_one_and_two_steps():
  assert BATCHNORM_MOMENTUM == 0.9  # PyTorch's default (its momentum=0.1)
  m = BATCHNORM_MOMENTUM
  params = _params(1, True)
  first, second = (_inputs(0), _segments()), (_inputs(2), _segments((5, 2, 6)))
  _, stats1 = _train(params, _fresh_stats(), *first)
  _, stats2 = _train(params, stats1, *second)
  _, mean1, var1 = reference(*first, params)
  _, mean2, var2 = reference(*second, params)
  want1 = {'mean': (1 - m) * mean1, 'var': m * 1.0 + (1 - m) * var1}
  want2 = {'mean': m * want1['mean'] + (1 - m) * mean2, 'var': m * want1['var'] + (1 - m) * var2}
  for got, want in ((stats1, want1), (stats2, want2)):
    for key in ('mean', 'var'):
      np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6)


def test_evaluation_normalises_by_the_running_statistics_alone():
  x, params = _inputs(0), _params(1, True)
  rng = np.random.default_rng(3)
  stats = {
    'mean': rng.standard_normal(D).astype(np.float32),
    'var': rng.uniform(0.5, 4.0, D).astype(np.float32),
  }
  norm = BatchNorm(EPS)
  variables = {'params': params, 'batch_stats': stats}
  y, updates = norm.apply(variables, jnp.asarray(x), jnp.asarray(_segments()),
                          mutable=['batch_stats'])  # fmt: skip
  want, _, _ = reference(x, None, params, stats['mean'], stats['var'])
  np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)  # padding included
  jax.tree.map(np.testing.assert_array_equal, updates['batch_stats'], stats)  # not moved
  alone = norm.apply(variables, jnp.asarray(x[1:2]))  # a row does not depend on the others
  np.testing.assert_allclose(np.asarray(alone)[0], np.asarray(y)[1], rtol=1e-6, atol=1e-6)


def test_without_the_collection_training_reads_and_writes_no_statistics_and_evaluation_refuses():
  x, segments, params = _inputs(0), _segments(), _params(1, True)
  norm = BatchNorm(EPS)
  # A diagnostic forward (faults.describe_nonfinite): batch statistics, nothing to update.
  y = norm.apply({'params': params}, jnp.asarray(x), jnp.asarray(segments), deterministic=False)
  np.testing.assert_allclose(np.asarray(y), reference(x, segments, params)[0], 1e-5, 1e-5)
  with pytest.raises(ValueError, match=r"norm='batchnorm'.*batch_stats"):
    norm.apply({'params': params}, jnp.asarray(x))


# Models -----------------------------------------------------------------------------------------
def _cfg(family='causal_lm', **overrides) -> ModelConfig:
  base = dict(
    family=family, vocab_size=VOCAB, d_model=D, num_heads=2, d_ff=32, num_layers=2,
    max_length=16, dropout_rate=0.0, norm='batchnorm',
  )  # fmt: skip
  return ModelConfig(**{**base, **overrides})


def _random_variables(cfg: ModelConfig, seed: int = 0) -> dict:
  """Parameters and running statistics far from their init, so that every norm matters."""
  model = models.build(cfg)
  variables = models.init_variables(model, jax.random.PRNGKey(0))
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda p: p + 0.3 * rng.standard_normal(p.shape).astype(p.dtype),
                        variables['params'])  # fmt: skip
  stats = jax.tree.map(lambda s: s + rng.uniform(0.1, 1.0, s.shape).astype(s.dtype),
                       variables['batch_stats'])  # fmt: skip
  return {'params': params, 'batch_stats': stats}


def _model_inputs(family: str, tokens: np.ndarray, segments: np.ndarray) -> dict:
  if family == 'encoder_decoder':
    return dict(inputs=tokens, decoder_inputs=tokens[::-1], inputs_segments=segments,
                targets_segments=segments[::-1])  # fmt: skip
  return dict(inputs=tokens, segments=segments)


def _train_forward(cfg, variables, inputs):
  model = models.build(cfg)
  apply = jax.jit(lambda v, i: model.apply(v, **i, deterministic=False, mutable=['batch_stats']))
  logits, updates = apply(variables, inputs)
  return np.asarray(logits), updates['batch_stats']


MODELS = [
  ('causal_lm', dict(norm_placement='pre', embedding_norm=True)),  # final and embedding norms
  ('encoder_decoder', dict()),  # post-LN, cross attention
  ('bidirectional_lm', dict(norm_placement='pre')),  # the MLM head's norm too
]


@pytest.mark.parametrize('family,overrides', MODELS, ids=[f for f, _ in MODELS])
def test_a_models_padding_never_reaches_the_statistics(family, overrides):
  """Every norm site gets the token mask: other ids at padded positions (padding by segment id)
  leave the training-mode logits at real positions and every running statistic unchanged."""
  cfg = _cfg(family, **overrides)
  variables = _random_variables(cfg)
  rng = np.random.default_rng(0)
  tokens = rng.integers(5, VOCAB, (B, T)).astype(np.int32)
  segments = _segments()
  padded = np.where(segments > 0, tokens, 0)  # pad ids at padded positions
  other = np.where(segments > 0, tokens, rng.integers(5, VOCAB, (B, T)))  # anything there
  logits, stats = _train_forward(cfg, variables, _model_inputs(family, padded, segments))
  logits_other, stats_other = _train_forward(cfg, variables, _model_inputs(family, other, segments))
  real = (segments[::-1] if family == 'encoder_decoder' else segments) > 0  # the logits' rows
  np.testing.assert_allclose(logits_other[real], logits[real], rtol=1e-5, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               stats_other, stats)  # fmt: skip
  moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), stats, variables['batch_stats'])
  assert min(jax.tree.leaves(moved)) > 0  # every norm site updated its statistics
  # Counted as real tokens, the same ids would move the statistics (not all: a norm whose input
  # is another norm's output sees that norm's bias as its mean, whichever tokens count).
  every = np.ones_like(segments)
  _, stats_all = _train_forward(cfg, variables, _model_inputs(family, other, every))
  apart = jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), stats_all, stats))
  assert sum(d > 1e-4 for d in apart) >= len(apart) // 2


def test_scan_and_remat_give_the_plain_stacks_statistics_and_gradients():
  cfg = _cfg(norm_placement='pre')
  variables = _random_variables(cfg)
  tokens = np.random.default_rng(0).integers(5, VOCAB, (B, T)).astype(np.int32)
  inputs = dict(inputs=np.where(_segments() > 0, tokens, 0))

  def run(cfg, variables):
    model = models.build(cfg)

    def loss(params):
      logits, updates = model.apply({**variables, 'params': params}, **inputs,
                                    deterministic=False, mutable=['batch_stats'])  # fmt: skip
      return jnp.sum(logits**2), updates['batch_stats']

    return jax.jit(jax.grad(loss, has_aux=True))(variables['params'])

  want = run(cfg, variables)
  # float32 sums in another order: within 1e-5 of the largest gradient (or statistic). A bias
  # that feeds a batchnorm has a zero gradient, here rounding noise, so no relative tolerance.
  scale = [max(np.abs(x).max() for x in jax.tree.leaves(tree)) for tree in want]

  def close(got, want):
    for got_tree, want_tree, largest in zip(got, want, scale):
      assert jax.tree.structure(got_tree) == jax.tree.structure(want_tree)
      for a, b in zip(jax.tree.leaves(got_tree), jax.tree.leaves(want_tree)):
        np.testing.assert_allclose(a, b, atol=1e-5 * largest, rtol=0)

  close(run(cfg.replace(remat='full'), variables), want)
  # Scanned: the same layers stacked on a leading axis, and back.
  stack = lambda *layers: jnp.stack(layers)
  scanned_cfg = cfg.replace(scan_layers=True)
  scanned = {}
  for collection, tree in variables.items():
    stack_tree = tree['decoder']['stack']
    layers = [stack_tree[f'layer_{i}'] for i in range(cfg.num_layers)]
    rest = {k: v for k, v in stack_tree.items() if not k.startswith('layer_')}
    decoder = {**tree['decoder'], 'stack': {**rest, 'layers': jax.tree.map(stack, *layers)}}
    scanned[collection] = {**tree, 'decoder': decoder}
  grads, stats = run(scanned_cfg, scanned)
  got = unscan_params(scanned_cfg, {'params': grads, 'batch_stats': stats})
  close((got['params'], got['batch_stats']), want)


def test_decoding_with_the_cache_uses_the_running_statistics():
  cfg = _cfg(norm_placement='pre', tie_output=False)
  model, variables = models.build(cfg), _random_variables(cfg)
  prompt = jnp.asarray([[1, 7, 9, 11], [1, 8, 0, 0]], jnp.int32)
  cached = decode.generate(model, variables, prompt, max_new_tokens=5)
  uncached = greedy_uncached_continue(model, variables, prompt, 5)
  np.testing.assert_array_equal(np.asarray(cached), np.asarray(uncached))
  with pytest.raises(ValueError, match=r"norm='batchnorm'.*batch_stats"):
    decode.generate(model, variables['params'], prompt, max_new_tokens=5)  # no statistics


def test_hooks_run_on_running_statistics_and_refuse_the_final_norm_scale():
  cfg = _cfg()  # post-LN: the normalised sum is hook_resid_mid
  variables = _random_variables(cfg)
  inputs = {'inputs': jnp.asarray([[1, 7, 9, 11, 0]], jnp.int32)}
  logits, cache = hooks.run(cfg, variables, inputs, names=['blocks.1.hook_resid_mid'])
  want = models.build(cfg).apply(variables, **inputs)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert cache['blocks.1.hook_resid_mid'].shape == (1, 5, D)
  pre = cfg.replace(norm_placement='pre')
  assert 'ln_final.hook_scale' not in hooks.hook_names(pre)
  assert hooks.hook_names(pre)[-2:] == ['ln_final.hook_normalized', 'ln_final.hook_out']
  with pytest.raises(ValueError, match=r"ln_final\.hook_scale.*norm='batchnorm'"):
    hooks.select(pre, ['ln_final.hook_scale'])


# Configuration --------------------------------------------------------------------------------
def test_other_norms_have_no_statistics_and_keep_their_parameters():
  for norm in ('layernorm', 'rmsnorm'):
    cfg = _cfg(norm=norm)
    model = models.build(cfg)
    variables = models.init_variables(model, jax.random.PRNGKey(0))
    assert set(variables) == {'params'}
    _, updates = model.apply(variables, **model.dummy_inputs(), deterministic=False,
                             mutable=['batch_stats'])  # fmt: skip
    assert not updates
  shapes = lambda norm: jax.tree.map(lambda x: x.shape, models.param_shapes(_cfg(norm=norm)))
  assert shapes('batchnorm') == shapes('layernorm')  # scale and bias, where LayerNorm has them


def test_batchnorm_with_qk_norm_is_one_error_naming_both():
  with pytest.raises(ValueError, match=r"qk_norm=True.*norm='batchnorm'"):
    _cfg(qk_norm=True)
  with pytest.raises(ValueError, match=r"norm='groupnorm' is not valid.*'batchnorm'"):
    _cfg(norm='groupnorm')


def test_hugging_face_export_refuses_batchnorm():
  from transformer.inference.hf_config import check_exportable

  cfg = _cfg(norm_placement='pre', activation='gelu', position='learned', max_length=16)
  with pytest.raises(ValueError, match=r"model\.norm is 'batchnorm'"):
    check_exportable('gpt2', cfg)
