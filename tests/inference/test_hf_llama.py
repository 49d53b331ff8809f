"""inference.hf for the Llama family (Llama, Qwen2, Qwen3, Mistral) and BertModel, against
`transformers` models built offline from small random configs at awkward sizes."""

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

import copy
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import torch_models
import transformers

from transformer.config import ModelConfig
from transformer.inference import hf
from transformer.model import models

VOCAB = 101  # not a multiple of 8
LENGTH = 12


def _llama_kwargs(**overrides):
  """GQA ratio 3 (6 query heads, 2 kv heads), head_dim 10 != 48 / 6, vocabulary 101."""
  kwargs = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=10,
    intermediate_size=40,
    num_hidden_layers=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    initializer_range=0.2,
    tie_word_embeddings=False,
    attn_implementation='eager',
  )
  return kwargs | overrides


LLAMA3_ROPE = dict(
  rope_type='llama3',
  rope_theta=500.0,
  factor=8.0,
  low_freq_factor=1.0,
  high_freq_factor=4.0,
  original_max_position_embeddings=64,  # wavelengths 6.3 (kept), 22 (blended), 75+ (divided)
)
BUILDERS = {
  'llama': lambda: transformers.LlamaForCausalLM(
    transformers.LlamaConfig(**_llama_kwargs(rope_parameters=LLAMA3_ROPE))
  ),
  'llama_tied_linear': lambda: transformers.LlamaForCausalLM(
    transformers.LlamaConfig(
      **_llama_kwargs(
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type='linear', rope_theta=1000.0, factor=2.5),
      )
    )
  ),
  'qwen2': lambda: transformers.Qwen2ForCausalLM(
    transformers.Qwen2Config(**_llama_kwargs(tie_word_embeddings=True))
  ),
  'qwen3': lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**_llama_kwargs())),
  'mistral': lambda: transformers.MistralForCausalLM(
    transformers.MistralConfig(**_llama_kwargs(sliding_window=5))  # shorter than the batch rows
  ),
}


@pytest.fixture(scope='module')
def hf_models(tmp_path_factory):
  """{name: (torch model, saved directory)} for every Llama-family variant."""
  return torch_models.save_randomised(BUILDERS, tmp_path_factory.mktemp('hf_llama'), seed=10)


def _batch(seed: int):
  """Right-padded rows of lengths 12, 9, 5 and their mask."""
  return torch_models.padded_batch(seed, (LENGTH, 9, 5), VOCAB)


def _hf_logits(model, ids, mask) -> np.ndarray:
  with torch.no_grad():
    return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()


def _sparrow_logits(cfg, params, ids, mask) -> np.ndarray:
  apply = jax.jit(models.build(cfg).apply)
  return np.asarray(apply({'params': params}, jnp.asarray(ids), segments=mask))


def _relative_error(a, b) -> float:
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _arch(name: str) -> str:
  return name.split('_')[0]


@pytest.mark.parametrize('name', list(BUILDERS))
def test_logits_match(hf_models, name):
  model, directory = hf_models[name]
  config, cfg, params, _ = hf.convert_in_memory(directory)  # arch read from config.json
  assert cfg.family == 'causal_lm' and (cfg.kv_heads, cfg.head_size) == (2, 10)
  expected = {
    'llama': dict(rope_scaling='llama3', rope_scaling_factor=8.0, tie_output=False),
    'llama_tied_linear': dict(rope_scaling='linear', rope_theta=1000.0, tie_output=True),
    'qwen2': dict(qkv_bias=True, use_bias=False, tie_output=True),
    'qwen3': dict(qk_norm=True, use_bias=False),
    'mistral': dict(window=(4, 0)),
  }[name]
  assert {k: getattr(cfg, k) for k in expected} == expected
  ids, mask = _batch(0)
  real = mask.astype(bool)
  ours, theirs = _sparrow_logits(cfg, params, ids, mask), _hf_logits(model, ids, mask)
  assert _relative_error(ours[real], theirs[real]) <= 1e-4


def test_old_rope_scaling_key(hf_models, tmp_path):
  """config.json of older transformers: top-level rope_theta and rope_scaling {'type': ...}."""
  model, directory = hf_models['llama_tied_linear']
  copy = str(tmp_path / 'old')
  shutil.copytree(directory, copy)
  path = os.path.join(copy, 'config.json')
  with open(path) as f:
    config = json.load(f)
  config.pop('rope_parameters')
  config.update(rope_theta=1000.0, rope_scaling={'type': 'linear', 'factor': 2.5})
  with open(path, 'w') as f:
    json.dump(config, f)
  _, cfg, params, _ = hf.convert_in_memory(copy)
  assert (cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_theta) == ('linear', 2.5, 1000.0)
  ids, mask = _batch(1)
  real = mask.astype(bool)
  ours, theirs = _sparrow_logits(cfg, params, ids, mask), _hf_logits(model, ids, mask)
  assert _relative_error(ours[real], theirs[real]) <= 1e-4


