"""QK and OV circuits and composition scores of attention-only models, checked against the
model's own attention scores, direct logit attribution and constructed weights."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_helpers import random_model

from research import circuits, interventions
from transformer.config import ModelConfig
from transformer.model import hooks


def _model(**overrides):
  base = dict(family='causal_lm', d_ff=0, num_layers=2, d_model=16, num_heads=4, vocab_size=29,
              max_length=12, position='none', norm_placement='pre', num_kv_heads=2,
              dropout_rate=0.0)  # fmt: skip
  cfg = ModelConfig(**{**base, **overrides})
  _, params = random_model(cfg, seed=7, scale=0.5)
  return cfg, nn.meta.unbox(params)


def _ids(rng, B=3, T=9, V=29):
  return jnp.asarray(rng.integers(1, V, (B, T)), jnp.int32)  # 0 is padding


@pytest.mark.parametrize('norm', ['layernorm', 'rmsnorm'])
def test_first_layer_qk_circuit_is_the_models_attention_score(norm):
  cfg, params = _model(norm=norm)
  ids = _ids(np.random.default_rng(0))
  _, cache = hooks.run_jit(cfg, params, {'inputs': ids}, names=['blocks.0.attn.hook_attn_scores'])
  scores = np.asarray(cache['blocks.0.attn.hook_attn_scores'])  # [B, N, T, T]
  t = np.asarray(ids)
  causal = np.tril(np.ones((9, 9), bool))
  for head in range(cfg.num_heads):
    qk = circuits.qk_circuit(cfg, params, 0, head)
    want = qk[t[:, :, None], t[:, None, :]]  # [B, T, T]
    np.testing.assert_allclose(scores[:, head][:, causal], want[:, causal], rtol=2e-4, atol=2e-4)


def test_positional_qk_circuit_is_the_score_when_tokens_carry_nothing():
  cfg, params = _model(position='learned', num_layers=1)
  params['embedding']['embedding'] = jnp.zeros_like(params['embedding']['embedding'])
  ids = _ids(np.random.default_rng(1), T=10)
  _, cache = hooks.run_jit(cfg, params, {'inputs': ids}, names=['blocks.0.attn.hook_attn_scores'])
  causal = np.tril(np.ones((10, 10), bool))
  for head in range(cfg.num_heads):
    qk = circuits.qk_circuit(cfg, params, 0, head, source='positions')[:10, :10]
    got = np.asarray(cache['blocks.0.attn.hook_attn_scores'])[:, head]
    np.testing.assert_allclose(got[:, causal], np.broadcast_to(qk, got.shape)[:, causal],
                               rtol=2e-4, atol=2e-4)  # fmt: skip


def test_ov_circuit_gives_direct_logit_attribution_where_a_head_sees_one_token():
  # At position 0 a causal head attends to that token alone, so its direct logit attribution
  # is the OV circuit's row divided by the final norm's cached RMS (hook_scale).
  cfg, params = _model(num_layers=1, use_bias=False)
  ids = _ids(np.random.default_rng(2))
  good, bad = 5, 11
  parts = interventions.direct_logit_attribution(cfg, params, {'inputs': ids}, 0, good, bad)
  _, cache = hooks.run_jit(cfg, params, {'inputs': ids}, names=['ln_final.hook_scale'])
  scale = np.asarray(cache['ln_final.hook_scale'], np.float64)[:, 0, 0]  # [B]
  first = np.asarray(ids)[:, 0]
  for head in range(cfg.num_heads):
    ov = circuits.ov_circuit(cfg, params, 0, head)
    want = (ov[first, good] - ov[first, bad]) / scale
    np.testing.assert_allclose(parts[f'blocks.0.attn.head_{head}'], want, rtol=1e-4, atol=1e-5)
  assert 'blocks.0.mlp' not in parts  # attention only


def _constructed(sign: float):
  """One layer, one head of width D: W_V = W_O = I (times sign), unit gains, no biases."""
  cfg, params = _model(num_layers=1, num_heads=1, num_kv_heads=None, d_model=8, use_bias=False,
                       norm_bias=False)  # fmt: skip
  eye = jnp.eye(8)
  attn = params['decoder']['stack']['layer_0']['self_attention']
  attn['value']['kernel'] = eye[:, None, :]
  attn['out']['kernel'] = sign * eye[None]
  for norm in (params['decoder']['stack']['layer_0']['self_attention_norm'],
               params['decoder']['stack']['final_norm']):  # fmt: skip
    norm['scale'] = jnp.ones(8)
  return cfg, params


def test_copying_score_is_one_for_a_copying_head_and_minus_one_for_a_suppressing_one():
  assert circuits.copying_score(*_constructed(1.0), 0, 0) == pytest.approx(1.0, abs=1e-6)
  assert circuits.copying_score(*_constructed(-1.0), 0, 0) == pytest.approx(-1.0, abs=1e-6)
  cfg, params = _model(num_layers=1)  # random weights: somewhere strictly between
  assert -1 < circuits.copying_score(cfg, params, 0, 1) < 1


def test_composition_scores_see_which_side_reads_the_writers_subspace():
  cfg, params = _model(num_layers=2, num_heads=2, num_kv_heads=None, d_model=8)
  stack = params['decoder']['stack']
  rng = np.random.default_rng(3)
  inside, outside = np.zeros((8, 4)), np.zeros((8, 4))
  inside[:4] = rng.standard_normal((4, 4))  # reads dims 0-3
  outside[4:] = rng.standard_normal((4, 4))  # reads dims 4-7
  # Layer 0's heads write into dims 0-3 only.
  out = np.zeros((2, 4, 8))
  out[:, :, :4] = rng.standard_normal((2, 4, 4))
  stack['layer_0']['self_attention']['out']['kernel'] = jnp.asarray(out, jnp.float32)
  attn = stack['layer_1']['self_attention']
  # Reader head 0: queries from the writers' subspace, keys and values from elsewhere.
  # Reader head 1: keys from it.
  attn['query']['kernel'] = jnp.asarray(np.stack([inside, outside], 1), jnp.float32)
  attn['key']['kernel'] = jnp.asarray(np.stack([outside, inside], 1), jnp.float32)
  attn['value']['kernel'] = jnp.asarray(np.stack([outside, outside], 1), jnp.float32)
  scores = circuits.composition_scores(cfg, params)
  q, k, v = scores['q'][0, :, 1], scores['k'][0, :, 1], scores['v'][0, :, 1]  # [writer, reader]
  assert (q[:, 0] > 0.05).all() and np.allclose(q[:, 1], 0, atol=1e-7)
  assert (k[:, 1] > 0.05).all() and np.allclose(k[:, 0], 0, atol=1e-7)
  assert np.allclose(v, 0, atol=1e-7)
  assert (scores['q'][1] == 0).all() and (scores['q'][:, :, 0] == 0).all()  # only forward
  # A float64 reference for one entry: ||W_OV W_QK|| / (||W_OV|| ||W_QK||), gains folded in.
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)['decoder']['stack']
  g0, g1 = (p[f'layer_{i}']['self_attention_norm']['scale'][:, None] for i in (0, 1))
  ov = (g0 * p['layer_0']['self_attention']['value']['kernel'][:, 1]) @ out[1]
  qk = (g1 * inside) @ (g1 * outside).T
  want = np.linalg.norm(ov @ qk) / (np.linalg.norm(ov) * np.linalg.norm(qk))
  assert scores['q'][0, 1, 1, 0] == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize(
  'overrides,message',
  [
    (dict(d_ff=32), r'attention-only .*d_ff=32'),
    (dict(position='rope'), "position='rope'"),
  ],
)
def test_models_the_circuits_do_not_describe_are_one_error(overrides, message):
  cfg, params = _model(**overrides)
  with pytest.raises(ValueError, match=message):
    circuits.qk_circuit(cfg, params, 0, 0)
  cfg, params = _model()
  with pytest.raises(ValueError, match='layer=5 is out of range'):
    circuits.ov_circuit(cfg, params, 5, 0)
  with pytest.raises(ValueError, match="source='values' is not valid"):
    circuits.qk_circuit(cfg, params, 0, 0, source='values')
  with pytest.raises(ValueError, match="needs learned or sinusoidal positions, not 'none'"):
    circuits.qk_circuit(cfg, params, 0, 0, source='positions')


def test_the_corruption_report_of_an_attention_only_model_has_no_mlp_maps(tmp_path):
  from types import SimpleNamespace

  cfg, params = _model(num_layers=1)
  tokenizer = SimpleNamespace(decode=lambda ids: ' '.join(f'w{i}' for i in ids))
  # What the report reads of an inference.Model: its config, weights, tokenizer and prefix.
  model = SimpleNamespace(cfg=cfg, params=params, tokenizer=tokenizer, prompt_prefix=lambda: [1])
  clean, corrupt = [3, 9, 1, 4], [3, 9, 2, 4]
  labels = ([f'w{i}' for i in clean], [f'w{i}' for i in corrupt])
  interventions.corruption_report(model, clean, corrupt, labels, str(tmp_path))
  files = {p.name for p in tmp_path.iterdir()}
  assert {'patching.md', 'patch_resid_pre.png', 'patch_attn_out.png', 'patch_z.png'} <= files
  assert 'patch_mlp_out.png' not in files
  assert 'mlp' not in (tmp_path / 'patching.md').read_text()
