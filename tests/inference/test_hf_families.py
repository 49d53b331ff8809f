"""The families sparrow builds from parts (GPT-NeoX / Pythia, ...) against `transformers` models
built offline from small random configs at awkward sizes, every weight perturbed: logits, greedy
decoding on the KV cache, the export back, and TransformerLens's hook values."""

import importlib.util
import os
import sys

import pytest

if sys.version_info >= (3, 12) and importlib.util.find_spec('torch') is None:  # as in test_hf.py
  pytest.skip(
    'needs torch (not installed on this Python: the CPU wheel here is for Python 3.11)',
    allow_module_level=True,
  )

os.environ['HF_HUB_OFFLINE'] = '1'
# torch_models (tests/) and the package, when run as a script from the clone's root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
import torch
import torch_models
import transformers

from transformer.config import ModelConfig
from transformer.inference import hf
from transformer.model import models

VOCAB = 97
LENGTH = 13


def _neox(**overrides):
  """Head size 10 (40 / 4): a quarter rotates int(2.5) = 2 dims, as transformers rounds it."""
  kwargs = dict(
    vocab_size=VOCAB, hidden_size=40, num_attention_heads=4, intermediate_size=36,
    num_hidden_layers=3, max_position_embeddings=64, layer_norm_eps=1e-5, initializer_range=0.3,
    attn_implementation='eager',
  )  # fmt: skip
  return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**kwargs | overrides))


def _gpt_neo():
  """Global, local, local layers with a window of 5 tokens (shorter than the rows)."""
  config = transformers.GPTNeoConfig(
    vocab_size=VOCAB, hidden_size=40, num_heads=4, num_layers=3, intermediate_size=36,
    attention_types=[[['global', 'local'], 1], [['local'], 1]], window_size=5,
    max_position_embeddings=64, layer_norm_epsilon=1e-5, initializer_range=0.3,
    attn_implementation='eager',
  )  # fmt: skip
  return transformers.GPTNeoForCausalLM(config)


def _gemma(version: int, **overrides):
  """GQA 6:2, head_dim 10 (not 48 / 6), sliding window 5, query_pre_attn_scalar 12."""
  kwargs = dict(
    vocab_size=VOCAB, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=10,
    intermediate_size=36, num_hidden_layers=3, max_position_embeddings=64, sliding_window=5,
    query_pre_attn_scalar=12, rms_norm_eps=1e-6, initializer_range=0.3, pad_token_id=0,
    attn_implementation='eager',
  )  # fmt: skip
  if version == 2:
    config = transformers.Gemma2Config(**kwargs | overrides)
    return transformers.Gemma2ForCausalLM(config)
  return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**kwargs | overrides))


GEMMA3_ROPE = {
  'sliding_attention': {'rope_type': 'default', 'rope_theta': 100.0},
  'full_attention': {'rope_type': 'default', 'rope_theta': 5000.0},
}
# name: (arch, builder, the sparrow knobs it must give)
FAMILIES = {
  'pythia': (
    'gpt_neox',
    lambda: _neox(rope_parameters=dict(rope_theta=1000.0, partial_rotary_factor=0.25)),
    dict(parallel_residual=True, rope_dim=2, rope_theta=1000.0, tie_output=False),
  ),
  'neox_sequential_tied': (
    'gpt_neox',
    lambda: _neox(
      use_parallel_residual=False,
      tie_word_embeddings=True,
      hidden_act='gelu_new',
      rope_parameters=dict(rope_theta=10000.0, partial_rotary_factor=0.6),
    ),  # fmt: skip
    dict(parallel_residual=False, rope_dim=6, tie_output=True, activation='gelu_tanh'),
  ),
  'gpt_neo': (
    'gpt_neo',
    _gpt_neo,
    dict(attention_layers='GLL', window=(4, 0), qkv_bias=False, attention_scale=False),
  ),
  'gemma2': (
    'gemma2',
    lambda: _gemma(
      2,
      attn_logit_softcapping=5.0,
      final_logit_softcapping=3.0,
      layer_types=['sliding_attention', 'full_attention', 'sliding_attention'],
    ),  # fmt: skip
    dict(
      attention_layers='LGL',
      window=(4, 0),
      attention_softcap=5.0,
      logit_softcap=3.0,
      norm='rmsnorm_offset',
      norm_placement='sandwich',
      query_pre_attn_scalar=12,
      activation='geglu',
      scale_embeddings=True,
    ),  # fmt: skip
  ),
  'gemma3': (
    'gemma3_text',
    lambda: _gemma(
      3,
      rope_parameters=GEMMA3_ROPE,
      layer_types=['sliding_attention', 'sliding_attention', 'full_attention'],
    ),  # fmt: skip
    dict(
      attention_layers='LLG',
      rope_theta=5000.0,
      rope_local_theta=100.0,
      qk_norm=True,
      attention_softcap=None,
      logit_softcap=None,
    ),  # fmt: skip
  ),
}


