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

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch_models
from torch_models import VOCAB

from transformer.config import ModelConfig
from transformer.model import hooks, jaxpr_cache, models


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


def test_bad_names_hooks_and_shapes_are_one_clear_error():
  cfg, _, params = _tiny()
  ids = jnp.ones((1, 4), jnp.int32)
  with pytest.raises(ValueError, match=r"unknown hook name 'blocks\.7\.hook_resid_pre'.*2 layers"):
    hooks.run(cfg, params, {'inputs': ids}, names=['blocks.7.hook_resid_pre'])
  with pytest.raises(ValueError, match='unknown hook name'):
    hooks.run(cfg, params, {'inputs': ids}, hooks={'blocks.0.hook_nothing': lambda x, _: x})
  with pytest.raises(ValueError, match=r'a hook is a \(name or predicate on names, fn\) pair'):
    hooks.run(cfg, params, {'inputs': ids}, hooks=[('blocks.0.attn.hook_z',)])
  with pytest.raises(ValueError, match=r'hook on blocks.0.attn.hook_z returned shape \(1, 4, 4\)'):
    hooks.run(cfg, params, {'inputs': ids}, hooks={'blocks.0.attn.hook_z': lambda z, _: z[..., 0]})


def test_pattern_scores_and_norm_scale_are_writable():
  cfg, _, params = _tiny(activation='gelu', position='learned', num_kv_heads=None)
  ids = jnp.asarray(_ids(7, T=6) % 49 + 1)
  names = ['blocks.1.attn.hook_pattern', 'blocks.1.attn.hook_v', 'blocks.1.attn.hook_z']

  def first_key(pattern, hook):  # head 2 attends to the first token only
    return pattern.at[:, 2].set(jnp.zeros_like(pattern[:, 2]).at[..., 0].set(1.0))

  hooked = {'blocks.1.attn.hook_pattern': first_key}
  _, c = hooks.run(cfg, params, {'inputs': ids}, names=names, hooks=hooked)
  want = np.broadcast_to(
    np.asarray(c['blocks.1.attn.hook_v'])[:, :1, 2], c['blocks.1.attn.hook_z'][:, :, 2].shape
  )
  np.testing.assert_allclose(c['blocks.1.attn.hook_z'][:, :, 2], want, rtol=1e-6, atol=1e-6)
  # Scores set to 0 wherever a key is visible: the pattern is uniform over the visible keys.
  flat = {'blocks.0.attn.hook_attn_scores': lambda s, _: jnp.where(jnp.isneginf(s), s, 0.0)}
  _, c = hooks.run(cfg, params, {'inputs': ids}, names=['blocks.0.attn.hook_pattern'], hooks=flat)
  T = ids.shape[1]
  uniform = np.tril(np.ones((T, T))) / np.arange(1, T + 1)[:, None]
  want = np.broadcast_to(uniform, (2, 4, T, T))
  np.testing.assert_allclose(c['blocks.0.attn.hook_pattern'], want, rtol=1e-6)
  # Zeroing one head's result removes what zeroing its z removes (the bias stays).
  result = {'blocks.1.attn.hook_result': lambda r, _: r.at[:, :, 2].set(0.0)}
  z = {'blocks.1.attn.hook_z': lambda z, _: z.at[:, :, 2].set(0.0)}
  got, want = (hooks.run(cfg, params, {'inputs': ids}, hooks=h)[0] for h in (result, z))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert np.abs(np.asarray(got) - hooks.run(cfg, params, {'inputs': ids})[0]).max() > 1e-3
  # Twice the divisor halves the normalised value (TransformerLens's LN freezing replaces it the
  # same way), and the output's distance from the bias.
  names = ['ln_final.hook_normalized', 'ln_final.hook_out']
  _, plain = hooks.run(cfg, params, {'inputs': ids}, names=names)
  double = {'ln_final.hook_scale': lambda s, _: 2 * s}
  _, got = hooks.run(cfg, params, {'inputs': ids}, names=names, hooks=double)
  np.testing.assert_allclose(got[names[0]], plain[names[0]] / 2, rtol=1e-6, atol=1e-7)
  bias = np.asarray(params['decoder']['stack']['final_norm']['bias'])
  np.testing.assert_allclose(
    got[names[1]] - bias, (plain[names[1]] - bias) / 2, rtol=1e-5, atol=1e-6
  )


