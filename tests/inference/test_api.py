"""transformer.load and Model: reload a workdir in one call and use it; the explore notebook."""

import os
import re

import numpy as np
import pytest
from decode_reference import greedy_uncached_continue, greedy_uncached_translate

import transformer
from transformer import data
from transformer.training import provenance
from transformer.training.loop import train_and_evaluate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope='module')
def gpt(tmp_path_factory, untrained_workdir):
  return transformer.load(untrained_workdir(tmp_path_factory.mktemp('gpt'), 'causal_lm'))


@pytest.fixture(scope='module')
def translator(tmp_path_factory, untrained_workdir):
  return transformer.load(untrained_workdir(tmp_path_factory.mktemp('ed'), 'encoder_decoder'))


@pytest.fixture(scope='module')
def bert(tmp_path_factory, untrained_workdir):
  return transformer.load(untrained_workdir(tmp_path_factory.mktemp('bert'), 'bidirectional_lm'))


def test_generate_matches_uncached_greedy_decoding(gpt):
  prompts = ['the cat', 'a much longer prompt']
  out = gpt.generate(prompts, max_new_tokens=6)
  ids = [[data.BOS_ID] + gpt.tokenizer.encode(p) for p in prompts]
  padded = np.zeros((2, max(map(len, ids))), np.int32)
  for i, row in enumerate(ids):
    padded[i, : len(row)] = row
  reference = greedy_uncached_continue(gpt.module, gpt.params, padded, 6)
  assert out == [gpt.tokenizer.decode(r.tolist()) for r in np.asarray(reference)]
  assert 'Model(causal_lm' in repr(gpt)


def test_sampling_is_reproducible_from_its_seed(gpt):
  a = gpt.generate(['x'] * 4, max_new_tokens=8, temperature=1.0, top_k=40, seed=1)
  b = gpt.generate(['x'] * 4, max_new_tokens=8, temperature=1.0, top_k=40, seed=1)
  c = gpt.generate(['x'] * 4, max_new_tokens=8, temperature=1.0, top_k=40, seed=2)
  assert a == b and a != c