@pytest.fixture(scope='module')
def hf_models(tmp_path_factory):
  """{name: (torch model, saved directory)}."""
  builders = {name: build for name, (_, build, _) in FAMILIES.items()}
  return torch_models.save_randomised(builders, tmp_path_factory.mktemp('hf_families'), seed=20)


def _batch(seed: int):
  """Right-padded rows of lengths 13, 8, 4 and their mask."""
  return torch_models.padded_batch(seed, (LENGTH, 8, 4), VOCAB)


def _relative_error(a, b) -> float:
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize('name', list(FAMILIES))
def test_logits_match(hf_models, name):
  model, directory = hf_models[name]
  _, cfg, params, _ = hf.convert_in_memory(directory)  # the arch read from config.json
  expected = FAMILIES[name][2]
  assert {k: getattr(cfg, k) for k in expected} == expected
  ids, mask = _batch(0)
  with torch.no_grad():
    theirs = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
  apply = jax.jit(models.build(cfg).apply)
  ours = np.asarray(apply({'params': params}, jnp.asarray(ids), segments=mask))
  real = mask.astype(bool)
  assert _relative_error(ours[real], theirs[real]) <= 1e-5


@pytest.mark.parametrize('name', list(FAMILIES))
def test_greedy_generation_matches_hugging_face(hf_models, name):
  """20 greedy tokens on the KV cache = HF's generate, from prompts of two lengths."""
  model, directory = hf_models[name]
  _, cfg, params, _ = hf.convert_in_memory(directory)
  torch_models.assert_greedy_matches_hf(model, cfg, params, VOCAB)


@pytest.mark.parametrize('name', list(FAMILIES))
def test_export_round_trips_bit_for_bit(hf_models, name):
  arch, (_, directory) = FAMILIES[name][0], hf_models[name]
  _, cfg, params, _ = hf.convert_in_memory(directory)
  hf.check_exportable(arch, cfg)
  back = hf.model_fields(arch, hf.hf_config(arch, cfg))
  assert ModelConfig.from_config({**cfg.to_dict(), **back}) == cfg
  original = safetensors.numpy.load_file(os.path.join(directory, 'model.safetensors'))
  exported = hf.params_to_hf(arch, cfg, params)
  assert set(exported) <= set(original)  # a tied file may also hold the head's copy
  for key, value in exported.items():
    np.testing.assert_array_equal(value, original[key], err_msg=key)


def _edited_copy(directory: str, copy: str, edit) -> str:
  """A copy of a model folder whose config.json is edit(config)."""
  shutil.copytree(directory, copy)
  path = os.path.join(copy, 'config.json')
  with open(path) as f:
    config = json.load(f)
  with open(path, 'w') as f:
    json.dump(edit(config), f)
  return copy


def test_pythia_files_of_the_hub_load(hf_models, tmp_path):
  """The Hub's Pythia files (rotary_pct and rotary_emb_base) and both names of the head: embed_out
  (the Hub's files) and lm_head (transformers 5)."""
  model, directory = hf_models['pythia']
  hub = lambda c: (
    {k: v for k, v in c.items() if k != 'rope_parameters'}
    | dict(rotary_pct=0.25, rotary_emb_base=1000)
  )
  copy = _edited_copy(directory, str(tmp_path / 'hub'), hub)
  weights = os.path.join(copy, 'model.safetensors')
  tensors = safetensors.numpy.load_file(weights)
  saved = 'lm_head.weight' if 'lm_head.weight' in tensors else 'embed_out.weight'
  other = {'lm_head.weight': 'embed_out.weight', 'embed_out.weight': 'lm_head.weight'}[saved]
  tensors[other] = tensors.pop(saved)  # the head under the name this transformers did not write
  safetensors.numpy.save_file(tensors, weights)
  _, cfg, params, _ = hf.convert_in_memory(copy)
  assert (cfg.rope_dim, cfg.rope_theta) == (2, 1000.0)
  _, _, want, _ = hf.convert_in_memory(directory)
  np.testing.assert_array_equal(
    params['head']['logits']['kernel'], want['head']['logits']['kernel']
  )


@pytest.mark.parametrize(
  'change, message',
  [
    (dict(attention_bias=False), 'attention_bias=False; sparrow imports gpt_neox with'),
    (dict(rope_parameters=dict(rope_theta=1e4, partial_rotary_factor=0.5)), 'rope_dim=5 must'),
  ],
)
def test_what_sparrow_cannot_build_is_one_error(hf_models, tmp_path, change, message):
  _, directory = hf_models['pythia']
  copy = _edited_copy(directory, str(tmp_path / 'bad'), lambda config: config | change)
  with pytest.raises(ValueError, match=message):
    hf.convert_in_memory(copy)