@pytest.mark.parametrize('name', list(BUILDERS))
def test_greedy_generation_matches_hugging_face(hf_models, name):
  """20 greedy tokens with the KV cache (Mistral's window is passed mid-prompt) = HF's generate."""
  model, directory = hf_models[name]
  _, cfg, params, _ = hf.convert_in_memory(directory)
  torch_models.assert_greedy_matches_hf(model, cfg, params, VOCAB)


@pytest.mark.parametrize('name', list(BUILDERS))
def test_export_round_trips_bit_for_bit(hf_models, name):
  _, directory = hf_models[name]
  _, cfg, params, _ = hf.convert_in_memory(directory)
  hf.check_exportable(_arch(name), cfg)
  original = safetensors.numpy.load_file(os.path.join(directory, 'model.safetensors'))
  exported = hf.params_to_hf(_arch(name), cfg, params)
  assert set(exported) == set(original)
  for key, value in original.items():
    np.testing.assert_array_equal(exported[key], value, err_msg=key)


def test_workdir_round_trip_in_bfloat16(hf_models, tmp_path):
  """--param_dtype=keep on a bf16 checkpoint: bf16 parameters, exported back bit for bit."""
  model, _ = hf_models['qwen3']
  source = str(tmp_path / 'bf16')
  copy.deepcopy(model).to(torch.bfloat16).save_pretrained(source, safe_serialization=True)
  summary = hf.convert(None, source, str(tmp_path / 'run'), param_dtype='keep')
  assert (summary['arch'], summary['param_dtype']) == ('qwen3', 'bfloat16')
  hf.convert(None, str(tmp_path / 'run'), str(tmp_path / 'back'), direction='to_hf')
  original = safetensors.numpy.load_file(os.path.join(source, 'model.safetensors'))
  exported = safetensors.numpy.load_file(str(tmp_path / 'back' / 'model.safetensors'))
  assert set(exported) == set(original)
  for key, value in original.items():
    assert exported[key].dtype == value.dtype
    np.testing.assert_array_equal(exported[key], value, err_msg=key)
  with open(tmp_path / 'back' / 'config.json') as f:
    assert json.load(f)['architectures'] == ['Qwen3ForCausalLM']


def test_sharded_checkpoint(hf_models, tmp_path):
  model, directory = hf_models['llama']
  _, _, reference, _ = hf.convert_in_memory(directory)
  model.save_pretrained(tmp_path / 'shards', safe_serialization=True, max_shard_size='30KB')
  assert os.path.exists(tmp_path / 'shards' / 'model.safetensors.index.json')
  _, _, params, _ = hf.convert_in_memory(str(tmp_path / 'shards'))
  jax.tree.map(np.testing.assert_array_equal, params, reference)


# BertModel ---------------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def bert_model(tmp_path_factory):
  config = transformers.BertConfig(
    vocab_size=VOCAB,
    hidden_size=36,
    num_hidden_layers=2,
    num_attention_heads=3,
    intermediate_size=44,
    max_position_embeddings=40,
    layer_norm_eps=1e-3,
    initializer_range=0.2,
  )
  torch.manual_seed(5)
  model = torch_models.randomise(transformers.BertModel(config, add_pooling_layer=False), 6, 0.3)
  directory = str(tmp_path_factory.mktemp('bert_model') / 'bert')
  model.save_pretrained(directory, safe_serialization=True)
  return model, directory


def test_bert_model_hidden_states_match(bert_model):
  """BertModel (no head) imports as output_head=False; its hidden states match, both ways."""
  model, directory = bert_model
  _, cfg, params, _ = hf.convert_in_memory(directory)
  assert (cfg.family, cfg.output_head, cfg.num_classes) == ('bidirectional_lm', False, 0)
  ids, mask = _batch(7)
  types = (np.random.default_rng(8).integers(0, 2, size=ids.shape) * mask).astype(np.int32)
  apply = jax.jit(models.build(cfg).apply)
  ours = np.asarray(apply({'params': params}, ids, segments=mask, token_types=types))  # [B, T, D]
  with torch.no_grad():
    out = model(
      input_ids=torch.tensor(ids),
      attention_mask=torch.tensor(mask),
      token_type_ids=torch.tensor(types),
    )
  theirs = out.last_hidden_state.numpy()
  real = mask.astype(bool)
  assert _relative_error(ours[real], theirs[real]) <= 1e-4
  original = safetensors.numpy.load_file(os.path.join(directory, 'model.safetensors'))
  exported = hf.params_to_hf('bert', cfg, params)
  assert set(exported) == set(original)
  for key, value in original.items():
    np.testing.assert_array_equal(exported[key], value, err_msg=key)
  assert hf.hf_config('bert', cfg)['architectures'] == ['BertModel']


