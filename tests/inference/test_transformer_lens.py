"""TransformerLens's conventions against transformer_lens itself, on one random GPT-2.

The GPT-2 (3 layers, d_model 84, 4 heads, vocab 211) has every bias and norm parameter perturbed,
so a wrong centring, scale or bias shows. It is saved offline and loaded both into sparrow and
into transformer_lens's `TransformerBridge` without weight processing, in float32: every shared
hook name, each intervention, the forward's conventions and each cache helper agree at 1e-4.
Processed at load (`process_weights=True`), it agrees with the bridge in its compatibility mode,
which processes with the same defaults.
"""

import importlib.util
import os
import sys

import pytest

if sys.version_info >= (3, 12) and importlib.util.find_spec('transformer_lens') is None:
  pytest.skip(
    'needs transformer_lens and torch (the CPU torch wheel here is for Python 3.11)',
    allow_module_level=True,
  )

os.environ['HF_HUB_OFFLINE'] = '1'

import numpy as np
import torch
import transformers
from torch_models import randomise
from transformer_lens.model_bridge import TransformerBridge
from transformer_lens.utilities.components_utils import get_act_name as tl_get_act_name

import transformer
from transformer.inference import cache as cache_lib
from transformer.inference.cache import get_act_name
from transformer.model import hooks as hooks_lib

VOCAB, LAYERS, HEADS, T = 211, 3, 4, 14
TOL = 1e-4


@pytest.fixture(scope='module')
def folder(tmp_path_factory):
  """A perturbed random GPT-2 folder."""
  config = transformers.GPT2Config(
    vocab_size=VOCAB, n_positions=32, n_embd=84, n_layer=LAYERS, n_head=HEADS,
    layer_norm_epsilon=1e-5, initializer_range=0.2,
  )  # fmt: skip
  torch.manual_seed(0)
  model = randomise(transformers.GPT2LMHeadModel(config), seed=3)
  directory = str(tmp_path_factory.mktemp('tl') / 'gpt2')
  model.save_pretrained(directory, safe_serialization=True)
  return directory


def _bridge(directory: str, **processing) -> TransformerBridge:
  bridge = TransformerBridge.boot_transformers(directory, device='cpu')
  bridge.enable_compatibility_mode(disable_warnings=True, **processing)
  return bridge


@pytest.fixture(scope='module')
def models(folder):
  """(sparrow Model, transformer_lens bridge), neither processing the weights."""
  return transformer.load(folder), _bridge(folder, no_processing=True)


@pytest.fixture(scope='module')
def tokens():
  return np.random.default_rng(0).integers(0, VOCAB, size=(3, T)).astype(np.int32)


@pytest.fixture(scope='module')
def caches(models, tokens):
  m, bridge = models
  logits, cache = m.run_with_cache(tokens)
  with torch.no_grad():
    tl_logits, tl_cache = bridge.run_with_cache(torch.tensor(tokens, dtype=torch.long))
  return logits, cache, tl_logits.numpy(), tl_cache


def _close(ours, theirs, what: str) -> None:
  theirs = theirs.detach().numpy() if isinstance(theirs, torch.Tensor) else np.asarray(theirs)
  assert ours.shape == theirs.shape, what
  finite = np.isfinite(theirs)  # the scores are -inf where masked, in both
  np.testing.assert_array_equal(np.isfinite(ours), finite, err_msg=what)
  ours, theirs = ours[finite], theirs[finite]
  error = np.max(np.abs(ours - theirs)) / max(np.max(np.abs(theirs)), 1.0)
  assert error <= TOL, f'{what}: {error:.2e}'


def test_every_shared_hook_name_matches(caches):
  logits, cache, tl_logits, tl_cache = caches
  _close(logits, tl_logits, 'logits')
  norms = ('hook_scale', 'hook_normalized')  # the two tests below
  shared = [n for n in cache if n in tl_cache.cache_dict and not n.endswith(norms)]
  assert len(shared) >= 13 * LAYERS  # resid 3, q/k/v/scores/pattern/z, attn_out, mlp 4
  for name in shared:
    _close(cache[name], tl_cache[name], name)


