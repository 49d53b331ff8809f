"""transformer.inference.hf: HF GPT-2/BERT imports give HF's logits, exports round-trip, bad input.

The Hugging Face side is built offline from small random configs. torch and transformers are in
the [test] extra, so a missing one fails here instead of skipping; only on Python 3.12+ (the
newest-JAX CI stack), where the machines have no CPU torch wheel, does this module skip.
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

import copy
import json
import shutil
import subprocess

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import safetensors.numpy
import tokenizers
import torch
import transformers

from transformer.config import ModelConfig
from transformer.data import load_tokenizer
from transformer.inference import hf
from transformer.model import models
from transformer.training import checkpoint, optim
from transformer.training.state import create_state, optim_config

VOCAB = 96
WORDS = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + [f'w{i}' for i in range(VOCAB - 5)]


def _randomise(model: torch.nn.Module, seed: int) -> torch.nn.Module:
  """Every bias and LayerNorm parameter (the 1-D ones) to seeded random values, not 0 or 1."""
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if p.ndim == 1:
        noise = 0.2 * torch.randn(p.shape, generator=generator)
        is_scale = name.endswith(('LayerNorm.weight', 'ln_1.weight', 'ln_2.weight', 'ln_f.weight'))
        p.copy_(1.0 + noise if is_scale else noise)
  return model.eval()


def _save_tokenizer(directory: str) -> None:
  """A word-level Hugging Face tokenizer (tokenizer.json + tokenizer_config.json)."""
  model = tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token='[UNK]')
  tok = tokenizers.Tokenizer(model)
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.add_special_tokens(WORDS[:5])  # marked special: decode skips them
  tok.save(os.path.join(directory, 'tokenizer.json'))
  with open(os.path.join(directory, 'tokenizer_config.json'), 'w') as f:
    json.dump({'pad_token': '[PAD]', 'unk_token': '[UNK]', 'mask_token': '[MASK]'}, f)


def _gpt2(**overrides) -> transformers.GPT2LMHeadModel:
  config = transformers.GPT2Config(
    vocab_size=VOCAB,
    n_positions=64,
    n_embd=32,
    n_layer=2,
    n_head=4,
    layer_norm_epsilon=1e-3,  # not the default: the epsilon must travel
    initializer_range=0.2,
    bos_token_id=VOCAB - 1,
    eos_token_id=VOCAB - 1,
    **overrides,
  )
  torch.manual_seed(0)
  return _randomise(transformers.GPT2LMHeadModel(config), seed=1)


def _bert(cls=transformers.BertForMaskedLM, **overrides) -> torch.nn.Module:
  config = transformers.BertConfig(
    vocab_size=VOCAB,
    hidden_size=48,
    num_hidden_layers=2,
    num_attention_heads=3,
    intermediate_size=64,
    max_position_embeddings=64,
    layer_norm_eps=1e-3,
    initializer_range=0.2,
    **overrides,
  )
  torch.manual_seed(0)
  return _randomise(cls(config), seed=2)


@pytest.fixture(scope='module')
def hf_models(tmp_path_factory):
  """{name: (torch model, saved directory)} for gpt2, bert and a BERT classifier."""
  root = tmp_path_factory.mktemp('hf')
  built = {
    'gpt2': _gpt2(),
    'bert': _bert(),
    'bert_cls': _bert(transformers.BertForSequenceClassification, num_labels=3),
  }
  out = {}
  for name, model in built.items():
    directory = str(root / name)
    model.save_pretrained(directory, safe_serialization=True)
    out[name] = (model, directory)
  _save_tokenizer(out['gpt2'][1])
  return out


def _batch(seed: int, length: int = 12):
  """Right-padded token rows of lengths 12, 9, 5 (pad id 0), their mask and token types."""
  rng = np.random.default_rng(seed)
  lengths = [length, length - 3, length - 7]
  mask = (np.arange(length)[None] < np.array(lengths)[:, None]).astype(np.int32)  # [B, T]
  ids = rng.integers(1, VOCAB, size=mask.shape) * mask
  types = rng.integers(0, 2, size=mask.shape) * mask
  return ids.astype(np.int32), mask, types.astype(np.int32)


def _hf_logits(model, ids, mask, types=None) -> np.ndarray:
  kwargs = {'token_type_ids': torch.tensor(types)} if types is not None else {}
  with torch.no_grad():
    out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), **kwargs)
  return out.logits.numpy()


def _load(workdir: str):
  """(ModelConfig, params) of a workdir, restored into the abstract training state."""
  config = ml_collections.ConfigDict(checkpoint.read_run_config(workdir))
  cfg = ModelConfig.from_config(config.model)
  model = models.build(cfg)
  tx = optim.make_optimizer(optim_config(config, cfg))
  make = lambda: create_state(model, cfg, tx, config.seed, config.train.loss_scale)
  ckpt = checkpoint.Checkpointer(workdir)
  state, data_state, step = ckpt.restore(jax.eval_shape(make))
  ckpt.close()
  assert (step, data_state, int(state.step)) == (0, {}, 0)
  return cfg, state.params


def _sparrow_logits(cfg, params, ids, mask, types=None) -> np.ndarray:
  kwargs = {'token_types': jnp.asarray(types)} if types is not None else {}
  apply = jax.jit(models.build(cfg).apply)  # one compile beats op-by-op dispatch here
  return np.asarray(apply({'params': params}, jnp.asarray(ids), segments=mask, **kwargs))


def _relative_error(a: np.ndarray, b: np.ndarray) -> float:
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _untouched(out) -> None:
  """`out` was never created, and no partial build is left beside it."""
  out = str(out)
  assert not os.path.exists(out)
  parent = os.path.dirname(out)
  assert not [n for n in os.listdir(parent) if '.partial-' in n]


@pytest.fixture(scope='module')
def imported(hf_models, tmp_path_factory):
  root = tmp_path_factory.mktemp('sparrow')
  out = {}
  for name in ('gpt2', 'bert'):
    directory = hf_models[name][1]
    workdir = str(root / name)
    if name == 'gpt2':
      os.makedirs(workdir)  # an existing empty directory is fine
    hf.convert(name, directory, workdir)
    out[name] = workdir
  return out


# Import ------------------------------------------------------------------------------------------
def test_gpt2_logits_match(hf_models, imported):
  model, _ = hf_models['gpt2']
  cfg, params = _load(imported['gpt2'])
  assert (cfg.family, cfg.norm_placement, cfg.activation) == ('causal_lm', 'pre', 'gelu_tanh')
  assert (cfg.norm_eps, cfg.max_length, cfg.pad_id, cfg.tie_output) == (1e-3, 64, None, True)
  ids, mask, _ = _batch(0)
  ours, theirs = _sparrow_logits(cfg, params, ids, mask), _hf_logits(model, ids, mask)
  real = mask.astype(bool)
  assert _relative_error(ours[real], theirs[real]) <= 1e-4


def test_gpt2_greedy_generation_matches_hugging_face(hf_models, imported):
  """KV-cache decoding of the imported model against transformers' own greedy generate."""
  import transformer
  from transformer.model import decode

  model, _ = hf_models['gpt2']
  m = transformer.load(imported['gpt2'])
  rng = np.random.default_rng(3)
  for length in (3, 7):
    prompt = rng.integers(5, VOCAB - 1, size=(1, length))
    with torch.no_grad():
      theirs = model.generate(
        torch.as_tensor(prompt),
        attention_mask=torch.ones(1, length, dtype=torch.long),
        do_sample=False,
        max_new_tokens=10,
        eos_token_id=VOCAB - 1,
        pad_token_id=0,
      )[0, length:].numpy()
    ours = np.asarray(
      decode.generate(m.module, m.params, prompt, max_new_tokens=10, eos_id=VOCAB - 1)
    )[0]
    n = len(theirs)  # transformers stops after eos; ours pads with 0 from there on
    assert n >= 3
    np.testing.assert_array_equal(ours[:n], theirs)


