"""The three families: parameter counts, causality, padding invariance, remat/scan equivalence."""

import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_helpers import preset

from transformer.config import ModelConfig
from transformer.model import models


def tiny(family='causal_lm', **overrides):
  base = dict(
    family=family,
    vocab_size=50,
    d_model=32,
    num_heads=4,
    d_ff=64,
    num_layers=2,
    max_length=32,
    dropout_rate=0.0,
  )
  if family == 'bidirectional_lm':
    base.update(type_vocab_size=2, embedding_norm=True, position='learned')
  base.update(overrides)
  return ModelConfig(**base)


class Jitted:
  """A model whose `apply` is jitted (eager flax is slow on CPU); static keyword arguments."""

  def __init__(self, model):
    self.model = model
    self._apply = jax.jit(model.apply, static_argnames=('deterministic', 'method'))

  def apply(self, variables, *args, **kwargs):
    return self._apply(variables, *args, **kwargs)


def init(cfg, seed=0):
  model = models.build(cfg)
  params = jax.jit(models.init_params, static_argnums=0)(model, jax.random.PRNGKey(seed))
  return Jitted(model), params


def tokens(rng, shape, vocab=50, low=5):
  return jnp.asarray(rng.integers(low, vocab, size=shape), jnp.int32)


# Exact parameter counts of the reference architectures ---------------------------------------
@pytest.mark.parametrize(
  'name,expected',
  [('gpt2_small', 124_439_808), ('bert_base', 109_514_298), ('transformer_base', 63_082_496)],
)
def test_reference_parameter_counts(name, expected):
  assert models.count_params(preset(name)) == expected