def test_hook_scale_is_the_divisor(caches):
  _, cache, _, tl_cache = caches
  for name in [n for n in cache if n.endswith('hook_scale')]:
    _close(cache[name], tl_cache[name], name)


def test_hook_normalized_is_before_the_weight_and_bias(caches):
  _, cache, _, tl_cache = caches
  for name in [n for n in cache if n.endswith('hook_normalized')]:
    _close(cache[name], tl_cache[name], name)


def test_key_shorthand_and_get_act_name(caches):
  _, cache, _, tl_cache = caches
  for key in [('pattern', 0), ('resid_pre', 2), ('q', 0, 'attn'), ('resid_post', -1), ('z', 1)]:
    _close(cache[key], tl_cache[key], str(key))
  for args in [('pattern', 0), ('k6',), ('scale4ln1',), ('scale',), ('embed',), ('pre', 2),
               ('normalized', 1, 'ln2'), ('attn', 1), ('resid_mid', 0, 'b'), ('blocks.0.hook_x',),
               ('key', 3, 'a'), ('mlp_post', 2), ('v', 0)]:  # fmt: skip
    assert get_act_name(*args) == tl_get_act_name(*args), args


def test_forward_conventions(models, tokens, caches):
  m, bridge = models
  x = torch.tensor(tokens, dtype=torch.long)
  with torch.no_grad():
    for kwargs in [{'return_type': 'loss'}, {'return_type': 'loss', 'loss_per_token': True}]:
      _close(np.asarray(m(tokens, **kwargs)), bridge(x, **kwargs), str(kwargs))
    logits, loss = m(tokens, return_type='both')
    _close(loss, bridge(x, return_type='loss'), 'both')
    assert m(tokens, return_type=None) is None
    for layer in (0, 1, -1):
      _close(m(tokens, stop_at_layer=layer), bridge(x, stop_at_layer=layer), f'stop {layer}')
  # After the last block: the stream before the final norm (HookedTransformer's; the bridge
  # runs the whole model there).
  _close(m(tokens, stop_at_layer=LAYERS), caches[1]['resid_post', -1], 'stop at the end')
  _close(m.loss_fn(logits, tokens, per_token=True), m(tokens, 'loss', True), 'loss_fn')
  with pytest.raises(ValueError, match='return_type'):
    m(tokens, return_type='probs')
  with pytest.raises(ValueError, match=r'stop_at_layer=4 must be in \[-3, 3\]'):
    m(tokens, stop_at_layer=4)
  with pytest.raises(ValueError, match='not both'):
    m.run_with_cache(tokens, names=['blocks.0.hook_resid_pre'], names_filter=lambda n: True)


def test_stop_at_layer_caches_only_what_ran(models, tokens, caches):
  m, _ = models
  _, full, _, _ = caches
  name = 'blocks.0.attn.hook_pattern'
  _, cache = m.run_with_cache(tokens[:1], names_filter=[name], stop_at_layer=1)
  assert list(cache) == [name]
  np.testing.assert_allclose(cache['pattern', 0], full[name][:1], atol=1e-6)
  _, cache = m.run_with_cache(tokens[:1], stop_at_layer=1, remove_batch_dim=True)
  ran = ('blocks.0.', 'hook_embed', 'hook_pos_embed')  # the embeddings, then block 0
  assert all(n.startswith(ran) for n in cache) and cache['resid_pre', 0].shape == (T, 84)
  with pytest.raises(ValueError, match='batch of 1'):
    full.remove_batch_dim()


def _tl_run(bridge, tokens, hook, fn, **kwargs):
  with torch.no_grad():
    return bridge.run_with_hooks(torch.tensor(tokens, dtype=torch.long), fwd_hooks=[(hook, fn)],
                                 **kwargs)  # fmt: skip