def test_bert_logits_match(hf_models, imported):
  model, _ = hf_models['bert']
  cfg, params = _load(imported['bert'])
  assert (cfg.family, cfg.norm_placement, cfg.embedding_norm) == ('bidirectional_lm', 'post', True)
  assert (cfg.type_vocab_size, cfg.activation, cfg.norm_eps) == (2, 'gelu', 1e-3)
  ids, mask, types = _batch(1)
  ours = _sparrow_logits(cfg, params, ids, mask, types)
  theirs = _hf_logits(model, ids, mask, types)
  real = mask.astype(bool)
  assert _relative_error(ours[real], theirs[real]) <= 1e-4


def test_bert_classifier_logits_match(hf_models):
  """BertForSequenceClassification: pooler + classifier, both ways (in memory)."""
  model, directory = hf_models['bert_cls']
  cfg, params = _direct_params('bert', directory)
  assert cfg.num_classes == 3 and 'pooler' in params
  ids, mask, types = _batch(2)
  ours = _sparrow_logits(cfg, params, ids, mask, types)  # [B, C]
  assert _relative_error(ours, _hf_logits(model, ids, mask, types)) <= 1e-4
  tensors = safetensors.numpy.load_file(os.path.join(directory, 'model.safetensors'))
  exported = hf.params_to_hf('bert', cfg, params)
  assert set(exported) == set(tensors)
  for key, value in tensors.items():
    np.testing.assert_array_equal(exported[key], value, err_msg=key)
  assert hf.hf_config('bert', cfg)['architectures'] == ['BertForSequenceClassification']