def test_describe_cli_prints_exact_count():
  out = subprocess.run(
    [sys.executable, '-m', 'experiments.describe', '--config=configs/gpt2_small.py'],
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  assert 'parameters: 124439808' in out.splitlines()
  assert 'training FLOPs per token' in out


def test_flops_per_token_matches_hand_count():
  cfg = preset('gpt2_small')
  flops = models.flops_per_token(cfg, 1024)
  # 12 layers x (4 d^2 attention + 2 * 4 d^2 MLP) + tied head V * d.
  d, v, layers = 768, 50257, 12
  matmul = layers * (4 * d * d + 8 * d * d) + v * d
  assert flops['matmul_params'] == matmul
  assert flops['train'] == 3 * (2 * matmul + 4 * 1024 * d * layers)


# Forward passes of every family and option ---------------------------------------------------
@pytest.mark.parametrize('family', ['causal_lm', 'bidirectional_lm', 'encoder_decoder'])
@pytest.mark.parametrize('position', ['sinusoidal', 'learned', 'rope', 'alibi', 'none'])
def test_families_and_positions_run(family, position):
  # One layer: this checks that each pair builds and runs; the other tests here stack two.
  cfg = tiny(family, position=position, num_layers=1)
  model, params = init(cfg)
  x = tokens(np.random.default_rng(0), (2, 7))
  args = (x, x) if family == 'encoder_decoder' else (x,)
  logits = model.apply({'params': params}, *args)
  assert logits.shape == (2, 7, 50)
  assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize(
  'overrides',
  [
    dict(activation='swiglu', norm='rmsnorm', norm_placement='pre'),
    dict(activation='gelu', num_kv_heads=2),
    dict(activation='gelu_tanh', num_kv_heads=1, window=(3, 0), attention_impl='chunked'),
    dict(tie_output=False, scale_embeddings=False, init='plain', init_distribution='normal'),
  ],
)
def test_options_run_and_differ_from_default(overrides):
  rng = np.random.default_rng(1)
  x = tokens(rng, (2, 9))
  model, params = init(tiny('causal_lm', **overrides))
  logits = model.apply({'params': params}, x)
  assert logits.shape == (2, 9, 50) and np.isfinite(np.asarray(logits)).all()


def test_bert_classifier_head():
  model, params = init(tiny('bidirectional_lm', num_classes=3))
  out = model.apply({'params': params}, tokens(np.random.default_rng(0), (4, 6)))
  assert out.shape == (4, 3)
  assert 'pooler' in params and 'mlm_bias' not in params


def test_dropout_only_when_not_deterministic():
  cfg = tiny('causal_lm', dropout_rate=0.5, attention_dropout_rate=0.3, ffn_dropout_rate=0.2)
  model, params = init(cfg)
  x = tokens(np.random.default_rng(0), (2, 8))
  a = model.apply({'params': params}, x)
  b = model.apply({'params': params}, x)
  np.testing.assert_array_equal(a, b)
  rngs = {'dropout': jax.random.PRNGKey(1)}
  c = model.apply({'params': params}, x, deterministic=False, rngs=rngs)
  assert np.abs(np.asarray(c) - np.asarray(a)).max() > 1e-3


# Causality and padding invariance ------------------------------------------------------------
@pytest.mark.parametrize('position', ['learned', 'rope', 'alibi'])
def test_causal_lm_future_tokens_do_not_change_the_past(position):
  rng = np.random.default_rng(0)
  model, params = init(tiny('causal_lm', position=position))
  x = tokens(rng, (2, 12))
  changed = x.at[:, 7:].set(tokens(rng, (2, 5)))
  a = model.apply({'params': params}, x)
  b = model.apply({'params': params}, changed)
  np.testing.assert_allclose(a[:, :7], b[:, :7], rtol=1e-5, atol=1e-6)
  assert np.abs(np.asarray(a[:, 7:] - b[:, 7:])).max() > 1e-4


def test_encoder_decoder_future_targets_do_not_change_the_past():
  rng = np.random.default_rng(0)
  model, params = init(tiny('encoder_decoder'))
  src, tgt = tokens(rng, (2, 10)), tokens(rng, (2, 9))
  changed = tgt.at[:, 4:].set(tokens(rng, (2, 5)))
  a = model.apply({'params': params}, src, tgt)
  b = model.apply({'params': params}, src, changed)
  np.testing.assert_allclose(a[:, :4], b[:, :4], rtol=1e-5, atol=1e-6)
  assert np.abs(np.asarray(a[:, 4:] - b[:, 4:])).max() > 1e-4


def test_bidirectional_lm_padding_invariance():
  rng = np.random.default_rng(0)
  model, params = init(tiny('bidirectional_lm'))
  x = tokens(rng, (2, 6))
  padded = jnp.concatenate([x, jnp.zeros((2, 5), jnp.int32)], axis=1)  # pad id 0
  types = jnp.asarray(rng.integers(0, 2, size=(2, 6)), jnp.int32)
  types_padded = jnp.concatenate([types, jnp.zeros((2, 5), jnp.int32)], axis=1)
  a = model.apply({'params': params}, x, token_types=types)
  b = model.apply({'params': params}, padded, token_types=types_padded)
  np.testing.assert_allclose(a, b[:, :6], rtol=1e-5, atol=1e-5)


def test_encoder_padding_invariance():
  rng = np.random.default_rng(0)
  model, params = init(tiny('encoder_decoder', position='sinusoidal'))
  src, tgt = tokens(rng, (2, 6)), tokens(rng, (2, 5))
  padded_src = jnp.pad(src, ((0, 0), (0, 7)))
  padded_tgt = jnp.pad(tgt, ((0, 0), (0, 3)))
  enc = lambda s: model.apply({'params': params}, s, method='encode')
  np.testing.assert_allclose(enc(src), enc(padded_src)[:, :6], rtol=1e-5, atol=1e-5)
  a = model.apply({'params': params}, src, tgt)
  b = model.apply({'params': params}, padded_src, padded_tgt)
  np.testing.assert_allclose(a, b[:, :5], rtol=1e-5, atol=1e-5)


def test_packed_segments_equal_separate_sequences():
  rng = np.random.default_rng(3)
  model, params = init(tiny('causal_lm', position='rope'))
  a, b = tokens(rng, (1, 5)), tokens(rng, (1, 4))
  packed = jnp.concatenate([a, b], axis=1)
  segments = jnp.asarray([[1] * 5 + [2] * 4], jnp.int32)
  positions = jnp.asarray([list(range(5)) + list(range(4))], jnp.int32)
  out = model.apply({'params': params}, packed, segments=segments, positions=positions)
  np.testing.assert_allclose(out[:, :5], model.apply({'params': params}, a), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out[:, 5:], model.apply({'params': params}, b), rtol=1e-5, atol=1e-5)


# Remat and scan -------------------------------------------------------------------------------
def _loss_and_grads(cfg, params, x):
  model = models.build(cfg)

  def loss(p):
    args = (x, x) if cfg.family == 'encoder_decoder' else (x,)
    logits = model.apply({'params': p}, *args)
    return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0])

  return jax.jit(jax.value_and_grad(loss))(params)