def _close(ours, theirs, what: str, tol: float = 1e-4) -> None:
  theirs = theirs.detach().numpy() if isinstance(theirs, torch.Tensor) else np.asarray(theirs)
  if '.q_norm.' in what or '.k_norm.' in what:  # the bridge keeps HF's [B, N, T, .] layout here
    theirs = theirs.swapaxes(1, 2)
  assert ours.shape == theirs.shape, (what, ours.shape, theirs.shape)
  finite = np.isfinite(theirs)  # the scores are -inf where masked, in both
  np.testing.assert_array_equal(np.isfinite(ours), finite, err_msg=what)
  ours, theirs = ours[finite], theirs[finite]
  error = np.max(np.abs(ours - theirs)) / max(np.max(np.abs(theirs)), 1.0)
  assert error <= tol, f'{what}: {error:.2e}'


@pytest.mark.parametrize('name', list(FAMILIES))
def test_transformer_lens_hooks_match(hf_models, name):
  """Every hook name that TransformerLens's bridge (4.3, weights unprocessed) and sparrow both
  define holds the same values, read from the cache and from a hook."""
  from transformer_lens.model_bridge import TransformerBridge

  import transformer

  _, directory = hf_models[name]
  m = transformer.load(directory)
  bridge = TransformerBridge.boot_transformers(directory, device='cpu')
  bridge.enable_compatibility_mode(disable_warnings=True, no_processing=True)
  tokens = np.random.default_rng(0).integers(1, VOCAB, size=(2, LENGTH)).astype(np.int32)
  logits, cache = m.run_with_cache(tokens)
  with torch.no_grad():
    tl_logits, tl_cache = bridge.run_with_cache(torch.tensor(tokens, dtype=torch.long))
  _close(logits, tl_logits, 'logits')
  shared = [n for n in cache if n in tl_cache.cache_dict]
  per_layer = 11 + 3 * (FAMILIES[name][2].get('norm_placement') == 'sandwich')
  assert len(shared) >= per_layer * m.cfg.num_layers, sorted(set(tl_cache.cache_dict) - set(cache))
  for hook in shared:
    ours = cache[hook]
    if name == 'gpt_neo' and hook.endswith('hook_attn_scores'):
      # TransformerLens 4.3's GPT-Neo bridge hands this hook the probabilities, not the scores:
      # the scores' softmax must be them.
      ours = np.exp(ours - ours.max(-1, keepdims=True))
      ours = ours / ours.sum(-1, keepdims=True)
    _close(ours, tl_cache[hook], hook)
  seen, hook = {}, 'blocks.1.hook_resid_post'

  def record(x, hook):  # sparrow traces its hooks: the values come out through a callback
    jax.debug.callback(lambda v: seen.setdefault('ours', np.asarray(v)), x)
    return x

  m.run_with_hooks(tokens, fwd_hooks=[(hook, record)])
  with torch.no_grad():
    bridge.run_with_hooks(
      torch.tensor(tokens, dtype=torch.long),
      fwd_hooks=[(hook, lambda x, hook: seen.setdefault('theirs', x.clone()))],
    )
  _close(np.asarray(seen['ours']), seen['theirs'], f'{hook} through a hook')


if __name__ == '__main__':
  # Prints docs/models.md's table: python tests/inference/test_hf_families.py
  import pathlib
  import tempfile

  from transformer_lens.model_bridge import TransformerBridge

  import transformer

  builders = {name: build for name, (_, build, _) in FAMILIES.items()}
  folders = torch_models.save_randomised(builders, pathlib.Path(tempfile.mkdtemp()), seed=20)
  print('| build | max relative logit error | bridge hooks compared | their max error |')
  for name, (model, directory) in folders.items():
    _, cfg, params, _ = hf.convert_in_memory(directory)
    ids, mask = _batch(0)
    with torch.no_grad():
      theirs = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    ours = np.asarray(models.build(cfg).apply({'params': params}, jnp.asarray(ids), segments=mask))
    error = _relative_error(ours[mask.astype(bool)], theirs[mask.astype(bool)])
    m, bridge = transformer.load(directory), TransformerBridge.boot_transformers(directory)
    bridge.enable_compatibility_mode(disable_warnings=True, no_processing=True)
    tokens = np.random.default_rng(0).integers(1, VOCAB, size=(2, LENGTH)).astype(np.int32)
    _, cache = m.run_with_cache(tokens)
    with torch.no_grad():
      _, tl_cache = bridge.run_with_cache(torch.tensor(tokens, dtype=torch.long))
    worst = 0.0
    for hook in [n for n in cache if n in tl_cache.cache_dict]:
      a, b = np.asarray(cache[hook]), tl_cache[hook].numpy()
      b = b.swapaxes(1, 2) if '.q_norm.' in hook or '.k_norm.' in hook else b
      if name == 'gpt_neo' and hook.endswith('hook_attn_scores'):  # the bridge's probabilities
        a = np.exp(a - a.max(-1, keepdims=True))
        a = a / a.sum(-1, keepdims=True)
      f = np.isfinite(b)
      worst = max(worst, float(np.abs(a[f] - b[f]).max() / max(np.abs(b[f]).max(), 1.0)))
    shared = sum(n in tl_cache.cache_dict for n in cache)
    print(f'| {name} | {error:.1e} | {shared} | {worst:.1e} |')
