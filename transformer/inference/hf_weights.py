"""The tensors of Hugging Face checkpoints <-> sparrow parameters: one rule per tensor group, and
a safetensors reader that streams tensor by tensor (only headers are read up front).

Nothing is ever unpickled: only safetensors files are read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so bf16 safetensors load)
import numpy as np
from flax import traverse_util

from transformer import util
from transformer.config import ModelConfig
from transformer.inference.hf_config import GEMMA, LLAMA_FAMILY, check_arch
from transformer.model import models, scan

WEIGHTS = 'model.safetensors'
# Prefix of the model body in task models (GPT2LMHeadModel, BertForMaskedLM, LlamaForCausalLM).
_BODY_PREFIX = {'gpt2': 'transformer.', 'bert': 'bert.', **{a: 'model.' for a in LLAMA_FAMILY}}
_BODY_PREFIX.update(
  gpt_neox='gpt_neox.', gpt_neo='transformer.', gemma2='model.', gemma3_text='model.'
)
# GPT-NeoX's head: embed_out in the Hub's files, lm_head from transformers 5 on.
_HEADS = {
  'gpt2': ('lm_head.',),
  'bert': ('cls.', 'classifier.'),
  'gpt_neox': ('embed_out.', 'lm_head.'),
}
_HEADS.update({a: ('lm_head.',) for a in (*LLAMA_FAMILY, 'gpt_neo', *GEMMA)})
# Buffers and heads that a sparrow model has no use for (matched after the body prefix is cut).
_IGNORED = {
  'gpt2': (r'h\.\d+\.attn\.(bias|masked_bias)$',),  # causal-mask buffers of old checkpoints
  'bert': (
    r'embeddings\.(position_ids|token_type_ids)$',  # index buffers
    r'cls\.seq_relationship\.',  # the next-sentence-prediction head of BertForPreTraining
  ),
}
_IGNORED.update({a: (r'layers\.\d+\.self_attn\.rotary_emb\.inv_freq$',) for a in LLAMA_FAMILY})
# Old GPT-NeoX files keep the causal mask and the rotary frequencies as buffers.
_IGNORED['gpt_neox'] = (r'layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)$',)
_IGNORED['gpt_neo'] = (r'h\.\d+\.attn\.attention\.(bias|masked_bias)$',)
_IGNORED.update({a: (r'layers\.\d+\.self_attn\.rotary_emb\.inv_freq$',) for a in GEMMA})
_POOLER = r'pooler\.'  # ignored too unless the target has a classifier (num_classes > 0)
_SAFETENSORS_NAMES = {'F32': 'float32', 'BF16': 'bfloat16', 'F16': 'float16'}


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


def _split_heads(name: str, path: Path, heads: int, H: int) -> _Rule:
  """torch Linear weight [heads*H, D] (out, in) <-> a q/k/v kernel [D, heads, H]."""
  return _one(
    name, path, lambda w: w.T.reshape(-1, heads, H), lambda k: k.reshape(k.shape[0], heads * H).T
  )


def _merge_heads(name: str, path: Path, heads: int, H: int) -> _Rule:
  """torch Linear weight [D, heads*H] (out, in) <-> the output kernel [heads, H, D]."""
  return _one(name, path, lambda w: w.T.reshape(heads, H, -1), lambda o: o.reshape(heads * H, -1).T)


def _head_bias(name: str, path: Path, heads: int, H: int) -> _Rule:
  """A q/k/v bias [heads*H] <-> [heads, H]."""
  return _one(name, path, lambda b: b.reshape(heads, H), lambda b: b.reshape(heads * H))


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
        _split_heads(
          f'{h}.attention.self.{name}.weight', s + ('self_attention', name, 'kernel'), N, H
        ),
        _head_bias(f'{h}.attention.self.{name}.bias', s + ('self_attention', name, 'bias'), N, H),
      ]
    rules += [
      _merge_heads(
        f'{h}.attention.output.dense.weight', s + ('self_attention', 'out', 'kernel'), N, H
      ),
      _one(f'{h}.attention.output.dense.bias', s + ('self_attention', 'out', 'bias')),
      *_norm(f'{h}.attention.output.LayerNorm', s + ('self_attention_norm',)),
      *_linear(f'{h}.intermediate.dense', s + ('mlp', 'wi')),
      *_linear(f'{h}.output.dense', s + ('mlp', 'wo')),
      *_norm(f'{h}.output.LayerNorm', s + ('mlp_norm',)),
    ]
  if cfg.num_classes:
    return rules + _linear('pooler.dense', ('pooler',)) + _linear('classifier', ('classifier',))
  if not cfg.output_head:  # BertModel: the encoder alone
    return rules
  return rules + [
    *_linear('cls.predictions.transform.dense', ('mlm_dense',)),
    *_norm('cls.predictions.transform.LayerNorm', ('mlm_norm',)),
    _one(('cls.predictions.bias', 'cls.predictions.decoder.bias'), ('mlm_bias',)),
  ]


def _llama_rules(cfg: ModelConfig) -> list[_Rule]:
  """LlamaForCausalLM and kin (Qwen2/3, Mistral; body prefix cut) <-> CausalLM.

  q/k/v_proj [N*H, D] and o_proj [D, N*H] (torch Linear, [out, in]) <-> [D, N, H] and [N, H, D].
  """
  N, K, H = cfg.num_heads, cfg.kv_heads, cfg.head_size
  qkv_bias = cfg.use_bias if cfg.qkv_bias is None else cfg.qkv_bias
  tied = ('embed_tokens.weight', 'lm_head.weight') if cfg.tie_output else 'embed_tokens.weight'
  rules = [
    _one(tied, ('embedding',) * 2),
    _one('norm.weight', ('decoder', 'stack', 'final_norm', 'scale')),
  ]
  if not cfg.tie_output:
    rules.append(_one('lm_head.weight', ('head', 'logits', 'kernel'), jnp.transpose, jnp.transpose))
  for i in range(cfg.num_layers):
    h, s = f'layers.{i}', ('decoder', 'stack', f'layer_{i}')
    a = s + ('self_attention',)
    rules.append(_one(f'{h}.input_layernorm.weight', s + ('self_attention_norm', 'scale')))
    for name, proj, heads in (('query', 'q', N), ('key', 'k', K), ('value', 'v', K)):
      rules.append(
        _split_heads(f'{h}.self_attn.{proj}_proj.weight', a + (name, 'kernel'), heads, H)
      )
      if qkv_bias:
        rules.append(_head_bias(f'{h}.self_attn.{proj}_proj.bias', a + (name, 'bias'), heads, H))
    rules.append(_merge_heads(f'{h}.self_attn.o_proj.weight', a + ('out', 'kernel'), N, H))
    if cfg.use_bias:
      rules.append(_one(f'{h}.self_attn.o_proj.bias', a + ('out', 'bias')))
    if cfg.qk_norm:
      rules.append(_one(f'{h}.self_attn.q_norm.weight', a + ('query_norm', 'scale')))
      rules.append(_one(f'{h}.self_attn.k_norm.weight', a + ('key_norm', 'scale')))
    rules.append(_one(f'{h}.post_attention_layernorm.weight', s + ('mlp_norm', 'scale')))
    for proj, name in (('gate_proj', 'gate'), ('up_proj', 'wi'), ('down_proj', 'wo')):
      linear = _linear(f'{h}.mlp.{proj}', s + ('mlp', name))
      rules += linear if cfg.use_bias else linear[:1]
  return rules


def _neox_rules(cfg: ModelConfig) -> list[_Rule]:
  """GPTNeoXForCausalLM (Pythia; body prefix cut) <-> CausalLM. The fused query_key_value [N*3*H, D]
  interleaves by head: head n's q, k and v are rows (n, 0..2, :) of [N, 3, H]."""
  N, H = cfg.num_heads, cfg.head_size
  head = ('embed_out.weight', 'lm_head.weight')
  rules = [
    _one(('embed_in.weight', *head) if cfg.tie_output else 'embed_in.weight', ('embedding',) * 2),
    *_norm('final_layer_norm', ('decoder', 'stack', 'final_norm')),
  ]
  if not cfg.tie_output:
    rules.append(_one(head, ('head', 'logits', 'kernel'), jnp.transpose, jnp.transpose))
  for i in range(cfg.num_layers):
    h, s = f'layers.{i}', ('decoder', 'stack', f'layer_{i}')
    qkv = tuple(s + ('self_attention', n) for n in ('query', 'key', 'value'))
    rules += [
      *_norm(f'{h}.input_layernorm', s + ('self_attention_norm',)),
      _Rule(  # [N*3*H, D] -> query/key/value kernels [D, N, H]
        ((f'{h}.attention.query_key_value.weight',),),
        tuple(p + ('kernel',) for p in qkv),
        lambda w: tuple(w.reshape(N, 3, H, -1)[:, j].transpose(2, 0, 1) for j in range(3)),
        lambda q, k, v: (jnp.stack([q, k, v], 2).transpose(1, 2, 3, 0).reshape(N * 3 * H, -1),),
      ),
      _Rule(  # [N*3*H] -> [N, H] each
        ((f'{h}.attention.query_key_value.bias',),),
        tuple(p + ('bias',) for p in qkv),
        lambda b: tuple(b.reshape(N, 3, H)[:, j] for j in range(3)),
        lambda q, k, v: (jnp.stack([q, k, v], 1).reshape(N * 3 * H),),
      ),
      _merge_heads(f'{h}.attention.dense.weight', s + ('self_attention', 'out', 'kernel'), N, H),
      _one(f'{h}.attention.dense.bias', s + ('self_attention', 'out', 'bias')),
      *_norm(f'{h}.post_attention_layernorm', s + ('mlp_norm',)),
      *_linear(f'{h}.mlp.dense_h_to_4h', s + ('mlp', 'wi')),
      *_linear(f'{h}.mlp.dense_4h_to_h', s + ('mlp', 'wo')),
    ]
  return rules