def _stack_layers(tree):
  """Plain params {layer_0: .., layer_1: ..} -> scanned params {layers: stacked}."""
  if not isinstance(tree, dict):
    return tree
  layer_keys = sorted(k for k in tree if k.startswith('layer_'))
  out = {k: _stack_layers(v) for k, v in tree.items() if k not in layer_keys}
  if layer_keys:
    layers = [tree[k] for k in sorted(layer_keys, key=lambda k: int(k.split('_')[1]))]
    out['layers'] = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)
  return out


@pytest.mark.parametrize(
  'family,remat',
  [
    ('causal_lm', 'full'),
    pytest.param('encoder_decoder', 'save_matmuls', marks=pytest.mark.slow),  # ~20 s: 4 compiles
  ],
)
def test_remat_and_scan_match_plain(family, remat):
  cfg = tiny(family)
  _, params = init(cfg)
  x = tokens(np.random.default_rng(0), (2, 8))
  loss, grads = _loss_and_grads(cfg, params, x)
  remat_loss, remat_grads = _loss_and_grads(cfg.replace(remat=remat), params, x)
  np.testing.assert_allclose(remat_loss, loss, rtol=1e-6)
  jax.tree_util.tree_map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), remat_grads, grads
  )
  scanned_cfg = cfg.replace(scan_layers=True, remat=remat)
  scanned_params = _stack_layers(params)
  # The scanned model's own init has exactly this tree structure.
  _, own = init(scanned_cfg)
  assert jax.tree_util.tree_structure(own) == jax.tree_util.tree_structure(scanned_params)
  scan_loss, scan_grads = _loss_and_grads(scanned_cfg, scanned_params, x)
  np.testing.assert_allclose(scan_loss, loss, rtol=1e-6)
  jax.tree_util.tree_map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
    scan_grads,
    _stack_layers(grads),
  )


def test_output_bias_adds_a_learned_bias_to_the_untied_head():
  cfg = tiny('causal_lm', tie_output=False)
  model, params = init(cfg)
  biased, biased_params = init(cfg.replace(output_bias=True))
  assert biased_params['head']['logits']['bias'].shape == (cfg.vocab_size,)
  bias = np.random.default_rng(1).normal(size=cfg.vocab_size).astype(np.float32)
  with_bias = {**params, 'head': {'logits': {**params['head']['logits'], 'bias': bias}}}
  x = tokens(np.random.default_rng(0), (2, 8))
  out = biased.apply({'params': with_bias}, x)
  np.testing.assert_allclose(out, model.apply({'params': params}, x) + bias, atol=1e-5)


# Precision and initialisation ----------------------------------------------------------------
def test_bfloat16_compute_keeps_float32_params_and_is_close():
  cfg = tiny('causal_lm')
  model, params = init(cfg)
  x = tokens(np.random.default_rng(0), (2, 8))
  ref = model.apply({'params': params}, x)
  bf16, bf16_params = init(cfg.replace(dtype='bfloat16'))
  assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(bf16_params))
  out = bf16.apply({'params': params}, x)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=0.1, rtol=0.05)


def test_scaled_init_shrinks_residual_outputs():
  # 3 layers: sqrt(2 * 3) differs from sqrt(3), 3 and 2 * 3, the factors of likely slips.
  cfg = tiny('causal_lm', num_layers=3)
  _, scaled = init(cfg)
  _, plain = init(cfg.replace(init='plain'))
  layer = lambda p: p['decoder']['stack']['layer_0']
  ratio_out = np.std(layer(scaled)['self_attention']['out']['kernel']) / np.std(
    layer(plain)['self_attention']['out']['kernel']
  )
  ratio_wo = np.std(layer(scaled)['mlp']['wo']['kernel']) / np.std(
    layer(plain)['mlp']['wo']['kernel']
  )
  np.testing.assert_allclose([ratio_out, ratio_wo], 1 / np.sqrt(6), rtol=1e-5)
  q_ratio = np.std(layer(scaled)['self_attention']['query']['kernel']) / np.std(
    layer(plain)['self_attention']['query']['kernel']
  )
  np.testing.assert_allclose(q_ratio, 1.0, rtol=1e-6)
  _, large = init(cfg.replace(init='large'))  # the deliberate opposite: sqrt(6) larger
  ratio_large = np.std(layer(large)['mlp']['wo']['kernel']) / np.std(
    layer(plain)['mlp']['wo']['kernel']
  )
  np.testing.assert_allclose(ratio_large, np.sqrt(6), rtol=1e-5)


