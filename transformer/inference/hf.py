"""Hugging Face GPT-2 and BERT checkpoints (safetensors) to sparrow workdirs, and back.

`import_hf('gpt2', 'downloads/gpt2', 'runs/gpt2')` reads a Hugging Face model directory
(config.json + model.safetensors, optionally tokenizer.json) and writes a sparrow workdir: a full
experiment config.json, a step-0 checkpoint of the training state (so `experiments.train` can
fine-tune it) and, when the input has one, the tokenizer in `tokenizer/`. `export_hf` runs the same
name mapping backwards. Only safetensors are read or written; nothing is ever unpickled.

Dissecting a downloaded small model:
  1. On a machine with network access, fetch the files of e.g. `gpt2` from the Hugging Face Hub
     (config.json, model.safetensors, tokenizer.json, tokenizer_config.json) into a directory.
  2. Copy that directory here and convert it:
       python -m experiments.convert_hf --arch=gpt2 --input=gpt2 --workdir=runs/gpt2
  3. In a notebook, `transformer.load('runs/gpt2')` gives the model, its parameters and the
     tokenizer, ready for `research.inspection` (attention maps, head entropy) or decoding.
  4. Export back (e.g. after fine-tuning) to a Hugging Face directory:
       python -m experiments.convert_hf --arch=gpt2 --direction=to_hf --input=runs/gpt2 \\
         --workdir=gpt2_hf
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so bf16 safetensors load)
import numpy as np

from transformer.config import ModelConfig
from transformer.model import models
from transformer.training import checkpoint, optim
from transformer.training.state import TrainState, create_state, optim_config, state_from_params

ARCHS = ('gpt2', 'bert')
DIRECTIONS = ('from_hf', 'to_hf')
WEIGHTS = 'model.safetensors'
HF_CONFIG = 'hf_config.json'  # the input's config.json, kept in the workdir for the export back
# Files of a Hugging Face tokenizer; tokenizer.json alone is enough for transformer.data.
TOKENIZER_FILES = (
  'tokenizer.json',
  'tokenizer_config.json',
  'special_tokens_map.json',
  'added_tokens.json',
  'vocab.json',
  'merges.txt',
  'vocab.txt',
)
# Prefix of the model body in task models (GPT2LMHeadModel, BertForMaskedLM); heads sit outside.
_BODY_PREFIX = {'gpt2': 'transformer.', 'bert': 'bert.'}
_HEADS = {'gpt2': ('lm_head.',), 'bert': ('cls.', 'classifier.')}
# Config keys both ways: (sparrow model key, config.json key, Hugging Face's default for it).
_CONFIG_KEYS = {
  'gpt2': (
    ('vocab_size', 'vocab_size', 50257),
    ('d_model', 'n_embd', 768),
    ('num_heads', 'n_head', 12),
    ('d_ff', 'n_inner', None),  # None = 4 * n_embd
    ('num_layers', 'n_layer', 12),
    ('max_length', 'n_positions', 1024),
    ('norm_eps', 'layer_norm_epsilon', 1e-5),
    ('activation', 'activation_function', 'gelu_new'),
    ('dropout_rate', 'resid_pdrop', 0.1),  # sparrow's one rate drops the embeddings too
    ('attention_dropout_rate', 'attn_pdrop', 0.1),
    ('init_std', 'initializer_range', 0.02),
    ('tie_output', 'tie_word_embeddings', True),
    ('attention_scale', 'scale_attn_weights', True),
  ),
  'bert': (
    ('vocab_size', 'vocab_size', 30522),
    ('d_model', 'hidden_size', 768),
    ('num_heads', 'num_attention_heads', 12),
    ('d_ff', 'intermediate_size', 3072),
    ('num_layers', 'num_hidden_layers', 12),
    ('max_length', 'max_position_embeddings', 512),
    ('norm_eps', 'layer_norm_eps', 1e-12),
    ('activation', 'hidden_act', 'gelu'),
    ('dropout_rate', 'hidden_dropout_prob', 0.1),
    ('attention_dropout_rate', 'attention_probs_dropout_prob', 0.1),
    ('init_std', 'initializer_range', 0.02),
    ('type_vocab_size', 'type_vocab_size', 2),
    ('pad_id', 'pad_token_id', 0),
  ),
}
# What each architecture fixes, whatever configs/base.py says.
_COMMON = dict(
  position='learned',
  norm='layernorm',
  use_bias=True,
  scale_embeddings=False,
  ffn_dropout_rate=0.0,
  init_distribution='normal',
  num_kv_heads=None,
  head_dim=None,
  window=None,
)
_FIXED = {
  # GPT-2: ln_1/ln_2 before each sub-layer and ln_f at the end. It has no padding token (id 0 is
  # '!'), so pad_id=None: give padded batches their segment ids.
  'gpt2': dict(
    family='causal_lm',
    norm_placement='pre',
    embedding_norm=False,
    type_vocab_size=0,
    num_classes=0,
    pad_id=None,
    init='scaled',
  ),
  # BERT: post-LN, a LayerNorm after the embeddings, the MLM decoder tied to the embedding.
  'bert': dict(
    family='bidirectional_lm',
    norm_placement='post',
    embedding_norm=True,
    tie_output=True,
    attention_scale=True,
    init='plain',
  ),
}
# config.json values that sparrow cannot express: (key, the only value it imports).
_REQUIRED = {
  'gpt2': (('add_cross_attention', False), ('scale_attn_by_inverse_layer_idx', False)),
  'bert': (
    ('add_cross_attention', False),
    ('is_decoder', False),
    ('position_embedding_type', 'absolute'),
  ),
}
_ACTIVATIONS = {'gelu': 'gelu', 'gelu_new': 'gelu_tanh', 'gelu_pytorch_tanh': 'gelu_tanh'}
_ACTIVATIONS['relu'] = 'relu'
_HF_ACTIVATIONS = {'gelu': 'gelu', 'gelu_tanh': 'gelu_new', 'relu': 'relu'}
# Buffers and heads that a sparrow model has no use for (matched after the body prefix is cut).
_IGNORED = {
  'gpt2': (r'h\.\d+\.attn\.(bias|masked_bias)$',),  # causal-mask buffers of old checkpoints
  'bert': (
    r'embeddings\.(position_ids|token_type_ids)$',  # index buffers
    r'cls\.seq_relationship\.',  # the next-sentence-prediction head of BertForPreTraining
  ),
}
_POOLER = r'pooler\.'  # ignored too unless the target has a classifier (num_classes > 0)
# Model keys that change the logits: an export checks them against what the arch can express.
_LOGIT_KEYS = tuple(
  (
    'family vocab_size d_model num_heads kv_heads head_size d_ff num_layers max_length position '
    'norm norm_eps norm_placement embedding_norm activation use_bias scale_embeddings '
    'attention_scale type_vocab_size num_classes window'
  ).split()
)


# Configs ---------------------------------------------------------------------------------------
def _check_arch(arch: str) -> None:
  if arch not in ARCHS:
    raise ValueError(f'arch={arch!r} is not supported; choose one of {", ".join(ARCHS)}')


def _num_classes(hf: dict) -> int:
  """Classes of a *ForSequenceClassification checkpoint; 0 for an LM."""
  if not any(a.endswith('ForSequenceClassification') for a in hf.get('architectures') or []):
    return 0
  return len(hf['id2label']) if hf.get('id2label') else int(hf.get('num_labels', 2))


def model_fields(arch: str, hf: dict) -> dict[str, Any]:
  """The sparrow `config.model` fields of a Hugging Face config.json dict of `arch`."""
  _check_arch(arch)
  model_type = hf.get('model_type')
  if model_type is not None and model_type != arch:
    valid = f'--arch={model_type}' if model_type in ARCHS else f'one of {", ".join(ARCHS)}'
    raise ValueError(f'config.json has model_type={model_type!r} but arch={arch!r}; use {valid}')
  for key, only in _REQUIRED[arch]:
    if hf.get(key) not in (None, only):
      raise ValueError(
        f'config.json has {key}={hf[key]!r}; sparrow imports {arch} with {key}={only!r} only'
      )
  fields = {**_COMMON, **_FIXED[arch]}
  for key, hf_key, default in _CONFIG_KEYS[arch]:
    fields[key] = hf[hf_key] if hf.get(hf_key) is not None else default
  act_key = dict((k, h) for k, h, _ in _CONFIG_KEYS[arch])['activation']
  if fields['activation'] not in _ACTIVATIONS:
    raise ValueError(
      f'config.json has {act_key}={fields["activation"]!r}, which sparrow does not implement; '
      f'supported: {", ".join(_ACTIVATIONS)}'
    )
  fields['activation'] = _ACTIVATIONS[fields['activation']]
  if arch == 'gpt2':
    fields['d_ff'] = fields['d_ff'] or 4 * fields['d_model']
  else:
    fields['num_classes'] = _num_classes(hf)
  return fields


def experiment_config(arch: str, hf: dict, name: str) -> ml_collections.ConfigDict:
  """A full sparrow experiment config (configs/base.py) for a Hugging Face config.json dict."""
  from configs import base

  config = base.get_config()
  config.name = name
  for key, value in model_fields(arch, hf).items():
    setattr(config.model, key, value)
  # Fine-tuning rows, and eval prompts (half a row) plus their continuation, fit the positions.
  config.data.max_length = min(config.data.max_length, config.model.max_length)
  room = config.model.max_length - (config.data.max_length // 2 + 1)
  config.train.max_decode_length = max(1, min(config.train.max_decode_length, room))
  ModelConfig.from_config(config.model)  # a bad size fails here, before anything is written
  return config


def hf_config(arch: str, cfg: ModelConfig, original: dict | None = None) -> dict[str, Any]:
  """The Hugging Face config.json of a sparrow model, over `original` (the imported one)."""
  _check_arch(arch)
  hf = dict(original or {})
  head = 'GPT2LMHeadModel' if arch == 'gpt2' else 'BertForMaskedLM'
  if cfg.num_classes:
    head = 'BertForSequenceClassification'
  hf.update(model_type=arch, architectures=[head], **dict(_REQUIRED[arch]))
  for key, hf_key, _ in _CONFIG_KEYS[arch]:
    hf[hf_key] = getattr(cfg, key)
    if key == 'activation':
      hf[hf_key] = _HF_ACTIVATIONS.get(cfg.activation, cfg.activation)
  if arch == 'gpt2':
    hf['embd_pdrop'] = cfg.dropout_rate
  else:
    hf['tie_word_embeddings'] = True
  if cfg.num_classes and len(hf.get('id2label') or {}) != cfg.num_classes:
    hf['id2label'] = {str(i): f'LABEL_{i}' for i in range(cfg.num_classes)}
    hf['label2id'] = {f'LABEL_{i}': i for i in range(cfg.num_classes)}
  return hf


def check_exportable(arch: str, cfg: ModelConfig) -> None:
  """Raises one ValueError naming the first model field that `arch` cannot express."""
  _check_arch(arch)
  if cfg.activation not in _HF_ACTIVATIONS:
    valid = ', '.join(_HF_ACTIVATIONS)
    raise ValueError(
      f'cannot export activation={cfg.activation!r} as {arch}; it needs one of {valid}'
    )
  if arch == 'bert' and cfg.type_vocab_size < 1:
    raise ValueError('cannot export this model as bert: BERT needs token types, model has none')
  try:
    back = ModelConfig.from_config({**cfg.to_dict(), **model_fields(arch, hf_config(arch, cfg))})
  except ValueError as e:
    raise ValueError(f'cannot export this model as {arch}: {e}') from e
  for key in _LOGIT_KEYS + (('tie_output',) if arch == 'gpt2' else ()):
    mine, theirs = getattr(cfg, key), getattr(back, key)
    if mine != theirs:
      raise ValueError(
        f'cannot export this model as {arch}: model.{key} is {mine!r}, but {arch} has {theirs!r}'
      )


# The name mapping ------------------------------------------------------------------------------
Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class _Rule:
  """Some Hugging Face tensors <-> some sparrow parameters, with the transforms both ways.

  Each entry of `hf` is a tuple of names of ONE tensor: the canonical name, then aliases that a
  file may hold instead or as well (tied copies, old LayerNorm names); copies must be equal.
  """

  hf: tuple[tuple[str, ...], ...]
  sparrow: tuple[Path, ...]
  to_sparrow: Callable[..., tuple]  # HF arrays -> sparrow arrays
  to_hf: Callable[..., tuple]  # sparrow arrays -> HF arrays


def _one(hf: str | tuple[str, ...], path: Path, forward=lambda x: x, backward=lambda x: x):
  names = (hf,) if isinstance(hf, str) else hf
  return _Rule((names,), (path,), lambda x: (forward(x),), lambda y: (backward(y),))


def _norm(hf_prefix: str, path: Path) -> list[_Rule]:
  """LayerNorm weight/bias (old BERT files: gamma/beta) <-> Norm scale/bias."""
  return [
    _one((f'{hf_prefix}.weight', f'{hf_prefix}.gamma'), path + ('scale',)),
    _one((f'{hf_prefix}.bias', f'{hf_prefix}.beta'), path + ('bias',)),
  ]


def _linear(hf_prefix: str, path: Path) -> list[_Rule]:
  """torch nn.Linear weight [out, in] <-> flax Dense kernel [in, out]; biases as they are."""
  return [
    _one(f'{hf_prefix}.weight', path + ('kernel',), jnp.transpose, jnp.transpose),
    _one(f'{hf_prefix}.bias', path + ('bias',)),
  ]


def _gpt2_rules(cfg: ModelConfig) -> list[_Rule]:
  """GPT2LMHeadModel names (body prefix cut) <-> CausalLM. Conv1D weights are [in, out]."""
  N, H = cfg.num_heads, cfg.head_size
  rules = [
    _one(('wte.weight', 'lm_head.weight') if cfg.tie_output else 'wte.weight', ('embedding',) * 2),
    _one('wpe.weight', ('decoder', 'embedder', 'positions', 'positions', 'embedding')),
    *_norm('ln_f', ('decoder', 'stack', 'final_norm')),
  ]
  if not cfg.tie_output:
    rules.append(_one('lm_head.weight', ('head', 'logits', 'kernel'), jnp.transpose, jnp.transpose))
  for i in range(cfg.num_layers):
    h, s = f'h.{i}', ('decoder', 'stack', f'layer_{i}')
    qkv = tuple(s + ('self_attention', n) for n in ('query', 'key', 'value'))
    rules += [
      *_norm(f'{h}.ln_1', s + ('self_attention_norm',)),
      _Rule(  # fused c_attn [D, 3*N*H] -> query/key/value kernels [D, N, H]
        ((f'{h}.attn.c_attn.weight',),),
        tuple(p + ('kernel',) for p in qkv),
        lambda w: tuple(w.reshape(w.shape[0], 3, N, H)[:, j] for j in range(3)),
        lambda q, k, v: (jnp.stack([q, k, v], 1).reshape(q.shape[0], 3 * N * H),),
      ),
      _Rule(  # fused bias [3*N*H] -> [N, H] each
        ((f'{h}.attn.c_attn.bias',),),
        tuple(p + ('bias',) for p in qkv),
        lambda b: tuple(b.reshape(3, N, H)),
        lambda q, k, v: (jnp.stack([q, k, v]).reshape(3 * N * H),),
      ),
      _one(  # c_proj [N*H, D] <-> out kernel [N, H, D]
        f'{h}.attn.c_proj.weight',
        s + ('self_attention', 'out', 'kernel'),
        lambda w: w.reshape(N, H, -1),
        lambda o: o.reshape(N * H, -1),
      ),
      _one(f'{h}.attn.c_proj.bias', s + ('self_attention', 'out', 'bias')),
      *_norm(f'{h}.ln_2', s + ('mlp_norm',)),
      _one(f'{h}.mlp.c_fc.weight', s + ('mlp', 'wi', 'kernel')),  # [D, F] both sides
      _one(f'{h}.mlp.c_fc.bias', s + ('mlp', 'wi', 'bias')),
      _one(f'{h}.mlp.c_proj.weight', s + ('mlp', 'wo', 'kernel')),  # [F, D] both sides
      _one(f'{h}.mlp.c_proj.bias', s + ('mlp', 'wo', 'bias')),
    ]
  return rules


def _bert_rules(cfg: ModelConfig) -> list[_Rule]:
  """BertForMaskedLM / BertForSequenceClassification names (body prefix cut) <-> BidirectionalLM."""
  N, H = cfg.num_heads, cfg.head_size
  e = ('encoder', 'embedder')
  rules = [
    _one(
      ('embeddings.word_embeddings.weight', 'cls.predictions.decoder.weight'), ('embedding',) * 2
    ),
    _one('embeddings.position_embeddings.weight', e + ('positions', 'positions', 'embedding')),
    _one('embeddings.token_type_embeddings.weight', e + ('token_types', 'embedding')),
    *_norm('embeddings.LayerNorm', e + ('norm',)),
  ]
  for i in range(cfg.num_layers):
    h, s = f'encoder.layer.{i}', ('encoder', 'stack', f'layer_{i}')
    for name in ('query', 'key', 'value'):
      rules += [
        _one(  # [N*H, D] (out, in) <-> [D, N, H]
          f'{h}.attention.self.{name}.weight',
          s + ('self_attention', name, 'kernel'),
          lambda w: w.T.reshape(-1, N, H),
          lambda k: k.reshape(k.shape[0], N * H).T,
        ),
        _one(
          f'{h}.attention.self.{name}.bias',
          s + ('self_attention', name, 'bias'),
          lambda b: b.reshape(N, H),
          lambda b: b.reshape(N * H),
        ),
      ]
    rules += [
      _one(  # [D, N*H] (out, in) <-> [N, H, D]
        f'{h}.attention.output.dense.weight',
        s + ('self_attention', 'out', 'kernel'),
        lambda w: w.T.reshape(N, H, -1),
        lambda o: o.reshape(N * H, -1).T,
      ),
      _one(f'{h}.attention.output.dense.bias', s + ('self_attention', 'out', 'bias')),
      *_norm(f'{h}.attention.output.LayerNorm', s + ('self_attention_norm',)),
      *_linear(f'{h}.intermediate.dense', s + ('mlp', 'wi')),
      *_linear(f'{h}.output.dense', s + ('mlp', 'wo')),
      *_norm(f'{h}.output.LayerNorm', s + ('mlp_norm',)),
    ]
  if cfg.num_classes:
    return rules + _linear('pooler.dense', ('pooler',)) + _linear('classifier', ('classifier',))
  return rules + [
    *_linear('cls.predictions.transform.dense', ('mlm_dense',)),
    *_norm('cls.predictions.transform.LayerNorm', ('mlm_norm',)),
    _one(('cls.predictions.bias', 'cls.predictions.decoder.bias'), ('mlm_bias',)),
  ]


def _rules(arch: str, cfg: ModelConfig) -> list[_Rule]:
  return _gpt2_rules(cfg) if arch == 'gpt2' else _bert_rules(cfg)


def _flat(tree: Any) -> dict[Path, Any]:
  """{('decoder', 'stack', ...): leaf} of a nested dict of parameters."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    out[tuple(str(getattr(k, 'key', k)) for k in path)] = leaf
  return out