def test_bert_model_with_pooler_loads(bert_model, tmp_path):
  """A BertModel file that has its pooler (most do): the pooler is not part of hidden states."""
  model, directory = bert_model
  copy = str(tmp_path / 'pooled')
  shutil.copytree(directory, copy)
  path = os.path.join(copy, 'model.safetensors')
  tensors = dict(safetensors.numpy.load_file(path))
  tensors['pooler.dense.weight'] = np.zeros((36, 36), np.float32)
  tensors['pooler.dense.bias'] = np.zeros((36,), np.float32)
  safetensors.numpy.save_file(tensors, path)
  _, cfg, params, _ = hf.convert_in_memory(copy)
  assert not cfg.output_head and 'pooler' not in params


# Bad input ---------------------------------------------------------------------------------------
def _copy(hf_models, tmp_path, name='llama') -> str:
  directory = str(tmp_path / 'input')
  shutil.copytree(hf_models[name][1], directory)
  return directory


def _edit_config(directory: str, **changes) -> None:
  path = os.path.join(directory, 'config.json')
  with open(path) as f:
    config = json.load(f)
  config.update(changes)
  with open(path, 'w') as f:
    json.dump(config, f)


def _refused(source: str, out, message: str) -> None:
  with pytest.raises((ValueError, FileNotFoundError), match=message):
    hf.convert(None, source, str(out))
  assert not os.path.exists(out)
  assert not [n for n in os.listdir(os.path.dirname(out)) if '.partial-' in n]


def test_unknown_rope_type_and_architecture(hf_models, tmp_path):
  directory = _copy(hf_models, tmp_path)
  _edit_config(directory, rope_parameters={'rope_type': 'dynamic', 'factor': 2.0})
  _refused(directory, tmp_path / 'out', r"config.json: rope_parameters.rope_type='dynamic' is not")
  _edit_config(directory, rope_parameters={'rope_type': 'default', 'partial_rotary_factor': 0.5})
  _refused(directory, tmp_path / 'out', r'config.json: partial_rotary_factor=0.5 is not supported')
  _edit_config(directory, model_type='gemma', architectures=['GemmaForCausalLM'])
  _refused(directory, tmp_path / 'out', r"model_type='gemma'.*supported: gpt2, bert, llama, qwen2")


def test_config_that_contradicts_its_tensors(hf_models, tmp_path):
  directory = _copy(hf_models, tmp_path)
  _edit_config(directory, num_key_value_heads=4)
  _refused(
    directory,
    tmp_path / 'out',
    r'config.json.*num_kv_heads=4 does not divide num_heads=6.*num_key_value_heads -> num_kv_heads',
  )
  _edit_config(directory, num_key_value_heads=3)
  _refused(
    directory,
    tmp_path / 'out',
    r"'model.layers.0.self_attn.k_proj.weight' has shape \(20, 48\), but config.json implies "
    r'\(30, 48\)',
  )


def test_missing_and_truncated_shards(hf_models, tmp_path):
  model, _ = hf_models['llama']
  directory = str(tmp_path / 'shards')
  model.save_pretrained(directory, safe_serialization=True, max_shard_size='30KB')
  shards = sorted(n for n in os.listdir(directory) if n.endswith('.safetensors'))
  path = os.path.join(directory, shards[-1])
  with open(path, 'rb') as f:
    data = f.read()
  with open(path, 'wb') as f:
    f.write(data[: len(data) // 2])
  _refused(directory, tmp_path / 'out', rf'{shards[-1]}.*corrupt or truncated')
  os.remove(path)
  _refused(directory, tmp_path / 'out', rf'{shards[-1]}.* does not exist')


def test_tokenizer_larger_than_the_vocabulary(hf_models, tmp_path):
  import tokenizers

  directory = _copy(hf_models, tmp_path)
  words = {f'w{i}': i for i in range(VOCAB + 5)}
  tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token='w0')).save(
    os.path.join(directory, 'tokenizer.json')
  )
  _refused(directory, tmp_path / 'out', r'tokenizer.json.* has 106 tokens but config.json has '
           r'vocab_size=101')  # fmt: skip


