"""Interventions (research.interventions): patching against the same patching done
with PyTorch forward hooks, attribution patching against finite differences, ablations, direct
logit attribution that sums to the logit difference, and the head detectors on known patterns."""

import importlib.util
import sys

import pytest

if sys.version_info >= (3, 12) and importlib.util.find_spec('torch') is None:
  pytest.skip(
    'needs torch (not installed on this Python: the CPU wheel here is for Python 3.11)',
    allow_module_level=True,
  )

import jax.numpy as jnp
import numpy as np
import torch
import torch_models
from torch_models import VOCAB

from research import interventions as iv
from transformer.model import hooks


@pytest.fixture(scope='module')
def hf_pair(tmp_path_factory):
  return torch_models.build_both(tmp_path_factory.mktemp('interventions_hf'))


def _prompts(seed, T=8):
  """A clean and a corrupted batch of 2 rows that differ in two positions."""
  rng = np.random.default_rng(seed)
  clean = rng.integers(1, VOCAB, (2, T)).astype(np.int32)
  corrupted = clean.copy()
  corrupted[:, 2] = (clean[:, 2] + 7) % (VOCAB - 1) + 1
  corrupted[:, 5] = (clean[:, 5] + 11) % (VOCAB - 1) + 1
  return {'inputs': jnp.asarray(clean)}, {'inputs': jnp.asarray(corrupted)}


def _torch_metric(model, ids, good, bad):
  with torch.no_grad():
    logits = model(torch.tensor(ids)).logits.numpy()
  return float(np.mean(logits[:, -1, good] - logits[:, -1, bad]))


@pytest.mark.parametrize('name', ['gpt2', 'llama'])
def test_patching_heatmaps_equal_the_same_patching_with_pytorch_hooks(hf_pair, name):
  model, cfg, params = hf_pair[name]
  clean, corrupted = _prompts(0)
  good, bad = 5, 9
  metric = iv.logit_diff(-1, good, bad)
  resid = iv.patching(cfg, params, clean, corrupted, metric, 'resid_pre')
  heads = iv.patching(cfg, params, clean, corrupted, metric, 'z')
  assert resid.shape == (cfg.num_layers, 8) and heads.shape == (cfg.num_layers, cfg.num_heads)
  blocks = torch_models.blocks(model)
  clean_ids, corr_ids = np.asarray(clean['inputs']), np.asarray(corrupted['inputs'])
  # PyTorch: the clean run's block inputs and head outputs, then one patched corrupted run each.
  saved = {}

  def keep(kind, layer):
    def hook(mod, args, kwargs):
      x = args[0] if args else kwargs['hidden_states']
      saved[kind, layer] = x.detach().clone()

    return hook

  def patch(x_new):
    def hook(mod, args, kwargs):
      if args:
        return (x_new, *args[1:]), kwargs
      return args, {**kwargs, 'hidden_states': x_new}

    return hook

  handles = []
  for layer, block in enumerate(blocks):
    handles.append(block.register_forward_pre_hook(keep('resid', layer), with_kwargs=True))
    proj = torch_models.out_proj(model, layer)
    handles.append(proj.register_forward_pre_hook(keep('z', layer), with_kwargs=True))
  with torch.no_grad():
    model(torch.tensor(clean_ids))
  for h in handles:
    h.remove()
  handles = [
    b.register_forward_pre_hook(keep('corr', i), with_kwargs=True) for i, b in enumerate(blocks)
  ]
  with torch.no_grad():
    model(torch.tensor(corr_ids))
  for h in handles:
    h.remove()
  H = cfg.head_size
  for layer, block in enumerate(blocks):
    for pos in range(8):
      x = saved['corr', layer].clone()
      x[:, pos] = saved['resid', layer][:, pos]
      h = block.register_forward_pre_hook(patch(x), with_kwargs=True)
      want = _torch_metric(model, corr_ids, good, bad)
      h.remove()
      assert resid[layer, pos] == pytest.approx(want, rel=1e-3, abs=1e-3), (layer, pos)
    proj = torch_models.out_proj(model, layer)
    for head in range(cfg.num_heads):
      source = saved['z', layer][..., head * H : (head + 1) * H]

      def swap(mod, args, source=source, head=head):
        z = args[0].clone()
        z[..., head * H : (head + 1) * H] = source
        return (z,)

      h = proj.register_forward_pre_hook(swap)
      want = _torch_metric(model, corr_ids, good, bad)
      h.remove()
      assert heads[layer, head] == pytest.approx(want, rel=1e-3, abs=1e-3), (layer, head)
  # Patching the first layer's input at every position restores the clean metric at the last.
  clean_metric = _torch_metric(model, clean_ids, good, bad)
  assert resid[0, -1] != pytest.approx(clean_metric)  # position 7 alone is not the difference
  assert np.ptp(resid) > 1e-3