# Bad configurations: one clear error each ----------------------------------------------------
@pytest.mark.parametrize(
  'overrides,message',
  [
    (dict(d_model=512, num_heads=6), 'num_heads=6 does not divide d_model=512'),
    (dict(num_heads=8, d_model=64, num_kv_heads=3), 'num_kv_heads=3 does not divide num_heads=8'),
    (dict(family='gpt'), "family='gpt' is not valid"),
    (dict(position='relative'), "position='relative' is not valid"),
    (dict(activation='tanh'), "activation='tanh' is not valid"),
    (dict(norm='groupnorm'), "norm='groupnorm' is not valid"),
    (dict(remat='some'), "remat='some' is not valid"),
    (dict(attention_impl='flash'), "attention_impl='flash' is not valid"),
    (dict(d_ff=-4), 'd_ff=-4 must be an integer >= 0'),
    (dict(num_layers=0), 'num_layers=0 must be a positive integer'),
    (dict(vocab_size=-1), 'vocab_size=-1 must be a positive integer'),
    (dict(dropout_rate=1.5), 'dropout_rate=1.5 must be in [0, 1)'),
    (dict(window=(-1, 0)), 'window=(-1, 0) must be a pair'),
    (dict(dtype='float8'), "dtype='float8' is not valid"),
    (dict(rope_theta=0.0), 'rope_theta=0.0 must be a finite number > 0'),
    (dict(norm_eps=float('nan')), 'norm_eps=nan must be a finite number > 0'),
    (dict(rope_scaling_factor=0.5), 'rope_scaling_factor=0.5 must be a finite number >= 1.0'),
    (dict(pad_id=-1), 'pad_id=-1 must be an integer >= 0'),
    (dict(num_decoder_layers=-2), 'num_decoder_layers=-2 must be an integer >= 0'),
    (dict(num_classes=-1), 'num_classes=-1 must be an integer >= 0'),
    (dict(output_bias=True), 'output_bias=True is a bias on the untied output projection'),
    (dict(output_bias=1, tie_output=False), 'output_bias=1 must be True or False'),
  ],
)
def test_bad_config_raises_one_clear_error(overrides, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    tiny(**{'family': 'causal_lm', **overrides})


def test_unknown_config_key_and_preset():
  with pytest.raises(ValueError, match="unknown model config key 'nmu_heads'"):
    ModelConfig.from_config({'nmu_heads': 4})
  with pytest.raises(ValueError, match="unknown preset 'gpt5'"):
    preset('gpt5')


def test_sinusoidal_positions_over_unscaled_embeddings_warn():
  with pytest.warns(UserWarning, match=r'scale_embeddings=False.*35x the token embeddings'):
    tiny('causal_lm', position='sinusoidal', scale_embeddings=False, init_std=0.02)
  with warnings.catch_warnings():
    warnings.simplefilter('error')  # the paper's setting and learned positions stay quiet
    tiny('causal_lm', position='sinusoidal', scale_embeddings=True, init_std=0.02)
    tiny('causal_lm', position='learned', scale_embeddings=False, init_std=0.02)


def test_norm_bias_false_drops_every_layernorm_bias_and_matches_a_numpy_reference():
  from transformer.model.parts import parts

  cfg = tiny('causal_lm', norm_bias=False, use_bias=False, norm_placement='pre', norm_eps=1e-5)
  _, params = init(cfg)
  paths = ['/'.join(str(k.key) for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
  assert not [p for p in paths if p.endswith('bias')], paths  # projections and norms alike
  assert sum(p.endswith('scale') for p in paths) == 2 * cfg.num_layers + 1  # the norms remain
  x = np.random.default_rng(0).normal(size=(3, 5, 16)).astype(np.float32) * 3 + 1
  norm = parts(cfg).norm()  # the model's own norm part
  variables = norm.init(jax.random.PRNGKey(0), x)
  assert set(variables['params']) == {'scale'}
  scale = np.random.default_rng(1).normal(size=16)
  got = norm.apply({'params': {'scale': scale}}, x)
  x64 = x.astype(np.float64)
  want = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5) * scale
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('layers,residual', [(1, True), (2, True), (2, False)])
def test_attention_only_layers_have_no_mlp_and_match_a_numpy_reference(layers, residual):
  cfg = tiny('causal_lm', d_ff=0, num_layers=layers, d_model=12, num_heads=3, vocab_size=23,
             position='learned', use_bias=False, norm_bias=False, scale_embeddings=False,
             norm_placement='pre', residual=residual)  # fmt: skip
  model, params = init(cfg, seed=layers)
  rng = np.random.default_rng(layers)
  params = jax.tree.map(lambda p: jnp.asarray(0.5 * rng.standard_normal(p.shape), p.dtype), params)
  stack = params['decoder']['stack']
  assert all(set(stack[f'layer_{i}']) == {'self_attention', 'self_attention_norm'}
             for i in range(layers))  # fmt: skip
  x = tokens(rng, (2, 7), vocab=23, low=0)
  got = np.asarray(model.apply({'params': params}, x))

  p64 = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  s64 = p64['decoder']['stack']

  def ln(h, scale):
    h = h - h.mean(-1, keepdims=True)
    return h / np.sqrt((h * h).mean(-1, keepdims=True) + cfg.norm_eps) * scale

  emb = p64['embedding']['embedding']
  h = emb[np.asarray(x)] + p64['decoder']['embedder']['positions']['positions']['embedding'][:7]
  causal = np.tril(np.ones((7, 7), bool))
  for i in range(layers):
    a = s64[f'layer_{i}']['self_attention']
    n = ln(h, s64[f'layer_{i}']['self_attention_norm']['scale'])
    q, k, v = (np.einsum('btd,dnh->bnth', n, a[w]['kernel']) for w in ('query', 'key', 'value'))
    scores = np.where(causal, q @ k.transpose(0, 1, 3, 2) / np.sqrt(4), -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    z = (probs / probs.sum(-1, keepdims=True)) @ v  # [B, N, T, H]
    out = np.einsum('bnth,nhd->btd', z, a['out']['kernel'])  # no MLP: straight to the next
    h = h + out if residual else out  # residual=False: the skip connection is ablated
  want = ln(h, s64['final_norm']['scale']) @ emb.T  # the tied head
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  flops = models.flops_per_token(cfg, 7)
  assert flops['matmul_params'] == layers * 4 * 12 * 12 + 23 * 12  # Q, K, V, O and the head


@pytest.mark.parametrize('placement', ['pre', 'post'])
def test_without_residuals_a_block_outputs_its_last_sublayer_alone(placement):
  from transformer.model import hooks

  cfg = tiny('causal_lm', residual=False, norm_placement=placement, num_layers=2)
  _, params = init(cfg)
  x = tokens(np.random.default_rng(5), (2, 6))
  _, cache = hooks.run(cfg, params, {'inputs': x}, names=None)
  for layer in range(2):
    b = f'blocks.{layer}.'
    post, mlp = np.asarray(cache[b + 'hook_resid_post']), np.asarray(cache[b + 'hook_mlp_out'])
    if placement == 'pre':  # no skip: the block's output is the MLP's output
      np.testing.assert_allclose(post, mlp, rtol=1e-6, atol=1e-6)
      np.testing.assert_allclose(cache[b + 'hook_resid_mid'], cache[b + 'hook_attn_out'],
                                 rtol=1e-6, atol=1e-6)  # fmt: skip
    else:  # post-LN: the norm of the MLP's output alone
      centred = mlp - mlp.mean(-1, keepdims=True)
      want = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + cfg.norm_eps)
      scale = np.asarray(params['decoder']['stack'][f'layer_{layer}']['mlp_norm']['scale'])
      bias = np.asarray(params['decoder']['stack'][f'layer_{layer}']['mlp_norm']['bias'])
      np.testing.assert_allclose(post, want * scale + bias, rtol=1e-4, atol=1e-4)
  plain, _ = hooks.run(cfg, params, {'inputs': x})
  with_skip, _ = init(cfg.replace(residual=True))
  assert not np.allclose(with_skip.apply({'params': params}, x), plain, atol=1e-3)  # it matters