def test_pickled_checkpoints_are_refused(hf_models, tmp_path):
  directory = str(tmp_path / 'pickled')
  os.makedirs(directory)
  shutil.copy(os.path.join(hf_models['llama'][1], 'config.json'), directory)
  for name in ('consolidated.00.pth', 'model.pt'):
    with open(os.path.join(directory, name), 'wb') as f:
      f.write(b'never read')
  _refused(directory, tmp_path / 'out', r'consolidated.00.pth, model.pt.*never unpickles.*safetens')
  os.remove(os.path.join(directory, 'config.json'))
  _refused(directory, tmp_path / 'out', 'no config.json in')


def test_cfg_round_trips_through_hf_config(hf_models):
  for name in BUILDERS:
    _, directory = hf_models[name]
    _, cfg, _, _ = hf.convert_in_memory(directory)
    back = hf.model_fields(_arch(name), hf.hf_config(_arch(name), cfg))
    assert ModelConfig.from_config({**cfg.to_dict(), **back}) == cfg, name


# transformer.load on a Hugging Face folder ------------------------------------------------------
def _hf_hidden(model, ids, mask, **kwargs) -> np.ndarray:
  with torch.no_grad():
    out = model(
      input_ids=torch.tensor(ids),
      attention_mask=torch.tensor(mask),
      output_hidden_states=True,
      **{k: torch.tensor(v) for k, v in kwargs.items()},
    )
  return np.stack([h.numpy() for h in out.hidden_states])  # [L + 1, B, T, D]


@pytest.mark.parametrize('name', ['llama', 'qwen2'])
def test_load_folder_hidden_states_match(hf_models, name):
  import transformer

  model, directory = hf_models[name]
  m = transformer.load(directory)
  assert m.cfg.family == 'causal_lm' and m.tokenizer is None
  ids, mask = _batch(9)
  real = mask.astype(bool)
  theirs = _hf_hidden(model, ids, mask)
  ours = m.hidden_states(ids, mask=mask, layers=True)
  assert ours.shape == theirs.shape == (3, 3, LENGTH, 48)
  for layer in range(3):
    assert _relative_error(ours[layer][real], theirs[layer][real]) <= 1e-4, layer
  np.testing.assert_array_equal(m.hidden_states(ids, mask=mask), ours[-1])


def _save_word_tokenizer(directory: str, specials: dict) -> None:
  import tokenizers

  words = ['[PAD]', '[UNK]', '[CLS]', '[SEP]'] + [f'w{i}' for i in range(VOCAB - 4)]
  tok = tokenizers.Tokenizer(
    tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token='[UNK]')
  )
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.add_special_tokens(words[:4])
  tok.post_processor = tokenizers.processors.TemplateProcessing(
    single='[CLS] $A [SEP]', special_tokens=[('[CLS]', 2), ('[SEP]', 3)]
  )
  tok.enable_padding(pad_id=0, length=16)  # as some hub files do: encode() must not pad
  tok.save(os.path.join(directory, 'tokenizer.json'))
  with open(os.path.join(directory, 'tokenizer_config.json'), 'w') as f:
    json.dump(specials, f)


def test_bert_model_embed_matches_mean_pooling(bert_model, tmp_path):
  """embed(): [CLS] text [SEP], the mean of the real tokens' last hidden states, unit norm."""
  import transformer

  model, directory = bert_model
  copy_dir = str(tmp_path / 'bert')
  shutil.copytree(directory, copy_dir)
  _save_word_tokenizer(copy_dir, {'pad_token': '[PAD]', 'cls_token': '[CLS]'})
  m = transformer.load(copy_dir)
  texts = ['w1 w2 w3 w4 w5', 'w7', 'w9 w10 w11']
  ours = m.embed(texts)
  ids = [[2] + [int(w[1:]) + 4 for w in t.split()] + [3] for t in texts]
  tokens = np.zeros((3, 7), np.int64)
  mask = np.zeros((3, 7), np.int64)
  for i, row in enumerate(ids):
    tokens[i, : len(row)], mask[i, : len(row)] = row, 1
  with torch.no_grad():
    hidden = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask))[0].numpy()
  pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
  want = pooled / np.linalg.norm(pooled, axis=-1, keepdims=True)
  np.testing.assert_allclose(ours, want, atol=1e-5)
  cls = m.embed(texts, pooling='cls', normalize=False)
  np.testing.assert_allclose(cls, hidden[:, 0], rtol=1e-4, atol=1e-5)
  with pytest.raises(ValueError, match="pooling='max' is not valid"):
    m.embed(texts, pooling='max')