def test_interventions(models, tokens, caches):
  """Zeroing one head's values (the loss), and patching a position of the residual stream."""
  m, bridge = models
  _, cache, _, _ = caches
  name = get_act_name('v', 1)

  def ablate(v, hook):
    v[:, :, 2] = 0.0
    return v

  ours = m.run_with_hooks(tokens, {name: lambda v, _: v.at[:, :, 2].set(0.0)}, return_type='loss')
  _close(np.asarray(ours), _tl_run(bridge, tokens, name, ablate, return_type='loss'), 'ablation')
  corrupt = tokens.copy()
  corrupt[:, 5] = (corrupt[:, 5] + 1) % VOCAB
  name = get_act_name('resid_pre', 2)
  clean = cache[name]

  def patch(resid, hook):
    resid[:, 6] = torch.tensor(clean[:, 6])
    return resid

  ours = m.run_with_hooks(corrupt, {name: lambda r, _: r.at[:, 6].set(clean[:, 6])})
  _close(ours, _tl_run(bridge, corrupt, name, patch), 'patching')
  name = get_act_name('v', 0)  # a hook before the stop runs; one past it is left out
  hooks = {name: lambda v, _: v.at[:, :, 2].set(0.0), get_act_name('z', 2): lambda z, _: z * 0}
  ours = m.run_with_hooks(tokens, hooks, stop_at_layer=1)
  _close(ours, _tl_run(bridge, tokens, name, ablate, stop_at_layer=1), 'stop_at_layer')


def test_truncation_keeps_the_hooks_before_the_stop(models):
  m, _ = models
  fn = lambda x, hook: x
  pattern = lambda n: n.endswith('hook_pattern')
  hooks = [('blocks.2.hook_resid_pre', fn), ('blocks.0.hook_resid_post', fn), (pattern, fn)]
  short, last, names, kept = cache_lib.truncate(m, 1, ('blocks.1.hook_resid_pre',), hooks)
  assert (short.num_layers, last, names) == (1, 'blocks.0.hook_resid_post', ())
  assert [target for target, _ in kept[:1]] == ['blocks.0.hook_resid_post'] and len(kept) == 2
  assert kept[1][0]('blocks.0.attn.hook_pattern') and not kept[1][0]('blocks.1.attn.hook_pattern')
  short, last, _, kept = cache_lib.truncate(m, 0, (), {'blocks.0.hook_resid_pre': fn})
  assert (short.num_layers, last, kept) == (1, 'blocks.0.hook_resid_pre', {})


def test_accumulated_resid(caches):
  _, cache, _, tl_cache = caches
  for kwargs in [{}, {'incl_mid': True}, {'apply_ln': True}, {'layer': 2, 'apply_ln': True},
                 {'layer': 1, 'mlp_input': True, 'apply_ln': True, 'pos_slice': -1},
                 {'incl_mid': True, 'pos_slice': (2, 9)}]:  # fmt: skip
    ours, labels = cache.accumulated_resid(return_labels=True, **kwargs)
    theirs, tl_labels = tl_cache.accumulated_resid(return_labels=True, **kwargs)
    assert labels == tl_labels
    _close(ours, theirs, f'accumulated_resid {kwargs}')


def test_decompose_resid_and_head_results(caches):
  _, cache, _, tl_cache = caches
  for kwargs in [{'incl_embeds': False}, {'incl_embeds': False, 'apply_ln': True},
                 {'incl_embeds': False, 'mode': 'attn', 'layer': 2, 'mlp_input': True},
                 {'incl_embeds': False, 'apply_ln': True, 'pos_slice': -1}]:  # fmt: skip
    ours, labels = cache.decompose_resid(return_labels=True, **kwargs)
    theirs, tl_labels = tl_cache.decompose_resid(return_labels=True, **kwargs)
    assert labels == tl_labels
    _close(ours, theirs, f'decompose_resid {kwargs}')
  for kwargs in [{}, {'apply_ln': True}, {'layer': 2, 'incl_remainder': True},
                 {'apply_ln': True, 'pos_slice': -1}]:  # fmt: skip
    ours, labels = cache.stack_head_results(return_labels=True, **kwargs)
    theirs, tl_labels = tl_cache.stack_head_results(return_labels=True, **kwargs)
    assert labels == tl_labels
    _close(ours, theirs, f'stack_head_results {kwargs}')


