"""docs/dissect.md's port of TransformerLens's Main Demo runs as written, on a random GPT-2 folder.

The folder holds a small GPT-2 (2 layers, 12 heads, so the demo's head 8 exists) with perturbed
norms and biases, and a word-level tokenizer that knows the demo's words, with a bos. The page's
Python blocks of that section run in order in one namespace; their results are then checked
against the `transformers` model and against what patching must give.
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

import numpy as np
import torch
import torch_models

from transformer.model import hooks as hooks_lib

SECTION = "## Porting TransformerLens's Main Demo"
TEXT = (
  'When Mary and John went to the store , gave a drink . The quick brown fox jumped over lazy dog'
)
WORDS = ['<|endoftext|>', '[UNK]'] + sorted(set(TEXT.split())) + [f'w{i}' for i in range(40)]


@pytest.fixture(scope='module')
def demo(tmp_path_factory):
  """(the namespace after the page's cells ran, the transformers model)."""
  directory = str(tmp_path_factory.mktemp('demo') / 'gpt2')
  model = torch_models.save_word_gpt2(
    directory, WORDS, seed=0, n_positions=128, n_embd=48, n_layer=2, n_head=12,
    initializer_range=0.2,
  )  # fmt: skip
  code = torch_models.page_section_code('dissect.md', SECTION)
  assert "transformer.load('downloads/gpt2')" in code
  namespace = {}
  exec(compile(code.replace('downloads/gpt2', directory), 'dissect.md', 'exec'), namespace)
  return namespace, model


def test_the_cells_tokenize_and_cache_as_transformer_lens(demo):
  ns, model = demo
  m, tokens = ns['m'], ns['tokens']
  assert tokens[0].tolist() == [0] + m.tokenizer.encode(ns['text'])  # bos first
  assert ns['str_tokens'][1:4] == ['When', 'Mary', 'and']
  assert ns['pattern'].shape == (12, tokens.shape[1], tokens.shape[1])
  with torch.no_grad():
    out = model(
      torch.tensor(tokens, dtype=torch.long), labels=torch.tensor(tokens, dtype=torch.long)
    )
  np.testing.assert_allclose(ns['logits'], out.logits.numpy(), atol=1e-4)
  np.testing.assert_allclose(ns['original_loss'], out.loss.item(), rtol=1e-5)
  assert abs(ns['ablated_loss'] - ns['original_loss']) > 1e-4
  assert m.to_single_token(' Mary') == WORDS.index('Mary')
  when, mary = WORDS.index('When'), WORDS.index('Mary')
  rows = m.to_tokens(['When Mary', 'When'])  # right-padded with the eos, as GPT-2 has no pad
  np.testing.assert_array_equal(rows, [[0, when, mary], [0, when, 0]])
  np.testing.assert_array_equal(m.to_tokens('When', prepend_bos=False), [[when]])
  bos = '<|endoftext|>'
  assert m.to_str_tokens(rows) == [[bos, 'When', 'Mary'], [bos, 'When', bos]]
  with pytest.raises(ValueError, match='exactly one'):
    m.to_single_token('Mary John')


def test_patching_restores_the_clean_run_at_the_changed_token(demo):
  """Before layer 0 only S2 differs: patching it restores everything, any other position
  nothing; the metric of the full clean cache is the clean logit difference."""
  ns, _ = demo
  result = ns['ioi_patching_result']  # [layers, T]
  s2 = 10  # bos When Mary and John went to the store , [S2]
  assert result.shape == (2, ns['clean_tokens'].shape[1])
  np.testing.assert_allclose(result[0, s2], 1.0, atol=1e-4)
  np.testing.assert_allclose(np.delete(result[0], s2), 0.0, atol=1e-4)


def test_induction_and_hook_listing(demo, capsys):
  ns, _ = demo
  seq_len = ns['seq_len']
  assert ns['loss_by_position'].shape == (2 * seq_len - 1,)
  score = ns['induction_score']
  assert score.shape == (2, 12) and np.all((score >= 0) & (score <= 1))
  pattern = ns['patterns']['blocks.1.attn.hook_pattern']  # [B, heads, T, T]
  stripe = np.mean([pattern[:, :, seq_len - 1 + i, i] for i in range(seq_len + 1)], axis=(0, 1))
  np.testing.assert_allclose(score[1], stripe, rtol=1e-5)
  m = ns['m']
  listed = [n for n in hooks_lib.hook_names(m.cfg) if ns['not_in_late_block_filter'](n)]
  assert list(ns['cache']) == listed and 'blocks.1.hook_resid_pre' not in listed