def test_workdir_contents(hf_models, imported):
  config = checkpoint.read_run_config(imported['gpt2'])
  assert config['name'] == 'hf_gpt2' and config['model']['d_model'] == 32
  assert config['model']['dropout_rate'] == 0.1 and config['model']['attention_dropout_rate'] == 0.1
  assert config['data']['max_length'] <= 64  # fits the learned positions
  tokenizer = load_tokenizer(os.path.join(imported['gpt2'], 'tokenizer'))
  assert (tokenizer.kind, tokenizer.vocab_size, tokenizer.pad_id, tokenizer.bos_id) == (
    'hf',
    VOCAB,
    0,
    None,
  )
  assert tokenizer.encode('w1 w2 nope') == [6, 7, 1]
  assert tokenizer.decode([0, 6, 7]) == 'w1 w2'
  assert not os.path.exists(os.path.join(imported['bert'], 'tokenizer'))  # none in the input


def _direct_params(arch: str, path: str):
  """(ModelConfig, params) converted in memory: no workdir, no checkpoint.

  `path` is a Hugging Face model directory or its weights file; the tensors are read lazily.
  """
  directory = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
  with open(os.path.join(directory, 'config.json')) as f:
    hf_config = json.load(f)
  tensors = hf.open_weights(directory, path)[0]
  cfg = ModelConfig.from_config(hf.experiment_config(arch, hf_config, 'x').model)
  return cfg, hf.params_from_hf(arch, cfg, tensors)


def test_untied_gpt2(tmp_path):
  """An untied lm_head maps to its own output projection; the input may be the weights file."""
  model = _gpt2(tie_word_embeddings=False)
  model.save_pretrained(tmp_path, safe_serialization=True)
  cfg, params = _direct_params('gpt2', str(tmp_path / 'model.safetensors'))
  assert not cfg.tie_output and 'head' in params
  ids, mask, _ = _batch(3)
  real = mask.astype(bool)
  ours, theirs = _sparrow_logits(cfg, params, ids, mask), _hf_logits(model, ids, mask)
  assert _relative_error(ours[real], theirs[real]) <= 1e-4


def test_bfloat16_and_sharded_files(hf_models, tmp_path):
  """bf16 weights load as float32; shards listed in model.safetensors.index.json are joined."""
  model, directory = hf_models['gpt2']
  _, reference = _direct_params('gpt2', directory)
  model.save_pretrained(tmp_path / 'shards', safe_serialization=True, max_shard_size='20KB')
  assert os.path.exists(tmp_path / 'shards' / 'model.safetensors.index.json')
  _, params = _direct_params('gpt2', str(tmp_path / 'shards'))
  jax.tree.map(np.testing.assert_array_equal, params, reference)
  copy.deepcopy(model).to(torch.bfloat16).save_pretrained(
    tmp_path / 'bf16', safe_serialization=True
  )
  _, params = _direct_params('gpt2', str(tmp_path / 'bf16'))
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2)
  jax.tree.map(close, params, reference)
  assert all(x.dtype == np.float32 for x in jax.tree.leaves(params))


