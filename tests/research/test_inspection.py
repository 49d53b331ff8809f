"""Inspection: attention maps against NumPy, every implementation through the xla path, head
entropy bounds, init statistics against the init scheme, and the plots."""

import importlib.util
import math
import os
import sys

import jax
import numpy as np
import pytest

from research import inspection
from transformer.config import ModelConfig
from transformer.model import hooks, models, scan
from transformer.training import loop


def _model(family='causal_lm', **changes):
  cfg = ModelConfig(
    family=family, vocab_size=40, d_model=32, num_heads=4, d_ff=64, num_layers=2, max_length=32,
    dropout_rate=0.0, **changes,
  )  # fmt: skip
  params = models.init_params(models.build(cfg), jax.random.PRNGKey(0))
  return cfg, params


_TOKENS = np.array([[5, 6, 7, 8, 9, 10, 0, 0], [11, 12, 13, 14, 15, 16, 17, 18]], np.int32)
_PATTERNS = lambda n: n.endswith('hook_pattern')


def _softmax(x):
  x = x - x.max(-1, keepdims=True)
  e = np.exp(x)
  return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize('placement', ['pre', 'post'])
def test_attention_maps_match_numpy_from_the_projections(placement):
  cfg, params = _model(norm_placement=placement)
  # The attention's input: the normalised residual stream (pre-LN) or the stream itself (post-LN).
  source = 'blocks.1.ln1.hook_out' if placement == 'pre' else 'blocks.1.hook_resid_pre'
  picked = [source, 'blocks.1.attn.hook_pattern', 'blocks.1.attn.hook_attn_scores']
  _, cache = hooks.run_xla(cfg, params, {'inputs': _TOKENS}, picked)
  probs = cache['blocks.1.attn.hook_pattern']  # [B, N, T, S]
  assert probs.shape == (2, 4, 8, 8)
  x = cache[source].astype(np.float64)  # [B, T, D]
  p = params['decoder']['stack']['layer_1']['self_attention']
  q = np.einsum('btd,dnh->btnh', x, p['query']['kernel']) + p['query']['bias']
  k = np.einsum('btd,dnh->btnh', x, p['key']['kernel']) + p['key']['bias']
  logits = np.einsum('btnh,bsnh->bnts', q, k) / math.sqrt(q.shape[-1])
  real = _TOKENS != 0  # [B, T]
  visible = np.tril(np.ones((8, 8), bool))[None] & real[:, None, :] & real[:, :, None]
  # The keys each query may see are those whose score is not -inf (what head entropy counts).
  seen = cache['blocks.1.attn.hook_attn_scores'] != -np.inf
  np.testing.assert_array_equal(seen, np.broadcast_to(visible[:, None], seen.shape))
  expected = _softmax(np.where(visible[:, None], logits, -1e30))
  expected = np.where(real[:, None, :, None], expected, 0.0)  # padding queries see nothing
  np.testing.assert_allclose(probs, expected, atol=1e-5)
  sums = probs.sum(-1)  # rows of real queries sum to 1, padding rows to 0
  np.testing.assert_allclose(sums, np.broadcast_to(real[:, None, :], sums.shape), atol=1e-5)


@pytest.mark.parametrize(
  'family',
  ['causal_lm', 'bidirectional_lm', pytest.param('encoder_decoder', marks=pytest.mark.slow)],
)
def test_maps_of_a_chunked_model_are_the_xla_maps_on_the_same_parameters(family):
  cfg, params = _model(family, attention_impl='chunked', attention_chunk_size=4)
  inputs = {'inputs': _TOKENS}
  if family == 'encoder_decoder':
    inputs['decoder_inputs'] = _TOKENS[:, :6]
  chunked_logits, chunked = hooks.run_xla(cfg, params, inputs, _PATTERNS)
  _, xla = hooks.run_xla(cfg.replace(attention_impl='xla'), params, inputs, _PATTERNS)
  assert chunked.keys() == xla.keys() and chunked
  for name in xla:
    np.testing.assert_array_equal(chunked[name], xla[name])
  # The inspection pass computes what the chunked model computes.
  logits = models.build(cfg).apply({'params': params}, **inputs, deterministic=True)
  np.testing.assert_allclose(chunked_logits, np.asarray(logits), atol=2e-5)
  if family == 'encoder_decoder':
    assert chunked['decoder.blocks.0.cross_attn.hook_pattern'].shape == (2, 4, 6, 8)