def test_score_is_the_log_softmax_of_the_logits(gpt):
  (result,) = gpt.score(['hello'])
  ids = gpt.tokenizer.encode('hello')
  logits = np.asarray(gpt.logits(np.asarray([[data.BOS_ID] + ids])), np.float64)[0]
  shifted = logits - logits.max(-1, keepdims=True)
  logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  expected = [logp[i, t] for i, t in enumerate(ids + [data.EOS_ID])]
  np.testing.assert_allclose(result['log_probs'], expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(result['perplexity'], np.exp(-np.mean(expected)), rtol=1e-5)
  assert len(result['tokens']) == len(ids) + 1


def test_logits_with_a_padding_mask_equal_the_unpadded_rows(gpt):
  rng = np.random.default_rng(0)
  tokens = rng.integers(5, 200, size=(2, 9)).astype(np.int32)
  mask = np.ones_like(tokens)
  mask[1, 5:] = 0
  padded = np.where(mask, tokens, 0)
  full = gpt.logits(padded, mask=mask)
  alone = gpt.logits(tokens[1:, :5])
  np.testing.assert_allclose(full[1, :5], alone[0], rtol=1e-5, atol=1e-5)
  assert full.shape == (2, 9, gpt.cfg.vocab_size) and full.dtype == np.float32


def test_translate_with_beam_1_is_greedy(translator):
  sources = ['12', '40567']
  beam1 = translator.translate(sources, beam_size=1, max_length=8)
  ids = [translator.tokenizer.encode(s) + [data.EOS_ID] for s in sources]
  padded = np.zeros((2, max(map(len, ids))), np.int32)
  for i, row in enumerate(ids):
    padded[i, : len(row)] = row
  reference = greedy_uncached_translate(translator.module, translator.params, padded, 8)
  assert beam1 == [translator.tokenizer.decode(r.tolist()) for r in np.asarray(reference)]
  assert len(translator.translate(sources, beam_size=4, max_length=8)) == 2


def test_fill_mask_takes_the_most_likely_token(bert):
  (result,) = bert.fill_mask(['ab[MASK]d'], top_k=3)
  ids = [data.BOS_ID, *bert.tokenizer.encode('ab'), data.MASK_ID, *bert.tokenizer.encode('d')]
  logits = bert.logits(np.asarray([ids + [data.EOS_ID]]))[0, len(ids) - 2]
  probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
  (candidates,) = result['candidates']
  assert [p for _, p in candidates] == pytest.approx(sorted(probs)[::-1][:3], rel=1e-5)
  assert result['text'] == 'ab' + candidates[0][0] + 'd'


def test_wrong_family_and_bad_arrays_are_clear_errors(gpt, bert):
  with pytest.raises(
    ValueError, match="translate needs a encoder_decoder model; this one is 'causal_lm'"
  ):
    gpt.translate(['x'])
  with pytest.raises(ValueError, match='fill_mask needs'):
    bert.fill_mask(['no mask here'])
  with pytest.raises(ValueError, match=r'token ids must be in \[0, '):
    gpt.logits(np.asarray([[1, 99999]]))
  with pytest.raises(ValueError, match='integer token ids of shape'):
    gpt.logits(np.asarray([1.5, 2.0]))
  with pytest.raises(ValueError, match='mask shape'):
    gpt.logits(np.asarray([[1, 2]]), mask=np.ones((1, 3)))


def test_load_errors_name_the_workdir(tmp_path, tiny_config):
  with pytest.raises(FileNotFoundError, match='no workdir'):
    transformer.load(str(tmp_path / 'missing'))
  with pytest.raises(FileNotFoundError, match='no config.json'):
    transformer.load(str(tmp_path))
  config = tiny_config('causal_lm')
  provenance.write_run_metadata(str(tmp_path), config)
  with pytest.raises(FileNotFoundError, match='no checkpoint'):
    transformer.load(str(tmp_path))


def test_explore_notebook_runs_top_to_bottom(tmp_path, tiny_config):
  """Trains a tiny GPT, then executes experiments/notebooks/explore.ipynb on it."""
  import nbclient
  import nbformat

  workdir = str(tmp_path / 'gpt')
  train_and_evaluate(tiny_config('causal_lm', steps=2, eval_every=2), workdir)
  notebook = nbformat.read(os.path.join(ROOT, 'experiments', 'notebooks', 'explore.ipynb'), 4)
  os.environ['SPARROW_WORKDIR'] = workdir
  try:
    client = nbclient.NotebookClient(
      notebook, timeout=300, kernel_name='python3', resources={'metadata': {'path': ROOT}}
    )
    client.execute()
  finally:
    del os.environ['SPARROW_WORKDIR']
  outputs = [o for cell in notebook.cells if cell.cell_type == 'code' for o in cell.outputs]
  assert not [o for o in outputs if o.output_type == 'error']
  text = ''.join(o.get('text', '') for o in outputs if o.output_type == 'stream')
  assert 'step 2' in text and 'perplexity' in text
  assert any('image/png' in o.get('data', {}) for o in outputs)  # the attention map plot
  # The dissection cells: a cache, patching, ablation, and attribution parts that add up.
  assert 'logit difference: clean' in text and 'mean-ablating one head' in text
  sums = re.search(r'the parts sum to (\S+), the logit difference is (\S+)', text)
  assert sums and float(sums[1]) == pytest.approx(float(sums[2]), abs=2e-3)


def test_attention_maps_are_causal_distributions(gpt, translator):
  maps = gpt.attention_maps('hello')
  assert len(maps) == gpt.cfg.num_layers
  for probs in maps.values():
    T = len(gpt.tokenizer.encode('hello')) + 1  # with bos
    assert probs.shape == (gpt.cfg.num_heads, T, T)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    assert np.all(np.triu(probs, k=1) == 0)  # causal: nothing above the diagonal
  cross = {k: v for k, v in translator.attention_maps('one', source='1').items() if 'cross' in k}
  assert cross and all(v.shape[-1] == 2 for v in cross.values())  # source '1' + eos


def test_run_with_cache_and_hooks_on_a_run_and_a_translator(gpt, translator):
  logits, cache = gpt.run_with_cache('hello', names=lambda n: n.endswith('hook_pattern'))
  maps = gpt.attention_maps('hello')
  assert len(cache) == len(maps) == gpt.cfg.num_layers
  for layer, probs in enumerate(maps.values()):
    np.testing.assert_allclose(cache[f'blocks.{layer}.attn.hook_pattern'][0], probs, rtol=1e-5)
  ids = [1] + gpt.tokenizer.encode('hello')
  np.testing.assert_allclose(logits, gpt.logits(np.asarray([ids])), rtol=1e-5, atol=1e-5)
  zero = {'blocks.0.hook_mlp_out': lambda x, _: x * 0.0}
  assert np.abs(gpt.run_with_hooks('hello', zero) - logits).max() > 1e-4
  _, cache = translator.run_with_cache(
    'one', source='1', names=['decoder.blocks.0.hook_resid_post']
  )
  assert cache['decoder.blocks.0.hook_resid_post'].shape[:2] == (
    1,
    1 + len(translator.tokenizer.encode('one')),
  )
  with pytest.raises(ValueError, match='needs source='):
    translator.run_with_cache('one')