def test_export_of_scanned_layers(hf_models):
  """A workdir trained with scan_layers=True stacks its blocks; the export unstacks them."""
  _, directory = hf_models['gpt2']
  cfg, params = _direct_params('gpt2', directory)
  stack = params['decoder']['stack']
  layers = [stack.pop(f'layer_{i}') for i in range(cfg.num_layers)]
  stack['layers'] = jax.tree.map(lambda *xs: np.stack(xs), *layers)
  scanned = cfg.replace(scan_layers=True)
  want = jax.tree.map(np.shape, models.param_shapes(scanned))
  assert jax.tree.map(np.shape, params) == want
  tensors = safetensors.numpy.load_file(os.path.join(directory, 'model.safetensors'))
  exported = hf.params_to_hf('gpt2', scanned, params)
  assert set(exported) == set(tensors)
  for key, value in tensors.items():
    np.testing.assert_array_equal(exported[key], value, err_msg=key)


def test_bert_old_names_and_buffers(hf_models, tmp_path):
  """Old BERT files: no 'bert.' prefix, gamma/beta, a tied decoder copy, buffers and NSP head."""
  model, directory = hf_models['bert']
  directory = _copy(hf_models, tmp_path, 'bert')

  def rename(tensors):
    for name in list(tensors):
      new = name.removeprefix('bert.').replace('LayerNorm.weight', 'LayerNorm.gamma')
      tensors[new.replace('LayerNorm.bias', 'LayerNorm.beta')] = tensors.pop(name)
    tensors['cls.predictions.decoder.weight'] = tensors['embeddings.word_embeddings.weight']
    tensors['cls.predictions.decoder.bias'] = tensors['cls.predictions.bias']
    tensors['embeddings.position_ids'] = np.arange(64)[None]  # a buffer: ignored
    tensors['cls.seq_relationship.weight'] = np.zeros((2, 48), np.float32)  # NSP head: ignored
    tensors['pooler.dense.weight'] = np.zeros((48, 48), np.float32)  # no classifier: ignored

  _edit(directory, rename)
  cfg, params = _direct_params('bert', directory)
  ids, mask, types = _batch(4)
  real = mask.astype(bool)
  ours, theirs = _sparrow_logits(cfg, params, ids, mask, types), _hf_logits(model, ids, mask, types)
  assert _relative_error(ours[real], theirs[real]) <= 1e-4


# Export ------------------------------------------------------------------------------------------
@pytest.mark.parametrize('name', ['gpt2', 'bert'])
def test_export_round_trip(hf_models, imported, tmp_path, name):
  model, directory = hf_models[name]
  out = str(tmp_path / 'out')
  hf.convert(name, imported[name], out, direction='to_hf')
  original = safetensors.numpy.load_file(os.path.join(directory, 'model.safetensors'))
  exported = safetensors.numpy.load_file(os.path.join(out, 'model.safetensors'))
  assert set(exported) == set(original)
  for key, value in original.items():
    np.testing.assert_array_equal(exported[key], value, err_msg=key)
  reloaded = type(model).from_pretrained(out).eval()
  ids, mask, types = _batch(5)
  types = types if name == 'bert' else None
  np.testing.assert_array_equal(
    _hf_logits(reloaded, ids, mask, types), _hf_logits(model, ids, mask, types)
  )
  assert os.path.exists(os.path.join(out, 'tokenizer.json')) == (name == 'gpt2')


def test_export_refuses_other_shapes(imported, tmp_path):
  with pytest.raises(ValueError, match='cannot export this model as gpt2: model.family'):
    hf.convert('gpt2', imported['bert'], str(tmp_path / 'out'), direction='to_hf')
  _untouched(tmp_path / 'out')
  with pytest.raises(FileNotFoundError, match='sparrow workdir'):
    hf.convert('gpt2', str(tmp_path / 'nothing'), str(tmp_path / 'out'), direction='to_hf')
  with pytest.raises(ValueError, match="direction='sideways'"):
    hf.convert('gpt2', imported['gpt2'], str(tmp_path / 'out'), direction='sideways')
  _untouched(tmp_path / 'out')