def _nest(flat: dict[Path, Any]) -> dict:
  out: dict = {}
  for path, leaf in flat.items():
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = leaf
  return out


def _targets(cfg: ModelConfig) -> dict[Path, jax.ShapeDtypeStruct]:
  """Every sparrow parameter of `cfg` as a ShapeDtypeStruct (layers unscanned)."""
  return _flat(models.param_shapes(cfg.replace(scan_layers=False)))


def _shape(x: Any) -> tuple[int, ...]:
  return tuple(int(d) for d in x.shape)


def params_from_hf(
  arch: str,
  cfg: ModelConfig,
  tensors: dict[str, np.ndarray],
  where: str = WEIGHTS,
  shapes: Any = None,
) -> dict:
  """Sparrow parameters (float32 nested dicts) from the Hugging Face `tensors` of `arch`.

  Every parameter is filled exactly once and every tensor is used, except the buffers and heads in
  `_IGNORED`; otherwise one ValueError names the tensor, its shape and the expected shape.
  `shapes`: the parameters' ShapeDtypeStructs when known (default: traced from `cfg`).
  """
  _check_arch(arch)
  names = _strip_prefix(arch, tensors, where)  # short name -> name in the file
  prefixed = any(n != names[n] for n in names)  # name missing tensors as the file would
  shown_name = lambda short: _full(arch, short) if prefixed else short
  targets = _flat(shapes) if shapes is not None else _targets(cfg)
  rules = _rules(arch, cfg)
  used = {n for rule in rules for aliases in rule.hf for n in aliases if n in names}
  ignored = _IGNORED[arch] + (() if cfg.num_classes else (_POOLER,))
  unused = [n for n in names if n not in used and not any(re.match(p, n) for p in ignored)]
  unused_note = ''
  if unused:
    shown = ', '.join(f'{names[n]!r} {_shape(tensors[names[n]])}' for n in unused[:4])
    unused_note = f'; the file also has tensors that map to nothing: {shown}'
  flat: dict[Path, Any] = {}
  for rule in rules:
    expected = jax.eval_shape(rule.to_hf, *(targets[p] for p in rule.sparrow))
    arrays = []
    for aliases, want in zip(rule.hf, expected):
      present = [n for n in aliases if n in names]
      if not present:
        raise ValueError(
          f'{where} has no tensor {shown_name(aliases[0])!r} (expected shape '
          f'{_shape(want)}) that the {arch} config needs{unused_note}'
        )
      for n in present:
        got = _shape(tensors[names[n]])
        if got != _shape(want):
          raise ValueError(
            f'{where}: tensor {names[n]!r} has shape {got}, but config.json implies '
            f'{_shape(want)}; the weights do not belong to this config.json'
          )
      first = np.asarray(tensors[names[present[0]]], np.float32)
      for n in present[1:]:
        if not np.array_equal(first, np.asarray(tensors[names[n]], np.float32)):
          raise ValueError(
            f'{where}: tensor {names[n]!r} {_shape(want)} differs from {names[present[0]]!r}; '
            'sparrow holds one parameter for both (tied weights), so they must be equal'
          )
      arrays.append(first)
    for path, value in zip(rule.sparrow, rule.to_sparrow(*arrays)):
      if path in flat:
        raise AssertionError(f'sparrow parameter {"/".join(path)} is mapped twice')
      flat[path] = np.asarray(value, np.float32)
  if unused:
    raise ValueError(
      f'{where}: tensor {names[unused[0]]!r} of shape {_shape(tensors[names[unused[0]]])} maps to '
      f'no sparrow parameter: a {arch} model with this config.json has no such tensor'
    )
  missing = sorted(set(targets) - set(flat))
  if missing:
    raise AssertionError(f'no rule fills sparrow parameter {"/".join(missing[0])}')
  return _nest(flat)


