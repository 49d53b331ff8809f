"""The block's wirings against a float64 NumPy forward written from their definitions: pre-norm,
post-norm, sandwich (Gemma 2: a second norm on each sub-layer's output) and the parallel residual
(GPT-NeoX: x + attn(ln1(x)) + mlp(ln2(x))). Every weight is perturbed, the sizes are awkward."""

import jax
import numpy as np
import pytest

from transformer.config import ModelConfig
from transformer.model import hooks, models

D, N, H, F, V, T, L = 12, 3, 4, 20, 29, 7, 2


_BASE = dict(family='causal_lm', vocab_size=V, d_model=D, num_heads=N, d_ff=F, num_layers=L,
             max_length=16, position='learned', activation='gelu', dropout_rate=0.0,
             norm_eps=1e-5, scale_embeddings=False)  # fmt: skip


def _config(**wiring) -> ModelConfig:
  return ModelConfig(**{**_BASE, **wiring})


def _params(cfg: ModelConfig, seed: int):
  params = models.init_params(models.build(cfg), jax.random.PRNGKey(seed))
  rng = np.random.default_rng(seed)  # every weight moved off its init (norm scales, biases too)
  return jax.tree.map(lambda a: a + 0.3 * rng.standard_normal(a.shape).astype(a.dtype), params)


def _ln(x, p):
  x = x - x.mean(-1, keepdims=True)
  return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * p['scale'] + p['bias']


def _gelu(x):
  from math import erf

  return 0.5 * x * (1 + np.vectorize(erf)(x / np.sqrt(2)))


def _attention(x, p):
  q, k, v = (np.einsum('btd,dnh->bnth', x, p[w]['kernel']) + p[w]['bias'][:, None]
             for w in ('query', 'key', 'value'))  # fmt: skip
  scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(H)
  scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  z = (probs / probs.sum(-1, keepdims=True)) @ v  # [B, N, T, H]
  return np.einsum('bnth,nhd->btd', z, p['out']['kernel']) + p['out']['bias']


def _mlp(x, p):
  h = _gelu(x @ p['wi']['kernel'] + p['wi']['bias'])
  return h @ p['wo']['kernel'] + p['wo']['bias']


def _reference(cfg: ModelConfig, params, tokens):
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  table = p['embedding']['embedding']
  x = table[tokens] + p['decoder']['embedder']['positions']['positions']['embedding'][:T]
  for i in range(L):
    b = p['decoder']['stack'][f'layer_{i}']
    attn = lambda h, b=b: _attention(h, b['self_attention'])
    mlp = lambda h, b=b: _mlp(h, b['mlp'])
    if cfg.parallel_residual:
      x = x + attn(_ln(x, b['self_attention_norm'])) + mlp(_ln(x, b['mlp_norm']))
    elif cfg.norm_placement == 'sandwich':
      x = x + _ln(attn(_ln(x, b['self_attention_norm'])), b['self_attention_post_norm'])
      x = x + _ln(mlp(_ln(x, b['mlp_norm'])), b['mlp_post_norm'])
    elif cfg.norm_placement == 'pre':
      x = x + attn(_ln(x, b['self_attention_norm']))
      x = x + mlp(_ln(x, b['mlp_norm']))
    else:
      x = _ln(x + attn(x), b['self_attention_norm'])
      x = _ln(x + mlp(x), b['mlp_norm'])
  if cfg.norm_placement != 'post':
    x = _ln(x, p['decoder']['stack']['final_norm'])
  return x @ table.T  # the tied head


WIRINGS = {
  'pre': dict(norm_placement='pre'),
  'post': dict(norm_placement='post'),
  'sandwich': dict(norm_placement='sandwich'),
  'parallel': dict(norm_placement='pre', parallel_residual=True),
}


@pytest.mark.parametrize('name', sorted(WIRINGS))
def test_a_wiring_computes_its_definition(name):
  cfg = _config(**WIRINGS[name])
  params = _params(cfg, seed=3)
  tokens = np.random.default_rng(4).integers(1, V, (2, T))
  got = np.asarray(models.build(cfg).apply({'params': params}, tokens), np.float64)
  np.testing.assert_allclose(got, _reference(cfg, params, tokens), rtol=1e-4, atol=1e-4)


def test_the_wirings_differ():
  """The reference cannot pass one wiring for another: on the same weights they disagree."""
  cfg = _config(norm_placement='sandwich')
  params = _params(cfg, seed=3)
  tokens = np.random.default_rng(4).integers(1, V, (2, T))
  outs = {name: _reference(_config(**w), params, tokens) for name, w in WIRINGS.items()}
  for a in outs:
    for b in outs:
      assert a == b or not np.allclose(outs[a], outs[b], atol=1e-2), (a, b)


def test_the_hooks_follow_transformer_lens_in_each_wiring():
  """Sandwich: hook_attn_out and hook_mlp_out hold the post-normed outputs, what is added to the
  stream (TransformerLens's ln1_post / ln2_post sit before them). Parallel: no hook_resid_mid,
  and resid_post = resid_pre + attn_out + mlp_out."""
  tokens = np.random.default_rng(5).integers(1, V, (2, T))
  for name in ('sandwich', 'parallel'):
    cfg = _config(**WIRINGS[name])
    params = _params(cfg, seed=6)
    _, cache = hooks.run(cfg, params, {'inputs': tokens}, names=None)
    c = {k: np.asarray(v, np.float64) for k, v in cache.items()}
    for i in range(L):
      b = f'blocks.{i}.'
      if name == 'parallel':
        assert b + 'hook_resid_mid' not in c
        want = c[b + 'hook_resid_pre'] + c[b + 'hook_attn_out'] + c[b + 'hook_mlp_out']
      else:
        np.testing.assert_allclose(c[b + 'hook_resid_mid'],
                                   c[b + 'hook_resid_pre'] + c[b + 'hook_attn_out'],
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
        want = c[b + 'hook_resid_mid'] + c[b + 'hook_mlp_out']
      np.testing.assert_allclose(c[b + 'hook_resid_post'], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
  'bad',
  [
    dict(parallel_residual=True, norm_placement='post'),
    dict(parallel_residual=True, norm_placement='pre', residual=False),
    dict(parallel_residual=True, norm_placement='pre', family='encoder_decoder'),
  ],
)
def test_a_parallel_residual_it_cannot_wire_is_one_error(bad):
  with pytest.raises(ValueError, match='parallel_residual=True .* needs'):
    _config(**bad)