def test_a_hook_sees_the_global_it_reads_at_every_call():
  cfg, _, params = _tiny()
  inputs = {'inputs': jnp.asarray(_ids(8, T=5) % 49 + 1)}
  global _HEAD
  name = 'blocks.1.attn.hook_z'

  def ablate(z, hook):  # reads a global, as TransformerLens's Main Demo does
    return z.at[:, :, _HEAD].set(0.0)

  seen = {}
  for _HEAD in (0, 2, 0):
    seen.setdefault(_HEAD, []).append(
      np.asarray(hooks.run_jit(cfg, params, inputs, hooks={name: ablate})[0])
    )
  want = {
    h: hooks.run(cfg, params, inputs, hooks={name: lambda z, _, h=h: z.at[:, :, h].set(0.0)})[0]
    for h in (0, 2)
  }
  for h in (0, 2):
    for got in seen[h]:
      np.testing.assert_allclose(got, want[h], rtol=1e-6, atol=1e-6)
  assert np.abs(seen[0][0] - seen[2][0]).max() > 1e-3


def test_one_compile_serves_a_sweep_over_a_jnp_index():
  cfg, _, params = _tiny()
  inputs = {'inputs': jnp.asarray(_ids(9, T=5) % 49 + 1)}
  name = 'blocks.0.attn.hook_z'
  clean = {'inputs': jnp.asarray(_ids(19, T=5) % 49 + 1)}
  source = np.asarray(hooks.run(cfg, params, clean, names=[name])[1][name])
  clean_z = jnp.asarray(source)  # as docs/dissect.md's sweep: what the hook reads are arrays
  compiles = lambda: len(jaxpr_cache._PROGRAMS) + len(hooks._LIFTED)
  before = compiles()
  outs = []
  for head in range(3):
    index = jnp.asarray(head)  # an array: a constant passed in, not a literal of the program

    def patch(z, hook, i=index):
      return z.at[:, :, i].set(clean_z[:, :, i])

    outs.append(hooks.run_jit(cfg, params, inputs, hooks=[(name, patch)])[0])
    assert compiles() == before + 1
  for head, got in enumerate(outs):
    put = {name: lambda z, _, h=head: z.at[:, :, h].set(source[:, :, h])}
    want = hooks.run(cfg, params, inputs, hooks=put)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  assert np.abs(np.asarray(outs[0]) - np.asarray(outs[1])).max() > 1e-4


def test_a_loop_over_python_numbers_compiles_once_and_falls_back_where_they_must_be_static():
  """TransformerLens's loops: each call a new hook that differs only in Python numbers (a
  partial's keyword, a lambda's loop variable, a notebook's global), or reads another clean
  cache. The numbers are the compiled forward's arguments, so one compile serves the loop, and
  every result equals the forward traced with the number in it. A hook that needs its number to
  be a Python int (a slice bound) traces at every call, with the same results."""
  cfg, _, params = _tiny()
  inputs = {'inputs': jnp.asarray(_ids(12, T=5) % 49 + 1)}
  clean = {'inputs': jnp.asarray(_ids(13, T=5) % 49 + 1)}
  name = 'blocks.1.hook_resid_pre'
  source = np.asarray(hooks.run(cfg, params, clean, names=[name])[1][name])

  def patch(resid, hook, pos, clean_resid):
    return resid.at[:, pos].set(clean_resid[:, pos])

  def cut(resid, hook, pos):  # a slice bound: needs pos static
    return resid.at[:, : pos + 1].set(0.0)

  for make in (
    lambda p: functools.partial(patch, pos=p, clean_resid=source),
    lambda p: lambda r, hook: patch(r, hook, p, source),
    lambda p: functools.partial(cut, pos=p),
  ):
    before = len(hooks._LIFTED) + len(hooks._TRACE_EVERY_CALL)
    for p in range(4):
      got = hooks.run_jit(cfg, params, inputs, hooks=[(name, make(p))])[0]
      want = hooks.run(cfg, params, inputs, hooks=[(name, make(p))])[0]  # traced with p in it
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert len(hooks._LIFTED) + len(hooks._TRACE_EVERY_CALL) == before + 1  # one key per loop
  assert any(key[2][0][1][0][0] == 'partial' for key in hooks._TRACE_EVERY_CALL)  # cut's