def test_generate_and_score_text_with_the_models_special_tokens(hf_models, tmp_path):
  """A folder whose tokenizer_config names no bos/eos: config.json's bos/eos ids are used."""
  import transformer

  model, directory = hf_models['llama']
  copy_dir = str(tmp_path / 'llama')
  shutil.copytree(directory, copy_dir)
  _save_word_tokenizer(copy_dir, {'unk_token': '[UNK]'})
  _edit_config(copy_dir, bos_token_id=2, eos_token_id=3)
  m = transformer.load(copy_dir)
  assert (m.tokenizer.bos_id, m.tokenizer.eos_id) == (2, 3)
  prompt = [[2, 5, 6, 7]]  # bos w1 w2 w3
  with torch.no_grad():
    theirs = model.generate(
      torch.tensor(prompt), do_sample=False, max_new_tokens=8, eos_token_id=3, pad_token_id=0
    )[0, 4:].tolist()
  theirs = theirs[: theirs.index(3)] if 3 in theirs else theirs
  want = ' '.join(f'w{t - 4}' for t in theirs if t > 3)
  assert m.generate('w1 w2 w3', max_new_tokens=8) == [want]
  scored = m.score('w1 w2 w3')[0]
  with torch.no_grad():
    logp = torch.log_softmax(model(torch.tensor([[2, 5, 6, 7]])).logits, -1)[0].numpy()
  np.testing.assert_allclose(scored['log_probs'], logp[[0, 1, 2, 3], [5, 6, 7, 3]], atol=1e-4)


@pytest.mark.slow  # about 10 s: a training run in a subprocess
def test_fine_tune_an_imported_model_with_experiments_train(hf_models, tmp_path):
  """convert_hf, then experiments.train from the step-0 checkpoint with the model's tokenizer,
  then the export back: the trained weights moved and still load in transformers."""
  import subprocess
  import sys

  _, directory = hf_models['qwen2']
  source = str(tmp_path / 'qwen2')
  shutil.copytree(directory, source)
  _save_word_tokenizer(source, {'unk_token': '[UNK]'})
  workdir = str(tmp_path / 'run')
  hf.convert(None, source, workdir)
  flags = [
    f'--config=configs/workdir.py:{workdir}',
    f'--workdir={workdir}',
    '--config.train.steps=2',
    '--config.train.eval_every=1000',
    '--config.train.eval_decode_examples=0',
    '--config.train.log_every=1',
    '--config.data.num_train_examples=64',
    '--config.data.num_eval_examples=8',
    '--config.data.batch_size=4',
    '--config.data.eval_batch_size=4',
    '--config.data.max_length=24',
    '--config.optim.schedule=constant',
    '--config.optim.learning_rate=0.01',
  ]
  result = subprocess.run(
    [sys.executable, '-m', 'experiments.train', *flags], capture_output=True, text=True, timeout=600
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert '2' in os.listdir(os.path.join(workdir, 'checkpoints'))
  out = str(tmp_path / 'back')
  assert hf.convert(None, workdir, out, direction='to_hf')['step'] == 2
  before = safetensors.numpy.load_file(os.path.join(directory, 'model.safetensors'))
  after = safetensors.numpy.load_file(os.path.join(out, 'model.safetensors'))
  assert set(after) == set(before)
  assert not np.array_equal(after['model.layers.0.mlp.up_proj.weight'],
                            before['model.layers.0.mlp.up_proj.weight'])  # fmt: skip
  transformers.Qwen2ForCausalLM.from_pretrained(out)


def test_cli_reads_the_arch_from_config_json(bert_model, tmp_path):
  """The reported failure: a BertModel folder (no MLM head), converted without --arch."""
  import subprocess
  import sys

  _, directory = bert_model
  out = tmp_path / 'run'
  cmd = [sys.executable, '-m', 'experiments.convert_hf', f'--input={directory}', f'--workdir={out}']
  result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert 'arch: bert' in result.stdout
  with open(out / 'config.json') as f:
    assert json.load(f)['model']['output_head'] is False
  bad = subprocess.run(
    [*cmd[:3], f'--input={tmp_path}', f'--workdir={tmp_path / "other"}'],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert bad.returncode == 2
  assert bad.stderr.strip().splitlines()[-1].startswith('error: no config.json in')
  assert not (tmp_path / 'other').exists()