@pytest.mark.parametrize('activation', ['resid_pre', 'mlp_out', 'z'])
def test_attribution_patching_is_the_derivative_of_patching(hf_pair, activation):
  """(metric(corrupted + eps * (clean - corrupted) at one site) - metric(corrupted)) / eps
  approaches attribution - metric(corrupted) at that site."""
  _, cfg, params = hf_pair['gpt2']
  clean, corrupted = _prompts(1)
  metric = iv.logit_diff(-1, 3, 4)
  approx = iv.attribution_patching(cfg, params, clean, corrupted, metric, activation)
  base = float(metric(hooks.run(cfg, params, corrupted)[0]))
  name = lambda layer: f'blocks.{layer}.{iv.PATCHABLE[activation]}'
  names = [name(layer) for layer in range(cfg.num_layers)]
  clean_acts = hooks.run(cfg, params, clean, names=names)[1]
  corr_acts = hooks.run(cfg, params, corrupted, names=names)[1]
  eps = 1e-2
  for layer, index in [(0, 2), (1, 5 % (3 if activation == 'z' else 8)), (cfg.num_layers - 1, 1)]:
    n = name(layer)
    delta = clean_acts[n] - corr_acts[n]
    keep = np.zeros(delta.shape, np.float32)
    if activation == 'z':
      keep[:, :, index] = 1
    else:
      keep[:, index] = 1
    step = {n: lambda x, _, d=delta * keep: x + eps * d}
    moved = float(metric(hooks.run(cfg, params, corrupted, hooks=step)[0]))
    slope = (moved - base) / eps
    assert approx[layer, index] - base == pytest.approx(slope, rel=0.05, abs=2e-3)
  assert approx.shape[0] == cfg.num_layers


def test_direct_logit_attribution_sums_to_the_logit_difference(hf_pair):
  for name in ('gpt2', 'llama'):
    _, cfg, params = hf_pair[name]
    inputs = _prompts(2)[0]
    parts = iv.direct_logit_attribution(cfg, params, inputs, position=-1, good=7, bad=11)
    total = parts.pop('total')
    heads = [k for k in parts if '.head_' in k]
    assert len(heads) == cfg.num_layers * cfg.num_heads and 'embed' in parts
    np.testing.assert_allclose(sum(parts.values()), total, rtol=1e-4, atol=1e-4)
    assert max(abs(v).max() for v in parts.values()) > 1e-3


def test_mean_and_resample_ablation_over_the_same_single_row_change_nothing(hf_pair):
  _, cfg, params = hf_pair['llama']
  inputs = {'inputs': _prompts(3)[0]['inputs'][:1]}
  base = hooks.run(cfg, params, inputs)[0]
  heads = [(0, 1), (1, 4), (1, 5)]
  for mode in ('mean', 'resample'):
    got = iv.ablate_heads(cfg, params, inputs, heads, mode=mode, reference=inputs)
    np.testing.assert_allclose(got, base, rtol=1e-5, atol=1e-5)
  other = {'inputs': _prompts(4)[0]['inputs']}
  assert np.abs(iv.ablate_heads(cfg, params, inputs, heads, 'mean', other) - base).max() > 1e-3
  with pytest.raises(ValueError, match=r'head \(layer=2, head=0\) does not exist'):
    iv.ablate_heads(cfg, params, inputs, [(2, 0)])
  with pytest.raises(ValueError, match="mode='mean' needs a reference batch"):
    iv.ablate_heads(cfg, params, inputs, heads, mode='mean')
  with pytest.raises(ValueError, match="mode='half' is not valid"):
    iv.ablate_heads(cfg, params, inputs, heads, mode='half')


def test_detectors_score_textbook_patterns_and_the_induction_loss_is_measured(hf_pair):
  n, T = 5, 11
  eye = lambda offset: np.stack([np.eye(T, k=-offset)])  # query i -> key i - offset
  for offset, kind in ((1, 'previous_token'), (n, 'duplicate_token'), (n - 1, 'induction')):
    patterns = np.stack([eye(offset), eye(0)], axis=1)  # [1, 2 heads, T, T]
    scores = iv.detector_scores(patterns, n)
    assert scores[kind][0] == pytest.approx(1.0) and scores[kind][1] == 0.0
    assert all(scores[k][0] == 0.0 for k in scores if k != kind)
  tokens = iv.repeated_tokens(50, n, 3, seed=0)
  assert tokens.shape == (3, T) and (tokens[:, 1 : 1 + n] == tokens[:, 1 + n :]).all()
  _, cfg, params = hf_pair['gpt2']
  out = iv.head_detectors(cfg, params, length=6, batch=2)
  assert out['induction'].shape == (cfg.num_layers, cfg.num_heads)
  assert np.isfinite(out['induction_loss']) and out['induction_loss'] > 0