def test_transformerlens_fwd_hooks_filters_hook_objects_and_none():
  cfg, _, params = _tiny()
  inputs = {'inputs': jnp.asarray(_ids(10, T=5) % 49 + 1)}
  calls = []

  def look(act, hook):  # reads only: returns None, which leaves the activation unchanged
    calls.append((hook.name, hook.layer(), tuple(act.shape)))

  fwd = [(lambda n: n.endswith('attn.hook_z') or n == 'ln_final.hook_normalized', look)]
  plain = hooks.run(cfg, params, inputs)[0]
  np.testing.assert_array_equal(hooks.run(cfg, params, inputs, hooks=fwd)[0], plain)
  assert calls == [
    ('blocks.0.attn.hook_z', 0, (2, 5, 4, 6)),
    ('blocks.1.attn.hook_z', 1, (2, 5, 4, 6)),
    ('ln_final.hook_normalized', None, (2, 5, 24)),
  ]
  # Two hooks on one name run in order; a list entry names a hook point as the dict does.
  zero = lambda z, hook: z.at[:, :, 1].set(0.0)
  half = lambda z, hook: z * 0.5
  fwd = [('blocks.1.attn.hook_z', zero), ('blocks.1.attn.hook_z', half)]
  both = lambda z, _: z.at[:, :, 1].set(0.0) * 0.5
  want = hooks.run_jit(cfg, params, inputs, hooks={'blocks.1.attn.hook_z': both})[0]
  np.testing.assert_array_equal(hooks.run_jit(cfg, params, inputs, hooks=fwd)[0], want)


def test_a_hook_that_keeps_its_tracer_is_one_error_and_a_print_runs_each_call(capsys):
  cfg, _, params = _tiny()
  inputs = {'inputs': jnp.asarray(_ids(11, T=5) % 49 + 1)}
  kept = []
  keep = {'blocks.0.hook_resid_post': lambda x, hook: kept.append(x)}
  with pytest.raises(
    ValueError, match=r'hook on blocks.0.hook_resid_post kept the activation.*run_with_cache'
  ):
    hooks.run_jit(cfg, params, inputs, hooks=keep)
  kept.clear()
  show = {'blocks.0.hook_resid_post': lambda x, hook: print(hook.name, x.shape)}
  for _ in range(2):
    hooks.run_jit(cfg, params, inputs, hooks=show)
  assert capsys.readouterr().out == '\n'.join(['blocks.0.hook_resid_post (2, 5, 24)'] * 2) + '\n'


