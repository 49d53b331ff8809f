"""transformer.inference.cache on sparrow's own models, without torch: the ActivationCache's
helpers satisfy the identities of the residual stream, on a scanned model (whose parameters are
stacked over layers) with RMSNorm and on one with LayerNorm; stop_at_layer and the weight
processing refuse what they cannot do."""

import flax.linen as nn
import numpy as np
import pytest
from model_helpers import random_model

from transformer.config import ModelConfig
from transformer.inference.api import Model
from transformer.inference.cache import ActivationCache, get_act_name, loss
from transformer.model import scan

LAYERS, HEADS, D, V, T = 3, 4, 32, 50, 9


def _model(**overrides) -> Model:
  cfg = ModelConfig(
    family='causal_lm', vocab_size=V, d_model=D, num_heads=HEADS, num_layers=LAYERS, d_ff=64,
    max_length=16, norm_placement='pre', position='learned', scale_embeddings=False, pad_id=None,
    **overrides,
  )  # fmt: skip
  _, params = random_model(cfg, seed=0)
  return Model(cfg, nn.meta.unbox(params), None, None, 0, '')


@pytest.fixture(scope='module', params=[dict(norm='rmsnorm', scan_layers=True), dict()])
def run(request):
  m = _model(**request.param)
  tokens = np.random.default_rng(1).integers(0, V, (2, T)).astype(np.int32)
  logits, cache = m.run_with_cache(tokens)
  return m, tokens, logits, cache


def test_the_parts_sum_to_the_stream(run):
  m, _, _, cache = run
  final = cache['resid_post', -1]  # [B, T, D]
  parts, labels = cache.decompose_resid(incl_embeds=False, return_labels=True)
  assert labels == [f'{i}_{kind}_out' for i in range(LAYERS) for kind in ('attn', 'mlp')]
  np.testing.assert_allclose(cache['resid_pre', 0] + parts.sum(0), final, atol=1e-4)
  heads, labels = cache.stack_head_results(incl_remainder=True, return_labels=True)
  assert heads.shape == (LAYERS * HEADS + 1, 2, T, D) and labels[-1] == 'remainder'
  np.testing.assert_allclose(heads.sum(0), final, atol=1e-4)
  # One layer's heads and the output bias make its attention output.
  stack = scan.unscan_params(m.cfg, m.params)['decoder']['stack']
  bias = np.asarray(stack['layer_1']['self_attention']['out']['bias'])  # [D]
  one = cache.stack_head_results(layer=2)[HEADS:].sum(0)
  np.testing.assert_allclose(one + bias, cache['attn_out', 1], atol=1e-4)


def test_the_logit_lens_at_the_end_is_the_logits(run):
  m, _, logits, cache = run
  stack, labels = cache.accumulated_resid(apply_ln=True, incl_mid=True, return_labels=True)
  assert labels[-1] == 'final_post' and labels[:3] == ['0_pre', '0_mid', '1_pre']
  table = np.asarray(m.params['embedding']['embedding'])  # the tied head: [V, D]
  np.testing.assert_allclose(stack[-1] @ table.T, logits, atol=1e-3)
  # Through the cached scale, the normalised parts sum to the normalised whole.
  parts = cache.decompose_resid(layer=2, mlp_input=True, apply_ln=True, incl_embeds=False)
  whole = cache.apply_ln_to_stack(cache['resid_mid', 2][None], 2, mlp_input=True)[0]
  start = cache.apply_ln_to_stack(cache['resid_pre', 0][None], 2, mlp_input=True)[0]
  np.testing.assert_allclose(start + parts.sum(0), whole, atol=1e-4)


def test_stop_at_layer_returns_the_stream_before_the_block(run):
  m, tokens, logits, cache = run
  for layer in range(LAYERS):
    np.testing.assert_allclose(m(tokens, stop_at_layer=layer), cache['resid_pre', layer], atol=1e-5)
  np.testing.assert_allclose(m(tokens, stop_at_layer=LAYERS), cache['resid_post', -1], atol=1e-5)
  np.testing.assert_allclose(m(tokens, stop_at_layer=-1), cache['resid_pre', -1], atol=1e-5)
  per_token = m(tokens, return_type='loss', loss_per_token=True)  # [B, T - 1]
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  manual = -np.take_along_axis(logp[:, :-1], tokens[:, 1:, None], -1)[..., 0]
  np.testing.assert_allclose(per_token, manual, rtol=1e-5)
  np.testing.assert_allclose(loss(logits, tokens), manual.mean(), rtol=1e-5)


def test_key_shorthand_and_batch_dim(run):
  _, _, _, cache = run
  assert get_act_name('resid_pre', 1) == 'blocks.1.hook_resid_pre'
  np.testing.assert_array_equal(cache['z', -1], cache['blocks.2.attn.hook_z'])
  one = ActivationCache({k: v[:1] for k, v in cache.items()}, cache.model).remove_batch_dim()
  assert one['pattern', 0].shape == (HEADS, T, T) and not one.has_batch_dim
  with pytest.raises(ValueError, match='batch of 1'):
    ActivationCache(dict(cache), cache.model).remove_batch_dim()
  with pytest.raises(ValueError, match='layer=7 must be in'):
    cache.accumulated_resid(layer=7)
  with pytest.raises(ValueError, match="mode='heads' is not valid"):
    cache.decompose_resid(mode='heads')


def test_process_weights_refuses_other_models(run):
  m, _, _, _ = run
  if m.cfg.norm == 'rmsnorm':
    with pytest.raises(ValueError, match="norm='rmsnorm'"):
      m.process_weights()