def params_to_hf(arch: str, cfg: ModelConfig, params: Any) -> dict[str, np.ndarray]:
  """Hugging Face tensors (canonical task-model names) from sparrow parameters of `cfg`."""
  _check_arch(arch)
  flat = _flat(params)
  if cfg.scan_layers:  # ('stack', 'layers', ...) [L, ...] -> ('stack', 'layer_i', ...)
    flat = _unscan(flat, cfg.num_layers)
  tensors = {}
  for rule in _rules(arch, cfg):
    outputs = rule.to_hf(*(jnp.asarray(flat.pop(p)) for p in rule.sparrow))
    for aliases, value in zip(rule.hf, outputs):
      tensors[_full(arch, aliases[0])] = np.ascontiguousarray(np.asarray(value, np.float32))
  if flat:
    raise AssertionError(f'no rule exports sparrow parameter {"/".join(next(iter(flat)))}')
  return tensors


def _unscan(flat: dict[Path, Any], num_layers: int) -> dict[Path, Any]:
  out = {}
  for path, value in flat.items():
    if 'layers' in path:
      i = path.index('layers')
      for layer in range(num_layers):
        out[path[:i] + (f'layer_{layer}',) + path[i + 1 :]] = value[layer]
    else:
      out[path] = value
  return out


def _full(arch: str, name: str) -> str:
  """The canonical name in a Hugging Face task model: the body under its prefix."""
  return name if name.startswith(_HEADS[arch]) else _BODY_PREFIX[arch] + name