def test_pattern_hooks_read_every_layer(models, tokens):
  """Cell 46 of the Main Demo: a filter on names and a hook that stores what it reads."""
  m, bridge = models
  names = [n for n in hooks_lib.hook_names(m.cfg) if n.endswith('pattern')]
  _, cache = m.run_with_cache(tokens, names_filter=lambda n: n.endswith('pattern'))
  assert list(cache) == names
  seen = {}
  _tl_run(bridge, tokens, lambda n: n.endswith('pattern'),
          lambda p, hook: seen.setdefault(hook.name, p.clone()), return_type=None)  # fmt: skip
  assert sorted(seen) == sorted(names)
  for name in names:
    _close(cache[name], seen[name], name)


def _log_softmax(x: np.ndarray) -> np.ndarray:
  x = x.astype(np.float64)
  return (
    x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1))[..., None]
  )


def test_processed_weights_keep_the_log_probs(models, folder, tokens, caches):
  """Each processing step alone and all four: the same log-probs; logits that differ from the
  unprocessed ones by one constant per position; without center_unembed, the same logits."""
  m, _ = models
  logits = caches[0]
  steps = ('fold_ln', 'center_writing_weights', 'center_unembed', 'fold_value_biases')
  for on in [*([s] for s in steps), steps]:
    processed = m.process_weights(**{s: s in on for s in steps})
    out = processed(tokens)
    np.testing.assert_allclose(_log_softmax(out), _log_softmax(logits), atol=1e-4, err_msg=on)
    shift = out - logits  # [B, T, V]
    np.testing.assert_allclose(shift - shift.mean(-1, keepdims=True), 0.0, atol=1e-4, err_msg=on)
    if 'center_unembed' not in on:
      np.testing.assert_allclose(out, logits, atol=1e-4, err_msg=on)
  resid = transformer.load(folder, process_weights=True).run_with_cache(tokens)[1]
  assert np.abs(resid['resid_mid', 1].mean(-1)).max() < 1e-5  # centred writing weights
  with pytest.raises(ValueError, match='pre-LN causal_lm'):
    m.__class__(m.cfg.replace(norm='rmsnorm'), m.params, None, None, 0, '').process_weights()


def test_processed_weights_match_transformer_lens(folder, tokens):
  """Hooks, logits and the cache helpers of both processed models (fold_ln, centring, value
  biases: TransformerLens's defaults)."""
  m, bridge = transformer.load(folder, process_weights=True), _bridge(folder)
  logits, cache = m.run_with_cache(tokens)
  with torch.no_grad():
    tl_logits, tl_cache = bridge.run_with_cache(torch.tensor(tokens, dtype=torch.long))
  _close(logits, tl_logits, 'logits')
  shared = [n for n in cache if n in tl_cache.cache_dict and not n.endswith('hook_scale')]
  assert len(shared) >= 13 * LAYERS
  for name in shared:
    _close(cache[name], tl_cache[name], name)
  for method, kwargs in [('decompose_resid', {'incl_embeds': False, 'apply_ln': True}),
                         ('stack_head_results', {'apply_ln': True, 'pos_slice': -1}),
                         ('accumulated_resid', {'apply_ln': True, 'layer': 2})]:  # fmt: skip
    ours, theirs = getattr(cache, method)(**kwargs), getattr(tl_cache, method)(**kwargs)
    _close(ours, theirs, f'{method} {kwargs}')


