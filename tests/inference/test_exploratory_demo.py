"""docs/dissect.md's port of TransformerLens's Exploratory Analysis Demo runs as written, on a
random GPT-2 folder with a word-level tokenizer that holds the demo's words, and its numbers equal
TransformerLens's bridge on the same folder (weights processed by both as the demo asks,
refactored attention factors included): the logit differences, the attribution, and the
patching maps of its loops."""

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
from transformer_lens.model_bridge import TransformerBridge

SECTION = "## Porting TransformerLens's Exploratory Analysis Demo"
TEXT = (
  'After When John and Mary Tom James Dan Sid Martin Amy went to the store shops park , gave a '
  'bottle of milk bag ball an apple drink'
)
WORDS = ['<|endoftext|>', '[UNK]'] + sorted(set(TEXT.split())) + [f'w{i}' for i in range(30)]


@pytest.fixture(scope='module')
def demo(tmp_path_factory):
  """(the namespace after the page's blocks ran, TransformerLens's bridge on the same folder)."""
  directory = str(tmp_path_factory.mktemp('exploratory') / 'gpt2')
  torch_models.save_word_gpt2(
    directory, WORDS, seed=1, n_positions=64, n_embd=32, n_layer=2, n_head=4,
    initializer_range=0.3,
  )  # fmt: skip
  code = torch_models.page_section_code('dissect.md', SECTION)
  assert "'downloads/gpt2', process_weights=True, refactor_factored_attn_matrices=True" in code
  namespace = {}
  exec(compile(code.replace('downloads/gpt2', directory), 'dissect.md', 'exec'), namespace)
  bridge = TransformerBridge.boot_transformers(directory, device='cpu')
  bridge.enable_compatibility_mode(disable_warnings=True, refactor_factored_attn_matrices=True)
  return namespace, bridge


def _tl_logit_diff(logits, answer_tokens):
  final = logits[:, -1, :].numpy()
  picked = np.take_along_axis(final, answer_tokens, axis=-1)
  return (picked[:, 0] - picked[:, 1]).mean()


def test_the_logit_differences_and_attribution_equal_transformer_lens(demo):
  ns, bridge = demo
  assert ns['tokens'].shape == (8, 15) and len(set(map(len, map(ns['model'].to_str_tokens,
                                                                ns['prompts'])))) == 1  # fmt: skip
  with torch.no_grad():
    tl_logits, tl_cache = bridge.run_with_cache(torch.tensor(ns['tokens'], dtype=torch.long))
  want = _tl_logit_diff(tl_logits, ns['answer_tokens'])
  np.testing.assert_allclose(ns['original_average_logit_diff'], want, rtol=1e-4, atol=1e-5)
  # The attribution through the final norm adds up to the logit difference it explains.
  np.testing.assert_allclose(ns['average_logit_diff'], want, rtol=1e-3, atol=1e-4)
  residual, _ = tl_cache.stack_head_results(layer=-1, pos_slice=-1, return_labels=True)
  scaled = tl_cache.apply_ln_to_stack(residual, layer=-1, pos_slice=-1).detach().numpy()
  tl_per_head = np.einsum('...bd,bd->...', scaled, ns['logit_diff_directions']) / 8
  np.testing.assert_allclose(ns['per_head_logit_diffs'].flatten(), tl_per_head, atol=1e-4)


def test_the_patching_loops_equal_transformer_lens(demo):
  ns, bridge = demo
  clean = torch.tensor(ns['tokens'], dtype=torch.long)
  corrupted = torch.tensor(ns['corrupted_tokens'], dtype=torch.long)
  with torch.no_grad():
    _, tl_cache = bridge.run_with_cache(clean)
    base = _tl_logit_diff(bridge(corrupted), ns['answer_tokens'])
    top = _tl_logit_diff(bridge(clean), ns['answer_tokens'])

    def patched(name, index):
      def hook(x, hook):
        x = x.clone()
        x[index] = tl_cache[hook.name][index]
        return x

      logits = bridge.run_with_hooks(corrupted, fwd_hooks=[(name, hook)])
      return (_tl_logit_diff(logits, ns['answer_tokens']) - base) / (top - base)

    for layer in range(2):
      for pos in (0, 5, 14):
        want = patched(f'blocks.{layer}.hook_resid_pre', (slice(None), pos))
        got = ns['patched_residual_stream_diff'][layer, pos]
        np.testing.assert_allclose(got, want, atol=2e-4)
      for head in range(4):
        want = patched(f'blocks.{layer}.attn.hook_z', (slice(None), slice(None), head))
        np.testing.assert_allclose(ns['patched_head_z_diff'][layer, head], want, atol=2e-4)
  assert np.abs(ns['patched_residual_stream_diff']).max() > 0.1  # the patches matter


def test_the_hooks_that_write_scores_out_and_the_ablation(demo):
  ns, _ = demo
  model = ns['model']
  names = [f'blocks.{layer}.attn.hook_pattern' for layer in range(2)]
  _, cache = model.run_with_cache(ns['repeated_tokens'], names=names)
  for layer in range(2):
    pattern = cache[names[layer]]
    want = np.diagonal(pattern, offset=1, axis1=-1, axis2=-2).mean((0, 2))
    np.testing.assert_allclose(ns['prev_token_scores'][layer], want, rtol=1e-5, atol=1e-6)
    want = np.diagonal(pattern, offset=ns['seq_len'] - 1, axis1=-1, axis2=-2).mean((0, 2))
    np.testing.assert_allclose(ns['induction_scores'][layer], want, rtol=1e-5, atol=1e-6)
  assert model._persistent_hooks() == []  # the ablation hook was reset
  assert not np.isclose(ns['ablated_logit_diff'], ns['original_average_logit_diff'])
  head = ns['top_name_mover_layer'], ns['top_name_mover_head']
  _, plain = model.run_with_cache(ns['tokens'], names=[f'blocks.{head[0]}.attn.hook_z'])
  assert np.abs(plain[f'blocks.{head[0]}.attn.hook_z'][:, -1, head[1]]).max() > 0