def _strip_prefix(arch: str, tensors: dict, where: str) -> dict[str, str]:
  """{name without the body prefix: name in the file}; files may or may not use the prefix."""
  prefix, out = _BODY_PREFIX[arch], {}
  for name in tensors:
    short = name[len(prefix) :] if name.startswith(prefix) else name
    if short in out:
      raise ValueError(f'{where} has both {out[short]!r} and {name!r}; keep one of them')
    out[short] = name
  return out


# Reading and writing ---------------------------------------------------------------------------
def read_hf_dir(path: str) -> tuple[str, dict, dict[str, np.ndarray]]:
  """(directory, config.json dict, tensors) of a Hugging Face model directory or its weights file.

  Reads safetensors only (one file, or shards listed in model.safetensors.index.json).
  """
  if not path or not os.path.exists(path):
    raise FileNotFoundError(f'input {path!r} does not exist; give a Hugging Face model directory')
  directory = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
  config_path = os.path.join(directory, 'config.json')
  if not os.path.isfile(config_path):
    raise FileNotFoundError(
      f'no config.json in {directory!r}; --input must be a Hugging Face model'
    )
  try:
    with open(config_path) as f:
      hf = json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f'cannot read {config_path!r} as JSON: {e}') from e
  if not isinstance(hf, dict):
    raise ValueError(f'{config_path!r} holds no JSON object')
  if os.path.isfile(path):
    files = [path]
  elif os.path.isfile(os.path.join(directory, WEIGHTS)):
    files = [os.path.join(directory, WEIGHTS)]
  elif os.path.isfile(os.path.join(directory, WEIGHTS + '.index.json')):
    files = _shards(os.path.join(directory, WEIGHTS + '.index.json'))
  else:
    pickled = [
      n for n in ('pytorch_model.bin', 'tf_model.h5') if os.path.exists(os.path.join(directory, n))
    ]
    found = f'it has only {", ".join(pickled)}, which' if pickled else 'other formats'
    raise ValueError(
      f'no {WEIGHTS} in {directory!r}: sparrow reads safetensors only, and {found} it never '
      'unpickles. Convert elsewhere with transformers: '
      'AutoModel.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)'
    )
  tensors: dict[str, np.ndarray] = {}
  for file in files:
    tensors.update(_load_safetensors(file))
  return directory, hf, tensors