def test_scanned_and_rematerialised_models_give_the_same_maps():
  cfg, params = _model(scan_layers=False)
  scanned_cfg = cfg.replace(scan_layers=True, remat='full')
  scanned = models.init_params(models.build(scanned_cfg), jax.random.PRNGKey(0))
  unscanned = scan.unscan_params(scanned_cfg, scanned)
  assert jax.tree_util.tree_structure(unscanned) == jax.tree_util.tree_structure(params)
  _, a = hooks.run_xla(scanned_cfg, scanned, {'inputs': _TOKENS}, _PATTERNS)
  _, b = hooks.run_xla(cfg, unscanned, {'inputs': _TOKENS}, _PATTERNS)
  assert list(b) == ['blocks.0.attn.hook_pattern', 'blocks.1.attn.hook_pattern']
  for name in b:
    np.testing.assert_array_equal(a[name], b[name])


def test_head_entropy_bounds():
  cfg, params = _model()
  _, cache = hooks.run_xla(cfg, params, {'inputs': _TOKENS}, hooks.patterns_and_scores)
  entropies = hooks.attention_entropy(cache)
  assert list(entropies) == ['blocks.0.attn', 'blocks.1.attn']
  for name, stats in entropies.items():
    S = cache[f'{name}.hook_pattern'].shape[-1]
    assert np.all(stats['entropy'] >= 0) and np.all(stats['max'] <= math.log(S) + 1e-6)
    assert np.all((stats['normalized'] >= 0) & (stats['normalized'] <= 1 + 1e-6))
  uniform = np.full((1, 1, 4, 8), 1 / 8)
  sharp = np.zeros((1, 1, 4, 8))
  sharp[..., 3] = 1.0
  assert hooks.head_entropy(uniform)['entropy'][0] == pytest.approx(math.log(8))
  assert hooks.head_entropy(uniform)['normalized'][0] == pytest.approx(1.0)
  assert hooks.head_entropy(sharp)['entropy'][0] == pytest.approx(0.0)
  # Causal rows see 1..S keys: each is normalised by its own log(keys); the one-key row is left out.
  causal = np.tril(np.ones((8, 8)))
  causal = (causal / causal.sum(-1, keepdims=True))[None, None]
  visible = np.tril(np.ones((8, 8), bool))[None, None]
  assert hooks.head_entropy(causal, visible)['normalized'][0] == pytest.approx(1.0)


@pytest.mark.parametrize(
  'changes',
  [
    {},
    {'init': 'plain'},
    {'init': 'large'},
    {'init_distribution': 'normal', 'init_std': 0.05},
    {'family': 'encoder_decoder'},
  ],
)
def test_initial_weights_have_the_intended_std(changes):
  cfg = ModelConfig(**{
    'family': 'causal_lm', 'vocab_size': 500, 'd_model': 128, 'num_heads': 4, 'd_ff': 512,
    'num_layers': 4, 'position': 'learned', 'max_length': 256, **changes,
  })  # fmt: skip
  rows = inspection.init_statistics(cfg, seed=1)
  checked = 0
  for r in rows:
    if r['intended_std'] is None:
      continue
    if r['intended_std'] == 0:
      assert r['std'] == 0 and r['mean'] == r['intended_mean']
      continue
    assert r['std'] == pytest.approx(r['intended_std'], rel=0.05), r['name']
    assert abs(r['mean']) < 4 * r['intended_std'] / math.sqrt(math.prod(r['shape'])) + 1e-3
    checked += 1
  assert checked >= 10
  out = next(r for r in rows if r['name'].endswith('layer_0/self_attention/out/kernel'))
  wi = next(r for r in rows if r['name'].endswith('layer_0/mlp/wi/kernel'))
  if cfg.init_distribution == 'xavier':
    factor = {'plain': 1.0, 'scaled': 1 / math.sqrt(2 * 4), 'large': math.sqrt(2 * 4)}[cfg.init]
    assert out['intended_std'] == pytest.approx(math.sqrt(2 / (128 + 128)) * factor)
    assert wi['intended_std'] == pytest.approx(math.sqrt(2 / (128 + 512)))


def test_activation_statistics_and_head_entropy_logging():
  cfg, params = _model()
  _, cache = hooks.run_xla(cfg, params, {'inputs': _TOKENS}, lambda n: 'resid' in n)
  rows = inspection.activation_statistics(cache)
  assert [r['name'] for r in rows] == ['blocks.0.hook_resid_post', 'blocks.1.hook_resid_post']
  assert all(r['std'] > 0 and r['max_abs'] >= r['rms'] for r in rows)

  class Writer:
    def __init__(self):
      self.scalars = {}

    def scalar(self, tag, value, step):
      self.scalars[tag] = (value, step)

  writer = Writer()
  loop.log_head_entropy(writer, cfg, params, {'inputs': _TOKENS, 'segments': None}, step=7)
  tag = 'head_entropy/blocks.0.attn/head_3'
  assert tag in writer.scalars and writer.scalars[tag][1] == 7
  assert len(writer.scalars) == 2 * (4 + 1)  # 2 layers x (4 heads + their mean)