def _gpt_neo_rules(cfg: ModelConfig) -> list[_Rule]:
  """GPTNeoForCausalLM (TinyStories; body prefix cut) <-> CausalLM: GPT-2's names, with torch
  Linear layers ([out, in]) and q/k/v without biases."""
  N, H = cfg.num_heads, cfg.head_size
  tied = ('wte.weight', 'lm_head.weight') if cfg.tie_output else 'wte.weight'
  rules = [
    _one(tied, ('embedding',) * 2),
    _one('wpe.weight', ('decoder', 'embedder', 'positions', 'positions', 'embedding')),
    *_norm('ln_f', ('decoder', 'stack', 'final_norm')),
  ]
  if not cfg.tie_output:
    rules.append(_one('lm_head.weight', ('head', 'logits', 'kernel'), jnp.transpose, jnp.transpose))
  for i in range(cfg.num_layers):
    h, s = f'h.{i}', ('decoder', 'stack', f'layer_{i}')
    a = f'{h}.attn.attention'
    rules += [
      *_norm(f'{h}.ln_1', s + ('self_attention_norm',)),
      *(_split_heads(f'{a}.{p}_proj.weight', s + ('self_attention', n, 'kernel'), N, H)
        for p, n in (('q', 'query'), ('k', 'key'), ('v', 'value'))),
      _merge_heads(f'{a}.out_proj.weight', s + ('self_attention', 'out', 'kernel'), N, H),
      _one(f'{a}.out_proj.bias', s + ('self_attention', 'out', 'bias')),
      *_norm(f'{h}.ln_2', s + ('mlp_norm',)),
      *_linear(f'{h}.mlp.c_fc', s + ('mlp', 'wi')),
      *_linear(f'{h}.mlp.c_proj', s + ('mlp', 'wo')),
    ]  # fmt: skip
  return rules