@pytest.mark.parametrize('prefix', [[VOCAB - 1], []])
def test_head_detectors_start_each_row_with_the_models_own_prefix(hf_pair, prefix):
  # An imported GPT-2's bos is its own id, not sparrow's 1; a model without one gets none.
  _, cfg, params = hf_pair['gpt2']
  n = 6
  tokens = iv.repeated_tokens(cfg.vocab_size, n, 2, seed=0, prefix=prefix)
  P = len(prefix)
  assert tokens.shape == (2, P + 2 * n) and (tokens[:, :P] == prefix).all()
  assert (tokens[:, P : P + n] == tokens[:, P + n :]).all()
  out = iv.head_detectors(cfg, params, length=n, batch=2, prefix=prefix)
  # Independently: the scores read off each head's pattern, and the losses off the logits.
  names = [f'blocks.{layer}.attn.hook_pattern' for layer in range(cfg.num_layers)]
  logits, cache = hooks.run(cfg, params, {'inputs': jnp.asarray(tokens)}, names=names)
  second = np.arange(P + n, P + 2 * n)  # the second copy's positions
  for layer, name in enumerate(names):
    p = np.asarray(cache[name], np.float64)
    induction = p[:, :, second, second - n + 1].mean((0, 2))  # to the token after the first
    np.testing.assert_allclose(out['induction'][layer], induction, rtol=1e-6)
  logp = np.asarray(torch.log_softmax(torch.tensor(np.asarray(logits, np.float64)), -1))
  picked = lambda positions: (
    -np.mean([logp[b, t - 1, tokens[b, t]] for b in range(2) for t in positions])
  )
  np.testing.assert_allclose(out['induction_loss'], picked(second), rtol=1e-5)
  np.testing.assert_allclose(out['first_copy_loss'], picked(range(P + 1, P + n)), rtol=1e-5)


def test_logit_diff_and_attribution_take_one_target_pair_per_row(hf_pair):
  """IOI-style batches: each row compares its own two names."""
  _, cfg, params = hf_pair['gpt2']
  inputs = _prompts(5)[0]
  good, bad = np.array([7, 3]), np.array([11, 9])
  logits = np.asarray(hooks.run(cfg, params, inputs)[0], np.float64)
  rows = [logits[0, -1, 7] - logits[0, -1, 11], logits[1, -1, 3] - logits[1, -1, 9]]
  got = float(iv.logit_diff(-1, good, bad)(jnp.asarray(logits)))
  assert got == pytest.approx(np.mean(rows), rel=1e-5)
  parts = iv.direct_logit_attribution(cfg, params, inputs, -1, good, bad)
  np.testing.assert_allclose(parts['total'], rows, rtol=1e-4, atol=1e-4)
  for row in range(2):  # the same as attributing each row alone with its own pair
    alone = iv.direct_logit_attribution(
      cfg, params, {'inputs': inputs['inputs'][row : row + 1]}, -1, int(good[row]), int(bad[row])
    )
    for name, value in alone.items():
      assert parts[name][row] == pytest.approx(value[0], rel=1e-4, abs=1e-5), name


def test_head_ablation_effects_equal_ablating_each_head_alone(hf_pair):
  _, cfg, params = hf_pair['llama']
  inputs, reference = _prompts(6)
  metric = iv.logit_diff(-1, 3, 8)
  base = float(metric(hooks.run(cfg, params, inputs)[0]))
  rng = np.random.default_rng(0)
  for mode in ('zero', 'mean', 'resample'):
    got = iv.head_ablation_effects(cfg, params, inputs, metric, mode, reference, seed=2)
    assert got.shape == (cfg.num_layers, cfg.num_heads)
    # Every head of the last layer, and two random ones of the others, ablated alone.
    last = [(cfg.num_layers - 1, h) for h in range(cfg.num_heads)]
    picks = last + [(int(rng.integers(cfg.num_layers - 1)), int(rng.integers(cfg.num_heads)))
                    for _ in range(2)]  # fmt: skip
    for layer, head in picks:
      one = iv.ablate_heads(cfg, params, inputs, [(layer, head)], mode, reference, seed=2)
      want = float(metric(one)) - base
      assert got[layer, head] == pytest.approx(want, abs=2e-4), (mode, layer, head)
    assert np.abs(got).max() > 1e-3
  with pytest.raises(ValueError, match='the reference batch has rows of 5 tokens and the input 8'):
    iv.head_ablation_effects(
      cfg, params, inputs, metric, 'mean', {'inputs': reference['inputs'][:, :5]}
    )