def test_names_of_every_family():
  enc_dec = ModelConfig(family='encoder_decoder', vocab_size=20, d_model=16, num_heads=2, d_ff=16,
                        num_layers=1, norm_placement='pre')  # fmt: skip
  names = hooks.hook_names(enc_dec)
  assert (
    'encoder.blocks.0.attn.hook_z' in names and 'decoder.blocks.0.cross_attn.hook_pattern' in names
  )
  assert 'decoder.blocks.0.hook_cross_attn_out' in names and 'decoder.ln_final.hook_scale' in names
  assert 'decoder.blocks.0.ln_cross.hook_normalized' in names
  assert names[-1] == 'decoder.ln_final.hook_out'
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
  picked = [last, 'ln_final.hook_scale', 'ln_final.hook_normalized', 'ln_final.hook_out']
  _, cache = hooks.run(cfg, params, {'inputs': ids}, names=picked)
  x = np.asarray(cache[last], np.float64)
  norm = params['decoder']['stack']['final_norm']
  x = x - x.mean(-1, keepdims=True)
  scale = np.asarray(cache['ln_final.hook_scale'], np.float64)
  # TransformerLens's value: the divisor sqrt(var + eps), computed here independently.
  np.testing.assert_allclose(scale, np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps),
                             rtol=1e-6)  # fmt: skip
  # hook_normalized is before the norm's weight and bias, as in TransformerLens; hook_out after.
  np.testing.assert_allclose(cache['ln_final.hook_normalized'], x / scale, rtol=1e-5, atol=1e-5)
  rebuilt = x / scale * norm['scale'] + norm['bias']
  np.testing.assert_allclose(rebuilt, cache['ln_final.hook_out'], rtol=1e-5, atol=1e-5)


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
  wanted = lambda n: (
    n.endswith(('hook_pattern', 'hook_resid_post', 'hook_resid_mid'))
    or (n.startswith('embed.') or '.ln1.' in n)
  )
  logits, cache = hooks.run_jit(cfg, params, inputs, names=wanted)
  # BERT's embeddings under TransformerLens's embed. names, and its post-LN norms' scale.
  embeddings = model.bert.embeddings
  modules = {
    'embed.hook_embed': embeddings.word_embeddings,
    'embed.hook_pos_embed': embeddings.position_embeddings,
    'embed.hook_token_type_embed': embeddings.token_type_embeddings,
    'embed.ln': embeddings.LayerNorm,
    'blocks.1.ln1': model.bert.encoder.layer[1].attention.output.LayerNorm,
  }
  seen = _capture(modules, model, ids)
  for key in modules:
    x, y = seen[key]
    if key.endswith('ln') or key.endswith('ln1'):
      np.testing.assert_allclose(cache[f'{key}.hook_out'], y, rtol=2e-4, atol=2e-4)
      want = _tl_scale(x, config.layer_norm_eps, centre=True)
      np.testing.assert_allclose(cache[f'{key}.hook_scale'], want, rtol=2e-5)
      centred = x - x.mean(-1, keepdims=True)
      np.testing.assert_allclose(cache[f'{key}.hook_normalized'], centred / want, rtol=2e-4,
                                 atol=2e-5)  # fmt: skip
    else:
      np.testing.assert_allclose(cache[key], np.broadcast_to(y, cache[key].shape), rtol=2e-4,
                                 atol=2e-5)  # fmt: skip
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


def _capture(modules: dict, model, ids) -> dict:
  """{key: (input, output)} of each torch module in `modules` {key: module} on one forward."""
  seen = {}
  handles = [
    module.register_forward_hook(lambda m, a, y, key=key: seen.__setitem__(key, (a[0], y)))
    for key, module in modules.items()
  ]
  with torch.no_grad():
    model(torch.tensor(ids))
  for handle in handles:
    handle.remove()
  return {key: (x.detach().numpy(), _first(y).detach().numpy()) for key, (x, y) in seen.items()}


def _first(y):
  return y[0] if isinstance(y, tuple) else y


def _tl_scale(x: np.ndarray, eps: float, centre: bool) -> np.ndarray:
  """TransformerLens's hook_scale of a norm's input x: sqrt(mean(x^2) + eps), x centred first
  for a LayerNorm."""
  x = np.asarray(x, np.float64)
  x = x - x.mean(-1, keepdims=True) if centre else x
  return np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def _torch_norms(model, name):
  """{our norm name: torch module} of GPT-2 or Llama, and the norms' eps."""
  out = {}
  for layer, block in enumerate(torch_models.blocks(model)):
    if name == 'gpt2':
      ln1, ln2 = block.ln_1, block.ln_2
    else:
      ln1, ln2 = block.input_layernorm, block.post_attention_layernorm
    out[f'blocks.{layer}.ln1'], out[f'blocks.{layer}.ln2'] = ln1, ln2
  out['ln_final'] = model.transformer.ln_f if name == 'gpt2' else model.model.norm
  eps = model.config.layer_norm_epsilon if name == 'gpt2' else model.config.rms_norm_eps
  return out, eps