def test_refactored_attention_factors_match_transformer_lens(folder, tokens, caches):
  """refactor_factored_attn_matrices on top of the default processing, against the bridge's: the
  logits stay those of the processed model, W_O is a rotation per head, b_V is zero, and hook_q,
  hook_k, hook_v and hook_z (which the refactoring changes) equal TransformerLens's up to each
  singular pair's sign, which LAPACK builds choose differently; here the largest entry of each
  W_Q column (with b_Q as its last row) and each W_V column is positive. Refactoring alone keeps
  the unprocessed logits; RoPE is refused."""
  m = transformer.load(folder, process_weights=True, refactor_factored_attn_matrices=True)
  plain = transformer.load(folder, process_weights=True)
  bridge = _bridge(folder, refactor_factored_attn_matrices=True)
  logits, cache = m.run_with_cache(tokens)
  plain_logits, plain_cache = plain.run_with_cache(tokens)
  np.testing.assert_allclose(logits, plain_logits, atol=1e-4)
  with torch.no_grad():
    tl_logits, tl_cache = bridge.run_with_cache(torch.tensor(tokens, dtype=torch.long))
  _close(logits, tl_logits, 'logits')
  for layer in range(LAYERS):
    for pair in (('hook_q', 'hook_k'), ('hook_v', 'hook_z')):
      name = f'blocks.{layer}.attn.{pair[0]}'  # [B, T, N, H]: a pair's sign per head and column
      signs = np.sign(np.einsum('btnh,btnh->nh', cache[name], tl_cache[name].numpy()))
      for hook in pair:
        name = f'blocks.{layer}.attn.{hook}'
        _close(cache[name] * signs, tl_cache[name], name)
        assert np.abs(cache[name] - plain_cache[name]).max() > 1e-2, name  # it did change them
    key = f'blocks.{layer}.attn.hook_pattern'
    _close(cache[key], tl_cache[key], key)
  w_o = np.asarray(m.W_O, np.float64)  # [L, N, H, D]
  gram = w_o @ w_o.swapaxes(-1, -2)  # [L, N, H, H]
  np.testing.assert_allclose(gram, np.broadcast_to(np.eye(gram.shape[-1]), gram.shape), atol=1e-5)
  assert np.abs(np.asarray(m.b_V)).max() == 0
  w_q = np.concatenate([np.asarray(m.W_Q), np.asarray(m.b_Q)[:, :, None]], axis=2)  # [L, N, D+1, H]
  for factor in (w_q, np.asarray(m.W_V)):
    largest = np.take_along_axis(factor, np.abs(factor).argmax(2)[:, :, None], axis=2)
    assert (largest > 0).all()
  alone = transformer.load(folder, refactor_factored_attn_matrices=True)
  np.testing.assert_allclose(alone(tokens), caches[0], atol=1e-4)  # the unprocessed logits
  rope_cfg = m.cfg.replace(position='rope', num_heads=2)  # an even head size; refused before use
  rope = m.__class__(rope_cfg, m.params, None, None, 0, '')
  with pytest.raises(ValueError, match="position='rope'"):
    rope.process_weights(refactor_factored_attn_matrices=True)


_WEIGHTS = ['W_Q', 'W_K', 'W_V', 'W_O', 'b_Q', 'b_K', 'b_V', 'b_O', 'W_in', 'b_in', 'W_out',
            'b_out', 'W_E', 'W_pos', 'W_U', 'b_U']  # fmt: skip