def _gemma_rules(cfg: ModelConfig) -> list[_Rule]:
  """Gemma2ForCausalLM / Gemma3ForCausalLM <-> CausalLM: Llama's names and layout, with four norms
  per layer (the sandwich: input / post_attention, pre_ / post_feedforward) instead of two."""
  rules = []
  for rule in _llama_rules(cfg):
    name = rule.hf[0][0]
    if name.endswith('.post_attention_layernorm.weight'):  # Llama's second norm, Gemma's first post
      h, layer = name.rsplit('.post_attention_layernorm', 1)[0], rule.sparrow[0][:3]
      rules += [
        dataclasses.replace(rule, sparrow=(layer + ('self_attention_post_norm', 'scale'),)),
        _one(f'{h}.pre_feedforward_layernorm.weight', layer + ('mlp_norm', 'scale')),
        _one(f'{h}.post_feedforward_layernorm.weight', layer + ('mlp_post_norm', 'scale')),
      ]
    else:
      rules.append(rule)
  return rules


_RULES = {'gpt2': _gpt2_rules, 'bert': _bert_rules, 'gpt_neox': _neox_rules,
          'gpt_neo': _gpt_neo_rules, **dict.fromkeys(GEMMA, _gemma_rules)}  # fmt: skip


def _rules(arch: str, cfg: ModelConfig) -> list[_Rule]:
  return _RULES.get(arch, _llama_rules)(cfg)