@pytest.mark.parametrize('name', ['gpt2', 'llama'])
def test_embeddings_norms_and_head_results_equal_pytorchs(models_both, name):
  model, cfg, params = models_both[name]
  ids = _ids(12)
  N, H = cfg.num_heads, cfg.head_size
  norms, eps = _torch_norms(model, name)
  modules = dict(norms)
  base = model.transformer if name == 'gpt2' else model.model
  modules['hook_embed'] = base.wte if name == 'gpt2' else base.embed_tokens
  if name == 'gpt2':
    modules['hook_pos_embed'] = base.wpe
  for layer in range(cfg.num_layers):
    modules[f'out_{layer}'] = torch_models.out_proj(model, layer)
  seen = _capture(modules, model, ids)
  logits, cache = hooks.run_jit(cfg, params, {'inputs': jnp.asarray(ids)}, names=None)
  tol = dict(rtol=2e-4, atol=2e-5)
  np.testing.assert_allclose(cache['hook_embed'], seen['hook_embed'][1], **tol)
  if name == 'gpt2':  # torch's [1, T, D] table rows, repeated per row as TransformerLens does
    want = np.broadcast_to(seen['hook_pos_embed'][1], cache['hook_pos_embed'].shape)
    np.testing.assert_allclose(cache['hook_pos_embed'], want, **tol)
  else:
    assert 'hook_pos_embed' not in cache  # RoPE acts inside attention
  for norm, (x, y) in ((k, seen[k]) for k in norms):
    np.testing.assert_allclose(cache[f'{norm}.hook_out'], y, rtol=2e-4, atol=2e-4)
    want = _tl_scale(x, eps, centre=name == 'gpt2')
    np.testing.assert_allclose(cache[f'{norm}.hook_scale'], want, rtol=2e-5)
    # TransformerLens's hook_normalized: divided by the scale, before the weight and bias.
    x = x - x.mean(-1, keepdims=True) if name == 'gpt2' else x
    np.testing.assert_allclose(cache[f'{norm}.hook_normalized'], x / want, rtol=2e-4, atol=2e-5)
  for layer in range(cfg.num_layers):
    z, out = seen[f'out_{layer}']  # the heads merged [B, T, N * H], and the attention's output
    proj = torch_models.out_proj(model, layer)
    w = proj.weight.detach().numpy()  # GPT-2's Conv1D: [N * H, D]; Llama's Linear: [D, N * H]
    w = (w if name == 'gpt2' else w.T).reshape(N, H, -1)
    want = np.einsum('btnh,nhd->btnd', z.reshape(*z.shape[:2], N, H), w)  # each head's output
    result = cache[f'blocks.{layer}.attn.hook_result']
    np.testing.assert_allclose(result, want, rtol=2e-4, atol=2e-4)
    bias = 0 if proj.bias is None else proj.bias.detach().numpy()
    np.testing.assert_allclose(np.asarray(result).sum(2) + bias, out, rtol=2e-4, atol=2e-4)
  np.testing.assert_allclose(logits, model(torch.tensor(ids)).logits.detach().numpy(), rtol=2e-4,
                             atol=2e-4)  # fmt: skip


def test_rotated_queries_and_keys_equal_llamas(models_both):
  model, cfg, params = models_both['llama']
  ids = _ids(13)
  B, T = ids.shape
  attn = torch_models.blocks(model)[1].self_attn
  seen = _capture({'q': attn.q_proj, 'k': attn.k_proj}, model, ids)
  positions = torch.arange(T)[None]
  cos, sin = model.model.rotary_emb(torch.zeros(1), positions)  # [1, T, H] each
  cos, sin = cos.numpy()[:, :, None], sin.numpy()[:, :, None]  # [1, T, 1, H]

  def rotate(x, heads):  # Llama's rotate-half RoPE, written out: x cos + rotate_half(x) sin
    x = x.reshape(B, T, heads, cfg.head_size)
    half = cfg.head_size // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin

  names = ['blocks.1.attn.hook_rot_q', 'blocks.1.attn.hook_rot_k', 'blocks.1.attn.hook_q']
  _, cache = hooks.run_jit(cfg, params, {'inputs': jnp.asarray(ids)}, names=names)
  np.testing.assert_allclose(
    cache[names[0]], rotate(seen['q'][1], cfg.num_heads), rtol=2e-4, atol=2e-5
  )
  np.testing.assert_allclose(
    cache[names[1]], rotate(seen['k'][1], cfg.kv_heads), rtol=2e-4, atol=2e-5
  )
  assert np.abs(np.asarray(cache[names[0]]) - np.asarray(cache[names[2]])).max() > 1e-2