@pytest.mark.parametrize('processed', [False, True])
def test_weights_under_transformer_lens_names(folder, processed):
  """model.W_Q, model.blocks[l].attn.W_Q, model.unembed.W_U, ... as TransformerLens's bridge has
  them, with and without weight processing."""
  m = transformer.load(folder, process_weights=processed)
  bridge = _bridge(folder) if processed else _bridge(folder, no_processing=True)
  for name in _WEIGHTS:
    _close(getattr(m, name), getattr(bridge, name), name)
  for layer in range(LAYERS):
    for name in ('W_Q', 'W_O', 'b_V'):
      _close(getattr(m.blocks[layer].attn, name), getattr(bridge.blocks[layer].attn, name), name)
    _close(m.blocks[layer].mlp.W_in, bridge.blocks[layer].mlp.W_in, 'W_in')
  _close(m.unembed.W_U, bridge.W_U, 'unembed.W_U')
  _close(m.embed.W_E, bridge.W_E, 'embed.W_E')
  _close(m.pos_embed.W_pos, bridge.W_pos, 'pos_embed.W_pos')
  assert m.W_Q.shape == (LAYERS, HEADS, 84, 84 // HEADS) and m.W_U.shape == (84, VOCAB)


def test_persistent_hooks_and_hooks_in_run_with_cache(models, tokens):
  m, _ = models
  name = 'blocks.1.attn.hook_z'
  plain = m(tokens)

  def zero(z, hook):
    return z.at[:, :, 2].set(0.0)

  hooked = m.run_with_hooks(tokens, fwd_hooks=[(name, zero)])
  assert not np.allclose(hooked, plain, atol=1e-4)  # the head matters
  m.add_hook(name, zero)
  np.testing.assert_allclose(m(tokens), hooked, atol=1e-6)  # on every later forward...
  _, cache = m.run_with_cache(tokens, names=[name])
  assert np.all(cache[name][:, :, 2] == 0)
  m.run_with_hooks(tokens)
  np.testing.assert_allclose(m(tokens), hooked, atol=1e-6)  # ...until reset_hooks, as TL's bridge
  m.reset_hooks()
  np.testing.assert_allclose(m(tokens), plain, atol=1e-6)
  m.add_hook(name, zero, is_permanent=True)
  m.reset_hooks()
  np.testing.assert_allclose(m(tokens), hooked, atol=1e-6)  # a permanent one stays
  m.reset_hooks(including_permanent=True)
  np.testing.assert_allclose(m(tokens), plain, atol=1e-6)
  with m.hooks(fwd_hooks=[(name, zero)]):
    np.testing.assert_allclose(m(tokens), hooked, atol=1e-6)
  np.testing.assert_allclose(m(tokens), plain, atol=1e-6)
  m.blocks[1].attn.hook_z.add_hook(zero)  # TransformerLens's hook point handle
  np.testing.assert_allclose(m(tokens), hooked, atol=1e-6)
  m.reset_hooks()
  with pytest.raises(ValueError, match='hook_nothing'):
    m.blocks[0].hook_nothing.add_hook(zero)
  logits, cache = m.run_with_cache(tokens, names=[name], fwd_hooks=[(name, zero)])
  np.testing.assert_allclose(logits, hooked, atol=1e-6)
  assert np.all(cache[name][:, :, 2] == 0)  # the cache holds what the hook returned


@pytest.mark.parametrize(
  'hook, says',
  [
    (lambda z, hook: z.clone(), 'no attribute clone'),
    (lambda z, hook: z.unsqueeze(0)[0], 'no attribute unsqueeze'),
    (lambda z, hook: z.__setitem__((0, 0), 1.0), 'immutable'),
    (lambda z, hook: np.zeros(3).__setitem__(0, z[0, 0, 0, 0]), 'array element'),
  ],
)
def test_a_torch_idiom_in_a_hook_is_one_error_with_the_jax_way(models, tokens, hook, says):
  m, _ = models
  with pytest.raises(ValueError, match=r'the hook on blocks\.0\.attn\.hook_z failed') as e:
    m.run_with_hooks(tokens, fwd_hooks=[('blocks.0.attn.hook_z', hook)])
  assert (
    says in str(e.value)
    and '.at[idx].set(v)' in str(e.value)
    and 'jax.debug.callback' in str(e.value)
  )


def test_utils_and_to_string(models, tokens, capsys):
  from transformer.inference import utils

  m, _ = models
  assert utils.get_act_name('in', 0) == 'blocks.0.hook_resid_pre'  # the bridge's hook_in alias
  assert utils.get_act_name('in', 0, 'mlp') == tl_get_act_name('in', 0, 'mlp')
  np.testing.assert_array_equal(utils.get_corner(np.arange(60).reshape(3, 4, 5), 2),
                                [[[0, 1], [5, 6]], [[20, 21], [25, 26]]])  # fmt: skip
  assert utils.to_numpy(torch.ones(2)).tolist() == [1.0, 1.0]
  scores = torch.zeros(2, device=utils.get_device())  # a port's own torch tensors: on the host
  scores[0] = m(tokens)[0, -1].max().item()
  assert scores[0].item() == pytest.approx(float(m(tokens)[0, -1].max()))
  with pytest.raises(ValueError, match='no tokenizer'):
    m.to_string(tokens[0])
  m.set_use_attn_result(True)  # hook_result is there whenever asked for
  _, cache = m.run_with_cache(tokens, names=['blocks.0.attn.hook_result'])
  assert cache['blocks.0.attn.hook_result'].shape == (3, T, HEADS, 84)