def _targets(cfg: ModelConfig) -> dict[Path, jax.ShapeDtypeStruct]:
  """Every sparrow parameter of `cfg` as a ShapeDtypeStruct (layers unscanned)."""
  return traverse_util.flatten_dict(models.param_shapes(cfg.replace(scan_layers=False)))


# Reading safetensors, tensor by tensor -----------------------------------------------------------
class Tensors:
  """The tensors of some safetensors files (or of a dict of arrays), read one at a time.

  Only the headers are read up front, so a 7B checkpoint costs its parameters, not twice that.
  """

  def __init__(self, arrays: dict[str, np.ndarray] | None = None):
    self._arrays = arrays  # in memory (tests, small files); None = read from self._files
    self._files: dict[str, str] = {}  # tensor name -> file
    self._meta: dict[str, tuple[tuple[int, ...], str]] = {}  # name -> (shape, safetensors dtype)
    for name, x in (arrays or {}).items():
      self._meta[name] = (tuple(int(d) for d in np.shape(x)), str(np.asarray(x).dtype))

  @classmethod
  def open(cls, files: list[str], weight_map: dict[str, str] | None = None) -> Tensors:
    """Reads the headers of `files`; `weight_map` (from a shard index) must agree with them."""
    from safetensors import safe_open

    self = cls()
    for file in files:
      if not os.path.isfile(file):
        raise FileNotFoundError(f'weights file {file!r} does not exist; download it again')
      try:
        with safe_open(file, framework='np') as f:
          for name in f.keys():  # noqa: SIM118 (not a dict)
            view = f.get_slice(name)
            self._meta[name] = (tuple(int(d) for d in view.get_shape()), view.get_dtype())
            self._files[name] = file
      except Exception as e:  # the Rust SafetensorError and friends: corrupt, truncated, bad dtype
        raise ValueError(
          f'cannot read {file!r} as safetensors ({type(e).__name__}: {e}); the file is corrupt or '
          'truncated: download it again'
        ) from e
    for name, shard in (weight_map or {}).items():
      if name not in self._files:
        raise ValueError(
          f'{shard!r} has no tensor {name!r}, which {WEIGHTS}.index.json puts there; the shard is '
          'truncated or from another checkpoint: download it again'
        )
    return self

  def names(self) -> list[str]:
    return list(self._meta)

  def shape(self, name: str) -> tuple[int, ...]:
    return self._meta[name][0]

  def float_dtype(self) -> str:
    """The commonest floating dtype among the tensors: 'float32' | 'bfloat16' | 'float16'."""
    counts: dict[str, int] = {}
    for shape, dtype in self._meta.values():
      name = _SAFETENSORS_NAMES.get(dtype, dtype)
      if name in ('float32', 'bfloat16', 'float16'):
        counts[name] = counts.get(name, 0) + int(np.prod(shape))
    return max(counts, key=counts.get) if counts else 'float32'

  def get(self, name: str) -> np.ndarray:
    if self._arrays is not None:
      return np.asarray(self._arrays[name])
    from safetensors import safe_open

    file = self._files[name]
    try:
      with safe_open(file, framework='np') as f:
        return f.get_tensor(name)
    except Exception as e:
      raise ValueError(
        f'cannot read tensor {name!r} of {file!r} ({type(e).__name__}: {e}); the file is corrupt '
        'or truncated: download it again'
      ) from e