def _shards(index_path: str) -> list[str]:
  try:
    with open(index_path) as f:
      weight_map = json.load(f)['weight_map']
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ValueError(f'cannot read the shard index {index_path!r}: {e}') from e
  directory = os.path.dirname(index_path)
  return [os.path.join(directory, name) for name in sorted(set(weight_map.values()))]


def _load_safetensors(file: str) -> dict[str, np.ndarray]:
  from safetensors import safe_open

  if not os.path.isfile(file):
    raise FileNotFoundError(f'weights file {file!r} does not exist')
  try:
    with safe_open(file, framework='np') as f:
      return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
  except Exception as e:  # the Rust SafetensorError and friends: corrupt, truncated, bad dtype
    raise ValueError(
      f'cannot read {file!r} as safetensors ({type(e).__name__}: {e}); the file is corrupt or '
      'truncated: download it again'
    ) from e


def _check_out(out: str) -> None:
  """Refuses an output that exists and is not an empty directory."""
  if not os.path.exists(out):
    return
  if not os.path.isdir(out):
    raise ValueError(f'output {out!r} exists and is not a directory; choose a new --workdir')
  if os.listdir(out):
    what = 'checkpoints' if os.path.isdir(os.path.join(out, 'checkpoints')) else 'files'
    raise ValueError(
      f'output {out!r} already holds {what}; refusing to overwrite it: choose a new --workdir'
    )