@pytest.mark.parametrize(
  'arch, changes, message',
  [
    ('gpt2', dict(position='rope'), "model.position is 'rope', but gpt2 has 'learned'"),
    ('gpt2', dict(num_kv_heads=2), 'model.num_kv_heads is 2, but gpt2 has 4'),
    # Knobs that an export does not map are refused at any value but their default.
    ('gpt2', dict(norm_bias=False), 'model.norm_bias is False, but gpt2 has True'),
    ('gpt2', dict(rope_theta=500.0), 'model.rope_theta is 500.0, but gpt2 has 10000.0'),
    ('bert', dict(compress_block=8), 'model.compress_block is 8, but bert has 16'),
    ('gpt2', dict(activation='swiglu'), "cannot export activation='swiglu' as gpt2"),
    ('bert', dict(type_vocab_size=0), 'BERT needs token types'),
    ('bert', dict(norm_placement='pre'), "model.norm_placement is 'pre', but bert has 'post'"),
  ],
)
def test_check_exportable(arch, changes, message):
  family = 'causal_lm' if arch == 'gpt2' else 'bidirectional_lm'
  fields = hf.model_fields(arch, {}) | dict(vocab_size=VOCAB, d_model=32, num_heads=4, d_ff=64)
  cfg = ModelConfig.from_config(fields | dict(num_layers=1, max_length=64))
  assert cfg.family == family
  hf.check_exportable(arch, cfg)  # as imported: fine
  with pytest.raises(ValueError, match=message):
    hf.check_exportable(arch, cfg.replace(**changes))


@pytest.mark.parametrize('bos', [VOCAB - 1, None])
def test_hook_methods_start_a_text_with_the_tokenizers_bos(hf_models, tmp_path, bos):
  # As generate and score do: the imported GPT-2's own bos (config.json's bos_token_id, not
  # sparrow's id 1), or nothing for a model trained without one.
  import transformer
  from research import dissect
  from research import interventions as iv

  directory = _copy(hf_models, tmp_path)
  with open(os.path.join(directory, 'config.json')) as f:
    config = json.load(f)
  config['bos_token_id'] = bos
  with open(os.path.join(directory, 'config.json'), 'w') as f:
    json.dump(config, f)
  m = transformer.load(directory)
  want_ids = ([] if bos is None else [bos]) + [6, 7, 8]  # 'w1 w2 w3'
  assert m.prompt_prefix() == want_ids[:-3]
  want = m.logits(np.asarray([want_ids]))
  logits, cache = m.run_with_cache('w1 w2 w3', names=['blocks.0.attn.hook_pattern'])
  np.testing.assert_array_equal(logits, want)
  np.testing.assert_array_equal(m.run_with_hooks('w1 w2 w3'), want)
  pattern = m.attention_maps('w1 w2 w3')['blocks.0.attn.hook_pattern']
  assert pattern.shape[-1] == len(want_ids)
  np.testing.assert_array_equal(pattern, cache['blocks.0.attn.hook_pattern'][0])
  model = hf_models['gpt2'][0]
  with torch.no_grad():
    theirs = model(torch.tensor([want_ids])).logits.numpy()
  assert _relative_error(logits, theirs) <= 1e-4
  detectors = iv.head_detectors(m.cfg, m.params, length=4, batch=1, prefix=m.prompt_prefix())
  assert detectors['induction'].shape == (m.cfg.num_layers, m.cfg.num_heads)
  assert dissect._tokens(m, 'w1 w2 w3') == want_ids  # experiments.inspect's --text


# Bad input -------------------------------------------------------------------------------------
def _copy(hf_models, tmp_path, name='gpt2') -> str:
  directory = str(tmp_path / 'input')
  shutil.copytree(hf_models[name][1], directory)
  return directory


def _edit(directory: str, edit) -> None:
  path = os.path.join(directory, 'model.safetensors')
  tensors = dict(safetensors.numpy.load_file(path))
  edit(tensors)
  safetensors.numpy.save_file(tensors, path)