def open_weights(directory: str, path: str | None = None) -> tuple[Tensors, str]:
  """(tensors, what error messages call them) of a model directory, or of one weights file."""
  if path is not None and os.path.isfile(path):
    return Tensors.open([path]), path
  single, index = os.path.join(directory, WEIGHTS), os.path.join(directory, WEIGHTS + '.index.json')
  if os.path.isfile(single):
    return Tensors.open([single]), single
  if os.path.isfile(index):
    try:
      with open(index) as f:
        weight_map = json.load(f)['weight_map']
      weight_map = {name: os.path.join(directory, file) for name, file in weight_map.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
      raise ValueError(f'cannot read the shard index {index!r}: {e}') from e
    return Tensors.open(sorted(set(weight_map.values())), weight_map), index
  found = sorted(
    n
    for n in os.listdir(directory)
    if n.endswith(('.bin', '.pt', '.pth', '.ckpt', '.h5', '.msgpack'))
  )
  what = f'it has only {", ".join(found)}, which' if found else 'other formats'
  raise ValueError(
    f'no {WEIGHTS} in {directory!r}: sparrow reads safetensors only, and {what} it never '
    'unpickles. Convert it to safetensors elsewhere with transformers: '
    'AutoModel.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)'
  )


# The two directions -------------------------------------------------------------------------------
def params_from_hf(
  arch: str,
  cfg: ModelConfig,
  tensors: Tensors | dict[str, np.ndarray],
  where: str = WEIGHTS,
  shapes: Any = None,
  dtype: Any = np.float32,
) -> dict:
  """Sparrow parameters (nested dicts of `dtype` jax arrays) from the Hugging Face `tensors`.

  Every parameter is filled exactly once and every tensor is used, except the buffers and heads in
  `_IGNORED`; otherwise one ValueError names the tensor, its shape and the expected shape. Tensors
  are read and converted one rule at a time, so the peak memory is the parameters plus about two
  copies of the largest tensor. `shapes`: the parameters' ShapeDtypeStructs when
  known (default: traced from `cfg`).
  """
  check_arch(arch)
  source = tensors if isinstance(tensors, Tensors) else Tensors(tensors)
  names = _strip_prefix(arch, source.names(), where)  # short name -> name in the file
  prefixed = any(n != names[n] for n in names)  # name missing tensors as the file would
  shown_name = lambda short: _full(arch, cfg, short) if prefixed else short
  targets = traverse_util.flatten_dict(shapes) if shapes is not None else _targets(cfg)
  rules = _rules(arch, cfg)
  used = {n for rule in rules for aliases in rule.hf for n in aliases if n in names}
  ignored = _IGNORED[arch] + (() if cfg.num_classes else (_POOLER,))
  unused = [n for n in names if n not in used and not any(re.match(p, n) for p in ignored)]
  unused_note = ''
  if unused:
    shown = ', '.join(f'{names[n]!r} {source.shape(names[n])}' for n in unused[:4])
    unused_note = f'; the file also has tensors that map to nothing: {shown}'
  # Shapes first, from the headers: a wrong config fails before any tensor is read.
  expected = [jax.eval_shape(r.to_hf, *(targets[p] for p in r.sparrow)) for r in rules]
  for rule, wants in zip(rules, expected):
    for aliases, want in zip(rule.hf, wants):
      present = [n for n in aliases if n in names]
      if not present:
        raise ValueError(
          f'{where} has no tensor {shown_name(aliases[0])!r} (expected shape '
          f'{tuple(want.shape)}) that the {arch} config needs{unused_note}'
        )
      for n in present:
        if source.shape(names[n]) != tuple(want.shape):
          raise ValueError(
            f'{where}: tensor {names[n]!r} has shape {source.shape(names[n])}, but config.json '
            f'implies {tuple(want.shape)}; the weights do not belong to this config.json'
          )
  if unused:
    raise ValueError(
      f'{where}: tensor {names[unused[0]]!r} of shape {source.shape(names[unused[0]])} maps to '
      f'no sparrow parameter: a {arch} model with this config.json has no such tensor'
    )
  flat: dict[Path, Any] = {}
  for rule in rules:
    arrays = []
    for aliases in rule.hf:
      present = [n for n in aliases if n in names]
      first = source.get(names[present[0]])
      for n in present[1:]:
        if not np.array_equal(first, source.get(names[n])):
          raise ValueError(
            f'{where}: tensor {names[n]!r} {first.shape} differs from {names[present[0]]!r}; '
            'sparrow holds one parameter for both (tied weights), so they must be equal'
          )
      arrays.append(first.astype(dtype, copy=False))
    for path, value in zip(rule.sparrow, rule.to_sparrow(*arrays)):
      if path in flat:
        raise AssertionError(f'sparrow parameter {"/".join(path)} is mapped twice')
      flat[path] = jnp.asarray(value, dtype)  # on the device; the file's copy is freed now
    del arrays, first, value
    # glibc keeps freed blocks of up to 32 MB (most tensors) in its heap, which would add ~40% to
    # a conversion's peak: hand them back to the OS after each rule.
    util.release_host_memory()
  missing = sorted(set(targets) - set(flat))
  if missing:
    raise AssertionError(f'no rule fills sparrow parameter {"/".join(missing[0])}')
  return traverse_util.unflatten_dict(flat)


def params_to_hf(arch: str, cfg: ModelConfig, params: Any) -> dict[str, np.ndarray]:
  """Hugging Face tensors (canonical task-model names, the parameters' dtype) from sparrow ones."""
  check_arch(arch)
  # A scanned stack's ('stack', 'layers', ...) [L, ...] as ('stack', 'layer_i', ...).
  flat = traverse_util.flatten_dict(scan.unscan_params(cfg, params))
  tensors = {}
  for rule in _rules(arch, cfg):
    inputs = [np.asarray(flat.pop(p)) for p in rule.sparrow]
    dtype = inputs[0].dtype
    outputs = rule.to_hf(*(jnp.asarray(x) for x in inputs))
    for aliases, value in zip(rule.hf, outputs):
      tensors[_full(arch, cfg, aliases[0])] = np.ascontiguousarray(np.asarray(value, dtype))
  if flat:
    raise AssertionError(f'no rule exports sparrow parameter {"/".join(next(iter(flat)))}')
  return tensors


def _full(arch: str, cfg: ModelConfig, name: str) -> str:
  """The canonical name in a Hugging Face model: the body under its prefix (BertModel: none)."""
  if arch == 'bert' and not cfg.output_head:
    return name
  return name if name.startswith(_HEADS[arch]) else _BODY_PREFIX[arch] + name


def _strip_prefix(arch: str, names: list[str], where: str) -> dict[str, str]:
  """{name without the body prefix: name in the file}; files may or may not use the prefix."""
  prefix, out = _BODY_PREFIX[arch], {}
  for name in names:
    short = name[len(prefix) :] if name.startswith(prefix) else name
    if short in out:
      raise ValueError(f'{where} has both {out[short]!r} and {name!r}; keep one of them')
    out[short] = name
  return out