@contextlib.contextmanager
def _staged(out: str) -> Iterator[str]:
  """A fresh directory beside `out` (same filesystem), renamed to `out` only if the body succeeds.

  An error or interruption leaves `out` as it was: nothing partial is ever visible there.
  """
  out = os.path.abspath(out)
  _check_out(out)
  parent = os.path.dirname(out)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f'.{os.path.basename(out)}.partial-', dir=parent)
  try:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; give it a normal directory's mode
    yield tmp
    _check_out(out)  # again: someone may have written there meanwhile
    if os.path.isdir(out):
      os.rmdir(out)  # empty, checked above
    os.rename(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def _copy_tokenizer(src: str, dst: str) -> bool:
  """Copies a Hugging Face tokenizer (needs tokenizer.json) from `src` into `dst`."""
  if not os.path.isfile(os.path.join(src, 'tokenizer.json')):
    return False
  os.makedirs(dst, exist_ok=True)
  for name in TOKENIZER_FILES:
    if os.path.isfile(os.path.join(src, name)):
      shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
  return True


def _optimizer(config: ml_collections.ConfigDict, cfg: ModelConfig):
  return optim.make_optimizer(optim_config(config, cfg))


def abstract_state(config: ml_collections.ConfigDict, cfg: ModelConfig) -> TrainState:
  """The ShapeDtypeStructs of the training state of `config`: what a checkpoint must match."""
  model, tx = models.build(cfg), _optimizer(config, cfg)
  make = lambda: create_state(model, cfg, tx, config.seed, config.train.loss_scale)
  return jax.eval_shape(make)


def _check_state(state: Any, abstract: Any) -> None:
  got = {p: (x.shape, x.dtype) for p, x in _flat(state).items()}
  want = {p: (x.shape, x.dtype) for p, x in _flat(abstract).items()}
  if got != want:
    diff = sorted(set(got.items()) ^ set(want.items()), key=str)[0]
    raise AssertionError(f'converted state differs from the training state at {diff}')


# The two directions ----------------------------------------------------------------------------
def import_hf(arch: str, input_path: str, workdir: str) -> dict[str, Any]:
  """Converts the Hugging Face model at `input_path` into a new sparrow workdir `workdir`.

  Writes config.json (+ git_revision.txt), hf_config.json, checkpoints/0 (a full TrainState with
  fresh optimizer moments) and tokenizer/ when the input has tokenizer.json. Everything is built
  beside `workdir` and renamed into place at the end. Returns a summary.
  """
  _check_arch(arch)
  _check_out(os.path.abspath(workdir))  # fail before reading gigabytes
  directory, hf, tensors = read_hf_dir(input_path)
  name = re.sub(r'[^A-Za-z0-9_.-]+', '_', os.path.basename(os.path.normpath(directory)))
  config = experiment_config(arch, hf, name=f'hf_{name}')
  cfg = ModelConfig.from_config(config.model)
  abstract = abstract_state(config, cfg)
  where = input_path if os.path.isfile(input_path) else os.path.join(directory, WEIGHTS)
  params = params_from_hf(arch, cfg, tensors, where, shapes=abstract.params)
  params = jax.tree_util.tree_map(jnp.asarray, params)
  state = state_from_params(params, _optimizer(config, cfg))
  _check_state(state, abstract)
  with _staged(workdir) as tmp:
    checkpoint.write_run_metadata(tmp, config)
    with open(os.path.join(tmp, HF_CONFIG), 'w') as f:
      json.dump(hf, f, indent=2)
    ckpt = checkpoint.Checkpointer(tmp, keep=config.train.keep_checkpoints)
    try:
      ckpt.save(0, state, data_state={})
    finally:
      ckpt.close()
    tokenizer = _copy_tokenizer(directory, os.path.join(tmp, 'tokenizer'))
  return {
    'workdir': os.path.abspath(workdir),
    'parameters': int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params))),
    'tensors': len(tensors),
    'tokenizer': tokenizer,
  }