def test_corrupt_and_truncated_files(hf_models, tmp_path):
  directory = _copy(hf_models, tmp_path)
  path = os.path.join(directory, 'model.safetensors')
  with open(path, 'rb') as f:
    data = f.read()
  for broken in (data[: len(data) // 2], b'not a safetensors file at all' * 4):
    with open(path, 'wb') as f:
      f.write(broken)
    with pytest.raises(ValueError, match='model.safetensors.*corrupt or truncated'):
      hf.convert('gpt2', directory, str(tmp_path / 'out'))
    _untouched(tmp_path / 'out')


def test_bad_arch_and_paths(hf_models, tmp_path):
  out = str(tmp_path / 'out')
  with pytest.raises(
    ValueError, match="arch='t5' is not supported; choose one of gpt2, bert, llama"
  ):
    hf.convert('t5', hf_models['gpt2'][1], out)
  with pytest.raises(ValueError, match="model_type='gpt2' but arch='bert'; use --arch=gpt2"):
    hf.convert('bert', hf_models['gpt2'][1], out)
  with pytest.raises(FileNotFoundError, match='does not exist'):
    hf.convert('gpt2', str(tmp_path / 'missing'), out)
  pickled = tmp_path / 'pickled'
  pickled.mkdir()
  shutil.copy(os.path.join(hf_models['gpt2'][1], 'config.json'), pickled)
  (pickled / 'pytorch_model.bin').write_bytes(b'never read')
  with pytest.raises(ValueError, match='pytorch_model.bin.*never unpickles.*safe_serialization'):
    hf.convert('gpt2', str(pickled), out)
  _untouched(out)


@pytest.mark.parametrize(
  'edit, message',
  [
    (  # a renamed tensor: the missing one is named with its shape, and the stray one too
      lambda t: t.__setitem__(
        'transformer.h.1.ln_one.weight', t.pop('transformer.h.1.ln_1.weight')
      ),
      r"no tensor 'transformer.h.1.ln_1.weight' \(expected shape \(32,\)\).*"
      r"'transformer.h.1.ln_one.weight' \(32,\)",
    ),
    (
      lambda t: t.__setitem__('transformer.h.0.attn.c_attn.weight', np.zeros((32, 95), np.float32)),
      r"'transformer.h.0.attn.c_attn.weight' has shape \(32, 95\), but config.json implies "
      r'\(32, 96\)',
    ),
    (
      lambda t: t.__setitem__('transformer.h.0.mlp.extra', np.zeros((3,), np.float32)),
      r"'transformer.h.0.mlp.extra' of shape \(3,\) maps to no sparrow parameter",
    ),
    (
      lambda t: t.__setitem__('lm_head.weight', t['transformer.wte.weight'] + 1),
      r"'lm_head.weight' \(96, 32\) differs from 'transformer.wte.weight'; .*tied weights",
    ),
  ],
)
def test_mismatched_names_and_shapes(hf_models, tmp_path, edit, message):
  directory = _copy(hf_models, tmp_path)
  _edit(directory, edit)
  with pytest.raises(ValueError, match=message):
    hf.convert('gpt2', directory, str(tmp_path / 'out'))
  _untouched(tmp_path / 'out')


def test_refuses_existing_output(hf_models, imported, tmp_path):
  before = sorted(os.listdir(imported['gpt2']))
  with pytest.raises(ValueError, match='already holds checkpoints; refusing to overwrite'):
    hf.convert('gpt2', hf_models['gpt2'][1], imported['gpt2'])
  assert sorted(os.listdir(imported['gpt2'])) == before
  other = tmp_path / 'other'
  other.mkdir()
  (other / 'notes.txt').write_text('mine')
  with pytest.raises(ValueError, match='already holds files'):
    hf.convert('gpt2', hf_models['gpt2'][1], str(other))
  assert os.listdir(other) == ['notes.txt']


def test_failure_midway_leaves_nothing(hf_models, tmp_path, monkeypatch):
  def fail(*args):
    raise OSError('disk gone')

  monkeypatch.setattr(hf, '_copy_tokenizer', fail)
  with pytest.raises(OSError, match='disk gone'):
    hf.convert('gpt2', hf_models['gpt2'][1], str(tmp_path / 'out'))
  _untouched(tmp_path / 'out')


def test_cli_error_is_one_line(tmp_path):
  cmd = [sys.executable, '-m', 'experiments.convert_hf', '--arch=t5', '--input=x']
  result = subprocess.run(
    cmd + [f'--workdir={tmp_path / "out"}'], capture_output=True, text=True, timeout=120
  )
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1].startswith("error: arch='t5' is not supported")
  _untouched(tmp_path / 'out')
