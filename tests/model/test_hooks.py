"""Named activations and hooks (transformer.model.hooks) against PyTorch's own models and hooks.

Small random GPT-2 and Llama (GQA, RoPE) models are built with `transformers`, saved, imported
into sparrow, and their attentions, hidden states, per-head outputs (a forward pre-hook on the
output projection) and a zero-ablated head are compared at float32 rounding.
"""

import importlib.util
import os
import sys

import pytest

if sys.version_info >= (3, 12) and importlib.util.find_spec('torch') is None:
  pytest.skip(
    'needs torch (not installed on this Python: the CPU wheel here is for Python 3.11)',
    allow_module_level=True,
  )

os.environ['HF_HUB_OFFLINE'] = '1'

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch_models
from torch_models import VOCAB

from transformer.config import ModelConfig
from transformer.model import hooks, models


@pytest.fixture(scope='module')
def models_both(tmp_path_factory):
  return torch_models.build_both(tmp_path_factory.mktemp('hooks_hf'))


def _ids(seed, B=2, T=11):
  return np.random.default_rng(seed).integers(1, VOCAB, (B, T)).astype(np.int32)


@pytest.mark.parametrize('name', ['gpt2', 'llama'])
def test_cached_activations_equal_pytorchs_attentions_hidden_states_and_head_outputs(
  models_both, name
):
  model, cfg, params = models_both[name]
  ids = _ids(0)
  N, H = cfg.num_heads, cfg.head_size
  z_torch = {}
  handles = [
    torch_models.out_proj(model, layer).register_forward_pre_hook(
      lambda mod, args, layer=layer: z_torch.__setitem__(layer, args[0].detach().numpy())
    )
    for layer in range(cfg.num_layers)
  ]
  with torch.no_grad():
    out = model(torch.tensor(ids), output_attentions=True, output_hidden_states=True)
  for h in handles:
    h.remove()
  wanted = lambda n: n.endswith(('hook_pattern', 'hook_resid_post', 'attn.hook_z'))
  logits, cache = hooks.run_jit(cfg, params, {'inputs': jnp.asarray(ids)}, names=wanted)
  assert set(cache) == {
    f'blocks.{layer}.{h}'
    for layer in range(cfg.num_layers)
    for h in ('attn.hook_pattern', 'hook_resid_post', 'attn.hook_z')
  }  # only what was asked for
  tol = dict(rtol=2e-4, atol=2e-5)
  np.testing.assert_allclose(logits, out.logits.numpy(), rtol=2e-4, atol=2e-4)
  for layer in range(cfg.num_layers):
    b = f'blocks.{layer}.'
    np.testing.assert_allclose(cache[b + 'attn.hook_pattern'], out.attentions[layer].numpy(), **tol)
    z = np.asarray(cache[b + 'attn.hook_z']).reshape(*ids.shape, N * H)  # heads merged as torch
    np.testing.assert_allclose(z, z_torch[layer], rtol=2e-4, atol=2e-4)
    if layer < cfg.num_layers - 1:  # torch's last hidden state is after the final norm
      want = out.hidden_states[layer + 1].numpy()
      np.testing.assert_allclose(cache[b + 'hook_resid_post'], want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize('name', ['gpt2', 'llama'])
def test_zero_ablating_a_head_equals_the_same_ablation_in_pytorch(models_both, name):
  model, cfg, params = models_both[name]
  ids, layer, head, H = _ids(1), cfg.num_layers - 1, 1, cfg.head_size

  def zero(mod, args):
    x = args[0].clone()
    x[..., head * H : (head + 1) * H] = 0
    return (x,)

  handle = torch_models.out_proj(model, layer).register_forward_pre_hook(zero)
  with torch.no_grad():
    want = model(torch.tensor(ids)).logits.numpy()
  handle.remove()
  ablate = {f'blocks.{layer}.attn.hook_z': lambda z, _: z.at[:, :, head].set(0.0)}
  got, _ = hooks.run_jit(cfg, params, {'inputs': jnp.asarray(ids)}, hooks=ablate)
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
  plain, _ = hooks.run_jit(cfg, params, {'inputs': jnp.asarray(ids)})
  assert np.abs(np.asarray(plain) - want).max() > 1e-3  # the ablation changed something


def _tiny(**overrides):
  base = dict(family='causal_lm', vocab_size=50, d_model=24, num_heads=4, d_ff=40, num_layers=2,
              max_length=32, dropout_rate=0.0, norm_placement='pre', position='rope',
              activation='swiglu', num_kv_heads=2)  # fmt: skip
  cfg = ModelConfig(**{**base, **overrides})
  model = models.build(cfg)
  params = nn.meta.unbox(model.init(jax.random.PRNGKey(3), **model.dummy_inputs())['params'])
  rng = np.random.default_rng(4)
  params = jax.tree.map(lambda x: jnp.asarray(0.3 * rng.standard_normal(x.shape), x.dtype), params)
  return cfg, model, params


@pytest.mark.parametrize(
  'overrides',
  [
    {},
    dict(norm_placement='post', position='learned', activation='gelu'),
    dict(d_ff=0, position='learned'),  # attention only
  ],
)
def test_the_residual_stream_adds_up_and_scores_give_the_pattern(overrides):
  cfg, model, params = _tiny(**overrides)
  ids = jnp.asarray(_ids(2, T=9) % 49 + 1)
  logits, cache = hooks.run(cfg, params, {'inputs': ids}, names=None)
  assert set(cache) == set(hooks.hook_names(cfg))
  np.testing.assert_allclose(logits, model.apply({'params': params}, ids), rtol=1e-5, atol=1e-5)
  for layer in range(cfg.num_layers):
    b = f'blocks.{layer}.'
    c = {k[len(b) :]: np.asarray(v) for k, v in cache.items() if k.startswith(b)}
    scores = c['attn.hook_attn_scores']
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    np.testing.assert_allclose(probs / probs.sum(-1, keepdims=True), c['attn.hook_pattern'],
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    assert np.isneginf(scores[..., 0, 1:]).all()  # causal: the first query sees one key
    if cfg.norm_placement == 'pre' and not cfg.d_ff:  # attention only: no MLP, no resid_mid
      assert not any('mlp' in k or 'resid_mid' in k for k in c)
      np.testing.assert_allclose(c['hook_resid_post'], c['hook_resid_pre'] + c['hook_attn_out'],
                                 rtol=1e-5, atol=1e-5)  # fmt: skip
    elif cfg.norm_placement == 'pre':
      np.testing.assert_allclose(c['hook_resid_mid'], c['hook_resid_pre'] + c['hook_attn_out'],
                                 rtol=1e-5, atol=1e-5)  # fmt: skip
      np.testing.assert_allclose(c['hook_resid_post'], c['hook_resid_mid'] + c['hook_mlp_out'],
                                 rtol=1e-5, atol=1e-5)  # fmt: skip
    if layer:
      np.testing.assert_array_equal(
        c['hook_resid_pre'], cache[f'blocks.{layer - 1}.hook_resid_post']
      )
  if cfg.activation == 'swiglu' and cfg.d_ff:  # hook_post = silu(gate) * linear
    pre, lin = cache['blocks.0.mlp.hook_pre'], cache['blocks.0.mlp.hook_pre_linear']
    np.testing.assert_allclose(cache['blocks.0.mlp.hook_post'], jax.nn.silu(pre) * lin, rtol=1e-5,
                               atol=1e-6)  # fmt: skip


def test_a_hook_on_the_residual_stream_replaces_it_downstream():
  cfg, model, params = _tiny()
  ids = jnp.asarray(_ids(3, T=7) % 49 + 1)
  _, cache = hooks.run(cfg, params, {'inputs': ids}, names=['blocks.1.hook_resid_pre'])
  # Replacing layer 1's input by layer 1's own cached input changes nothing; by zeros, it does.
  same = {'blocks.1.hook_resid_pre': lambda x, _: cache['blocks.1.hook_resid_pre']}
  base = model.apply({'params': params}, ids)
  np.testing.assert_allclose(hooks.run(cfg, params, {'inputs': ids}, hooks=same)[0], base,
                             rtol=1e-6, atol=1e-6)  # fmt: skip
  mid = {'blocks.0.hook_resid_mid': lambda x, _: jnp.zeros_like(x)}
  _, got = hooks.run(cfg, params, {'inputs': ids}, names=['blocks.0.hook_resid_mid'], hooks=mid)
  np.testing.assert_array_equal(got['blocks.0.hook_resid_mid'], 0.0)

  # Gradients flow through hooks: d logit / d (a scale on one head's z) is finite and non-zero.
  def logit(alpha):
    scale = {'blocks.0.attn.hook_z': lambda z, _: z.at[:, :, 2].multiply(alpha)}
    return hooks.run(cfg, params, {'inputs': ids}, hooks=scale)[0][0, -1, 5]

  g = jax.jit(jax.grad(logit))(1.0)
  assert np.isfinite(g) and abs(float(g)) > 0


def test_bad_names_and_read_only_hooks_are_one_clear_error():
  cfg, _, params = _tiny()
  ids = jnp.ones((1, 4), jnp.int32)
  with pytest.raises(ValueError, match=r"unknown hook name 'blocks\.7\.hook_resid_pre'.*2 layers"):
    hooks.run(cfg, params, {'inputs': ids}, names=['blocks.7.hook_resid_pre'])
  with pytest.raises(ValueError, match='unknown hook name'):
    hooks.run(cfg, params, {'inputs': ids}, hooks={'blocks.0.hook_nothing': lambda x, _: x})
  with pytest.raises(ValueError, match='blocks.0.attn.hook_pattern is read only'):
    hooks.run(cfg, params, {'inputs': ids}, hooks={'blocks.0.attn.hook_pattern': lambda x, _: x})


def test_names_of_every_family():
  enc_dec = ModelConfig(family='encoder_decoder', vocab_size=20, d_model=16, num_heads=2, d_ff=16,
                        num_layers=1, norm_placement='pre')  # fmt: skip
  names = hooks.hook_names(enc_dec)
  assert (
    'encoder.blocks.0.attn.hook_z' in names and 'decoder.blocks.0.cross_attn.hook_pattern' in names
  )
  assert 'decoder.blocks.0.hook_cross_attn_out' in names and 'decoder.ln_final.hook_scale' in names
  assert 'decoder.blocks.0.ln_cross.hook_normalized' in names
  assert names[-1] == 'decoder.ln_final.hook_normalized'
  assert not any(n.startswith('encoder.') and 'cross' in n for n in names)
  model = models.build(enc_dec)
  params = model.init(jax.random.PRNGKey(0), **model.dummy_inputs())['params']
  inputs = {'inputs': jnp.ones((1, 5), jnp.int32), 'decoder_inputs': jnp.ones((1, 4), jnp.int32)}
  picked = lambda n: 'cross_attn.hook_pattern' in n or 'ln_final' in n
  _, cache = hooks.run(enc_dec, params, inputs, names=picked)
  assert cache['decoder.blocks.0.cross_attn.hook_pattern'].shape == (1, 2, 4, 5)
  assert cache['decoder.ln_final.hook_scale'].shape == (1, 4, 1)  # the decoder's, not the encoder's


def test_the_final_norm_scale_rebuilds_the_final_hidden_state():
  cfg, model, params = _tiny(activation='gelu')
  ids = jnp.asarray(_ids(5, T=6) % 49 + 1)
  last = f'blocks.{cfg.num_layers - 1}.hook_resid_post'
  picked = [last, 'ln_final.hook_scale', 'ln_final.hook_normalized']
  _, cache = hooks.run(cfg, params, {'inputs': ids}, names=picked)
  x = np.asarray(cache[last], np.float64)
  norm = params['decoder']['stack']['final_norm']
  x = x - x.mean(-1, keepdims=True)
  rebuilt = x * np.asarray(cache['ln_final.hook_scale']) * norm['scale'] + norm['bias']
  np.testing.assert_allclose(rebuilt, cache['ln_final.hook_normalized'], rtol=1e-5, atol=1e-5)


def test_an_imported_bert_post_ln_matches_pytorchs_attentions_and_hidden_states(tmp_path):
  import transformers

  from transformer.inference import hf

  config = transformers.BertConfig(
    vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=3,
    intermediate_size=40, max_position_embeddings=32, layer_norm_eps=1e-4,
    initializer_range=0.3, attn_implementation='eager',
  )  # fmt: skip
  torch.manual_seed(2)
  model = torch_models.randomise(transformers.BertForMaskedLM(config), 3)
  model.save_pretrained(str(tmp_path / 'bert'), safe_serialization=True)
  _, cfg, params, _ = hf.convert_in_memory(str(tmp_path / 'bert'))
  assert cfg.family == 'bidirectional_lm' and cfg.norm_placement == 'post'
  ids = _ids(6, T=9)
  types = np.zeros_like(ids)
  with torch.no_grad():
    out = model(torch.tensor(ids), token_type_ids=torch.tensor(types), output_attentions=True,
                output_hidden_states=True)  # fmt: skip
  inputs = {'inputs': jnp.asarray(ids), 'token_types': jnp.asarray(types)}
  wanted = lambda n: n.endswith(('hook_pattern', 'hook_resid_post', 'hook_resid_mid'))
  logits, cache = hooks.run_jit(cfg, params, inputs, names=wanted)
  np.testing.assert_allclose(logits, out.logits.numpy(), rtol=2e-4, atol=2e-4)
  seen = {}
  for layer in range(cfg.num_layers):
    b = f'blocks.{layer}.'
    np.testing.assert_allclose(cache[b + 'attn.hook_pattern'], out.attentions[layer].numpy(),
                               rtol=2e-4, atol=2e-5)  # fmt: skip
    np.testing.assert_allclose(cache[b + 'hook_resid_post'], out.hidden_states[layer + 1].numpy(),
                               rtol=2e-4, atol=2e-4)  # fmt: skip
    # Post-LN: the residual stream between attention and MLP is BERT's attention.output.LayerNorm
    norm = model.bert.encoder.layer[layer].attention.output.LayerNorm
    handle = norm.register_forward_hook(lambda m, a, y, layer=layer: seen.__setitem__(layer, y))
    with torch.no_grad():
      model(torch.tensor(ids), token_type_ids=torch.tensor(types))
    handle.remove()
    np.testing.assert_allclose(cache[b + 'hook_resid_mid'], seen[layer].numpy(), rtol=2e-4,
                               atol=2e-4)  # fmt: skip