def export_hf(arch: str, workdir: str, out: str, step: int | None = None) -> dict[str, Any]:
  """Writes the sparrow workdir's checkpoint (latest, or `step`) as a Hugging Face directory.

  `out` gets config.json, model.safetensors and the tokenizer files when the workdir holds a
  Hugging Face tokenizer; it is built beside `out` and renamed into place at the end.
  """
  _check_arch(arch)
  _check_out(os.path.abspath(out))
  saved = checkpoint.read_run_config(workdir) if os.path.isdir(workdir) else None
  if saved is None:
    raise FileNotFoundError(f'no config.json in {workdir!r}; --input must be a sparrow workdir')
  config = ml_collections.ConfigDict(saved)
  cfg = ModelConfig.from_config(config.model)
  check_exportable(arch, cfg)
  if not os.path.isdir(os.path.join(workdir, 'checkpoints')):
    raise FileNotFoundError(f'no checkpoint in {workdir!r}; train or import first')
  ckpt = checkpoint.Checkpointer(workdir)
  try:
    state, _, step = ckpt.restore(abstract_state(config, cfg), step)
  finally:
    ckpt.close()
  tensors = params_to_hf(arch, cfg, jax.device_get(state.params))
  original = None
  if os.path.isfile(os.path.join(workdir, HF_CONFIG)):
    with open(os.path.join(workdir, HF_CONFIG)) as f:
      original = json.load(f)
  from safetensors.numpy import save_file

  with _staged(out) as tmp:
    with open(os.path.join(tmp, 'config.json'), 'w') as f:
      json.dump(hf_config(arch, cfg, original), f, indent=2)
    save_file(tensors, os.path.join(tmp, WEIGHTS), metadata={'format': 'pt'})
    tokenizer = _copy_tokenizer(os.path.join(workdir, 'tokenizer'), tmp)
  return {
    'output': os.path.abspath(out),
    'step': step,
    'tensors': len(tensors),
    'tokenizer': tokenizer,
  }


def convert(arch: str, input_path: str, output: str, direction: str = 'from_hf') -> dict:
  """`import_hf` ('from_hf') or `export_hf` ('to_hf'): what experiments.convert_hf runs."""
  if direction not in DIRECTIONS:
    raise ValueError(f'direction={direction!r} is not valid; choose one of {", ".join(DIRECTIONS)}')
  _check_arch(arch)
  if direction == 'from_hf':
    return import_hf(arch, input_path, output)
  return export_hf(arch, input_path, output)