def test_plots_are_written(tmp_path):
  cfg, params = _model()
  _, maps = hooks.run_xla(cfg, params, {'inputs': _TOKENS}, _PATTERNS)
  paths = [
    inspection.plot_attention(
      maps['blocks.0.attn.hook_pattern'][0], str(tmp_path / 'a.png'),
                           query_labels=list('abcdefgh'), key_labels=list('abcdefgh')),
    inspection.plot_sinusoidal(32, str(tmp_path / 'sin.png')),
    inspection.plot_rope(16, str(tmp_path / 'rope.png')),
    inspection.plot_head_entropy({'layer': np.array([0.1, 0.9])}, str(tmp_path / 'h.png')),
    inspection.plot_init_statistics(inspection.init_statistics(cfg), str(tmp_path / 'init.png')),
  ]  # fmt: skip
  for path in paths:
    assert os.path.getsize(path) > 1000


# Dissecting an imported model ------------------------------------------------------------------
def test_outlier_dimensions_finds_planted_channels():
  from research.dissect import outlier_dimensions

  x = np.random.default_rng(0).normal(size=(2, 9, 40))
  x[1, 3, 17], x[0, 5, 4] = 80.0, -50.0
  assert outlier_dimensions(x) == [(17, 80.0), (4, 50.0)]
  assert outlier_dimensions(np.ones((3, 8))) == []


@pytest.mark.skipif(
  sys.version_info >= (3, 12) and importlib.util.find_spec('torch') is None,
  reason='needs torch (not installed on this Python: the CPU wheel here is for Python 3.11)',
)
def test_inspect_a_hugging_face_folder(tmp_path):
  """experiments.inspect on an HF Llama folder: maps, entropy, histograms, the logit lens."""
  import os
  import subprocess
  import sys

  os.environ['HF_HUB_OFFLINE'] = '1'
  import tokenizers
  import torch
  import transformers

  from research import dissect
  from transformer.inference.api import load

  config = transformers.LlamaConfig(
    vocab_size=45, hidden_size=24, num_attention_heads=3, num_key_value_heads=1, head_dim=6,
    intermediate_size=20, num_hidden_layers=2, max_position_embeddings=32,
    initializer_range=0.3, tie_word_embeddings=False,
  )  # fmt: skip
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(config).eval()
  with torch.no_grad():
    model.model.norm.weight.uniform_(0.5, 2.0)  # away from 1: the lens must apply it once
  folder = str(tmp_path / 'llama')
  model.save_pretrained(folder, safe_serialization=True)
  words = {f'w{i}': i for i in range(45)}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token='w0'))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.save(os.path.join(folder, 'tokenizer.json'))
  out = tmp_path / 'report'
  cmd = [sys.executable, '-m', 'experiments.inspect', f'--workdir={folder}', f'--out={out}']
  corrupt = ['--text=w3 w9 w1 w4', '--corrupt=w3 w9 w2 w4']
  result = subprocess.run(cmd + corrupt, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  report = (out / 'inspect.md').read_text()
  assert '[patching.md](patching.md)' in report
  patching = (out / 'patching.md').read_text()
  for section in ('Patching `resid_pre`', 'Patching `z` by layer and head', 'Zero-ablating each',
                  '## Direct logit attribution', 'Induction loss', '| 1 |'):  # fmt: skip
    assert section in patching
  assert {'patch_resid_pre.png', 'patch_z.png', 'ablation.png', 'dla.png'} <= set(os.listdir(out))
  bad = subprocess.run(cmd + ['--text=w3 w9', '--corrupt=w3 w9 w2'], capture_output=True,
                       text=True, timeout=300)  # fmt: skip
  assert bad.returncode != 0
  assert bad.stderr.strip().splitlines()[-1].startswith('error: --corrupt must give as many tokens')
  for section in ('## Attention maps', '## Activations', 'outlier dims', '## Logit lens'):
    assert section in report
  names = set(os.listdir(out))
  assert {'entropy.png', 'activations.png'} <= names
  assert {f'blocks_{i}_attn.png' for i in range(2)} <= names
  # The lens of the last layer is the model's own prediction.
  m = load(folder)
  ids = [3, 9, 1, 4]
  resid_post = lambda n: n.endswith('hook_resid_post')
  _, blocks = hooks.run_xla(m.cfg, m.params, {'inputs': np.array([ids])}, resid_post)
  lens = dissect.logit_lens(m.cfg, m.params, [x[0] for x in blocks.values()])
  with torch.no_grad():
    want = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()
  np.testing.assert_allclose(lens[-1], want, atol=1e-4)
  assert report.count('.hook_resid_post |') == 4  # two activation rows, two lens rows
