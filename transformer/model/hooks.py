"""Named activations, cached and patchable: TransformerLens's hook points on sparrow's models.

`run(cfg, params, inputs, names=..., hooks=...)` runs one forward pass and returns the logits and
the activations named in `names` (a list of hook names, or a predicate on them); `hooks` maps
names to `fn(activation, name) -> activation`, which may read or replace each one. It is a pure
function of its arguments (flax method interception, no global state), so it runs under
`jax.jit` and `jax.grad`.

The names follow TransformerLens, so its tutorials port line by line. For a decoder-only or an
encoder-only model, with l the layer:

  blocks.{l}.hook_resid_pre     [B, T, D]  the block's input (layer 0: the embeddings)
  blocks.{l}.ln1.hook_normalized  [B, T, D]  the attention's input (pre-LN; ln2: the MLP's)
  blocks.{l}.attn.hook_q        [B, T, N, H]  queries, before RoPE (and k, v: [B, S, K, H])
  blocks.{l}.attn.hook_k, blocks.{l}.attn.hook_v
  blocks.{l}.attn.hook_attn_scores  [B, N, T, S]  scaled scores, -inf where masked (read only)
  blocks.{l}.attn.hook_pattern  [B, N, T, S]  probabilities (read only)
  blocks.{l}.attn.hook_z        [B, T, N, H]  each head's output, before the output projection
  blocks.{l}.hook_attn_out      [B, T, D]  the attention's output, added to the residual stream
  blocks.{l}.hook_resid_mid     [B, T, D]  the residual stream between attention and MLP
  blocks.{l}.mlp.hook_pre       [B, T, F]  before the activation (SwiGLU: the gate; the linear
  blocks.{l}.mlp.hook_pre_linear           half is hook_pre_linear)
  blocks.{l}.mlp.hook_post      [B, T, F]  after it
  blocks.{l}.hook_mlp_out       [B, T, D]
  blocks.{l}.hook_resid_post    [B, T, D]  the block's output
  ln_final.hook_scale           [B, T, 1]  1 / the final norm's divisor (pre-LN models; read only;
                                           none with norm='batchnorm', whose divisor is per feature)
  ln_final.hook_normalized      [B, T, D]  the final hidden state (pre-LN models)

An encoder-decoder prefixes `encoder.` and `decoder.`, and its decoder blocks add the cross
attention as `decoder.blocks.{l}.cross_attn.hook_*`, `decoder.blocks.{l}.ln_cross.hook_normalized`
and `decoder.blocks.{l}.hook_cross_attn_out`.
Pre-LN: hook_resid_mid = hook_resid_pre + hook_attn_out. Post-LN (BERT, the 2017 paper): it is
the normalised sum after attention, as the block computes it.

Each name is a `HookPoint` declared in the module where its activation is made (layers.py,
attention.py, primitives.py); `run` intercepts those calls, so nothing here computes an activation a
second time. Patterns and scores are computed only for the layers whose pattern or scores are
asked for, on the 'xla' path there; every other layer runs as configured, so a long text needs
only the memory of what was asked for.

`run_xla` runs every attention on the 'xla' path, as the inspection tools do, and
`attention_entropy` reads each head's entropy from a cache of patterns and scores.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from transformer.config import ModelConfig
from transformer.model import models
from transformer.model.attention import MultiHeadAttention
from transformer.model.primitives import HookPoint

Array = jax.Array
Hook = Callable[[Array, str], Array]

_ATTN = ('hook_q', 'hook_k', 'hook_v', 'hook_attn_scores', 'hook_pattern', 'hook_z')
READ_ONLY = ('hook_attn_scores', 'hook_pattern', 'hook_scale')


def patterns_and_scores(name: str) -> bool:
  """Picks every attention's pattern and scores: what `attention_entropy` reads."""
  return name.endswith(('.hook_pattern', '.hook_attn_scores'))


def hook_names(cfg: ModelConfig) -> list[str]:
  """Every hook name of a model of `cfg`, in forward order."""
  names, pre = [], cfg.norm_placement == 'pre'

  def block(prefix: str, layer: int, cross: bool) -> list[str]:
    b = f'{prefix}blocks.{layer}.'
    ln = lambda norm: [f'{b}{norm}.hook_normalized'] if pre else []  # a sub-layer's input
    out = [b + 'hook_resid_pre', *ln('ln1'), *(f'{b}attn.{h}' for h in _ATTN), b + 'hook_attn_out']
    if cfg.d_ff or cross:  # attention-only: resid_post follows the attention (TransformerLens)
      out.append(b + 'hook_resid_mid')
    if cross:
      out += [*ln('ln_cross'), *(f'{b}cross_attn.{h}' for h in _ATTN), b + 'hook_cross_attn_out']
    if cfg.d_ff:
      out += [*ln('ln2'), b + 'mlp.hook_pre']
      if cfg.activation == 'swiglu':
        out.append(b + 'mlp.hook_pre_linear')
      out += [b + 'mlp.hook_post', b + 'hook_mlp_out']
    return out + [b + 'hook_resid_post']

  if cfg.family == 'encoder_decoder':
    for layer in range(cfg.num_layers):
      names += block('encoder.', layer, False)
    for layer in range(cfg.decoder_layers):
      names += block('decoder.', layer, True)
  else:
    for layer in range(cfg.num_layers):
      names += block('', layer, False)
  final = ('decoder.' if cfg.family == 'encoder_decoder' else '') + 'ln_final.'
  if pre and cfg.norm != 'batchnorm':
    names.append(final + 'hook_scale')
  return names + ([final + 'hook_normalized'] if pre else [])


def select(
  cfg: ModelConfig, names: Iterable[str] | Callable[[str], bool] | None
) -> tuple[str, ...]:
  """The hook names picked by a list (each must exist), a predicate, or None (all of them)."""
  every = hook_names(cfg)
  if names is None:
    return tuple(every)
  if callable(names):
    return tuple(n for n in every if names(n))
  if isinstance(names, str):
    names = [names]
  names = list(names)
  known = set(every)
  for name in names:
    if name.endswith('ln_final.hook_scale') and cfg.norm == 'batchnorm':
      raise ValueError(
        f"{name} is the per-token divisor of norm='layernorm' or 'rmsnorm'; this model's "
        "norm='batchnorm' divides each feature by its running statistics, so it has no such hook"
      )
    if name not in known:
      near = [n for n in every if n.split('.')[-1] == name.split('.')[-1]][:3] or every[:3]
      raise ValueError(
        f'unknown hook name {name!r} for this {cfg.family} model ({cfg.num_layers} layers); '
        f'names look like {", ".join(near)} (hooks.hook_names lists all {len(every)})'
      )
  return tuple(dict.fromkeys(names))


# Module path parts -> TransformerLens's; 'stack' drops out and 'layer_3' becomes 'blocks.3'.
_PARTS = {
  'self_attention': 'attn',
  'cross_attention': 'cross_attn',
  'self_attention_norm': 'ln1',
  'cross_attention_norm': 'ln_cross',
  'mlp_norm': 'ln2',
  'final_norm': 'ln_final',
}


def hook_name(cfg: ModelConfig, path: tuple[str, ...]) -> str:
  """The TransformerLens name of a `HookPoint` (or module) at `path` in an unscanned model:
  ('decoder', 'stack', 'layer_3', 'self_attention', 'hook_z') -> 'blocks.3.attn.hook_z' (an
  encoder-decoder keeps its 'encoder.' or 'decoder.' in front)."""
  parts = []
  for part in path:
    if part.startswith('layer_'):
      parts += ['blocks', part[len('layer_') :]]
    elif part != 'stack':
      parts.append(_PARTS.get(part, part))
  return '.'.join(parts if cfg.family == 'encoder_decoder' else parts[1:])


@dataclasses.dataclass
class _State:
  """What one forward pass keeps while the interceptor walks it."""

  keep: frozenset
  hooks: Mapping[str, Hook]
  cache: dict = dataclasses.field(default_factory=dict)

  def see(self, name: str, value: Array) -> Array:
    """Applies the hook on `name` (if any), then caches the value if it was asked for."""
    if name in self.hooks:
      value = self.hooks[name](value, name)
    if name in self.keep:
      self.cache[name] = value
    return value

  def wants(self, *names: str) -> bool:
    return any(n in self.keep or n in self.hooks for n in names)


def _interceptor(cfg: ModelConfig, state: _State):
  """Each `HookPoint` call passes its value through `state`; an attention whose pattern or
  scores are asked for runs the dense path, where those two hook points are."""

  def intercept(next_fun, args, kwargs, context):
    module = context.module
    if context.method_name != '__call__':
      return next_fun(*args, **kwargs)
    if isinstance(module, HookPoint):
      return state.see(hook_name(cfg, module.path), next_fun(*args, **kwargs))
    if isinstance(module, MultiHeadAttention) and not kwargs.get('return_probs'):
      attn = hook_name(cfg, module.path)
      if state.wants(f'{attn}.hook_pattern', f'{attn}.hook_attn_scores'):
        return next_fun(*args, **{**kwargs, 'return_probs': True})[0]
    return next_fun(*args, **kwargs)

  return intercept


def unscan_params(cfg: ModelConfig, params: Any) -> Any:
  """Parameters of a `scan_layers` model ([layers, ...] under 'layers') as layer_0, layer_1, ...

  A variables dict (`models.variables`: params and a batchnorm model's running statistics) has
  each of its collections converted.
  """
  if not cfg.scan_layers:
    return params

  def convert(tree):
    if not isinstance(tree, dict):
      return tree
    out = {}
    for key, value in tree.items():
      if key == 'layers' and isinstance(value, dict):
        count = jax.tree_util.tree_leaves(value)[0].shape[0]  # L, the stacked leading axis
        for i in range(count):
          # [L, ...] -> layer i's [...]; the names match Stack's unscanned f'layer_{i}'.
          out[f'layer_{i}'] = jax.tree_util.tree_map(lambda x, i=i: x[i], value)
      else:
        out[key] = convert(value)
    return out

  if isinstance(params, Mapping) and 'params' in params:  # a variables dict
    return {collection: convert(dict(tree)) for collection, tree in params.items()}
  return convert(dict(params))


def hook_config(cfg: ModelConfig) -> ModelConfig:
  """The same model with one module per layer (no scan) and no remat: same numbers."""
  return cfg.replace(remat='none', scan_layers=False)


def run(
  cfg: ModelConfig,
  params: Any,
  inputs: Mapping[str, Any],
  *,
  names: Iterable[str] | Callable[[str], bool] | None = (),
  hooks: Mapping[str, Hook] | None = None,
) -> tuple[Array, dict[str, Array]]:
  """One forward pass of `cfg`'s model on `inputs` (its keyword arguments): (logits, {name:
  activation}) for the names asked for, with each hook in `hooks` applied where its name is
  computed. `params` may be a variables dict (`models.variables`, a batchnorm model's). Pure:
  call it under jax.jit or jax.grad."""
  keep = frozenset(select(cfg, names))
  hooks = dict(hooks or {})
  select(cfg, list(hooks))  # unknown hook names are one error
  for name in hooks:
    if name.split('.')[-1] in READ_ONLY:
      raise ValueError(f'{name} is read only: patch hook_z, hook_q/k/v or the residual stream')
  model = models.build(hook_config(cfg))
  state = _State(keep, hooks)
  with nn.intercept_methods(_interceptor(cfg, state)):
    variables = models.variables(unscan_params(cfg, params))
    logits = model.apply(variables, **inputs, deterministic=True)
  return logits, dict(state.cache)


@functools.lru_cache(maxsize=16)
def _jitted(cfg: ModelConfig, names: tuple[str, ...], hooks: tuple) -> Callable:
  return jax.jit(lambda params, inputs: run(cfg, params, inputs, names=names, hooks=dict(hooks)))


def run_jit(cfg, params, inputs, *, names=(), hooks=None) -> tuple[Array, dict[str, Array]]:
  """`run` under jax.jit, compiled once per (config, names, hook functions)."""
  inputs = {k: v for k, v in inputs.items() if v is not None}
  picked = select(cfg, names)
  fn = _jitted(cfg, picked, tuple(sorted((hooks or {}).items(), key=lambda kv: kv[0])))
  return fn(params, inputs)


def run_xla(cfg, params, inputs, names) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """`run_jit` with every attention on the 'xla' path whatever `cfg.attention_impl`, as NumPy
  arrays in forward order: a model trained on another path is inspected through the same numbers
  up to rounding."""
  logits, cache = jax.device_get(run_jit(cfg.replace(attention_impl='xla'), params, inputs,
                                         names=names))  # fmt: skip
  return np.asarray(logits), {name: np.asarray(cache[name]) for name in select(cfg, names)}


def head_entropy(probs: np.ndarray, visible: np.ndarray | None = None) -> dict[str, np.ndarray]:
  """Mean attention entropy of each head over the query rows that see at least one key.

  Args:
    probs: [B, N, T, S] attention probabilities (a hook_pattern).
    visible: bool [B or 1, N or 1, T, S]: the keys each query may see; None = every key.

  Returns:
    {'entropy': [N] mean entropy in nats (0 <= H <= log S), 'normalized': [N] mean of H divided
    by the log of the number of visible keys, over rows that see at least two (0 = one key,
    1 = uniform), 'max': [N] the largest row entropy}.
  """
  probs = np.asarray(probs, np.float64)
  B, N, T, S = probs.shape
  if visible is None:
    visible = np.ones((1, 1, T, S), bool)
  counts = np.broadcast_to(np.asarray(visible).sum(-1), (B, N, T))  # visible keys per row
  # A row sums to 1 if it sees a key and to exactly 0 if fully masked; 0.5 splits the two.
  rows = probs.sum(-1) > 0.5  # [B, N, T]: queries that attend (not padding)
  logs = np.log(np.where(probs > 0, probs, 1.0))  # log 1 = 0 where p = 0: 0 log 0 counts as 0
  h = -np.sum(probs * logs, axis=-1)  # [B, N, T]: each row's entropy in nats
  mean = lambda x, w: (x * w).sum((0, 2)) / np.maximum(w.sum((0, 2)), 1.0)  # over B and T
  several = rows & (counts >= 2)  # with one key, log(count) = 0 and H = 0: nothing to normalise
  normalized = h / np.log(np.maximum(counts, 2))  # [B, N, T]
  return {
    'entropy': mean(h, rows),
    'normalized': mean(normalized, several),
    'max': np.where(rows, h, 0.0).max((0, 2)),
  }


def attention_entropy(cache: Mapping[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
  """`head_entropy` of every attention whose pattern and scores `cache` holds (`run_xla` with
  `patterns_and_scores`), by attention name: 'blocks.0.attn', 'decoder.blocks.0.cross_attn'.
  A query may see the keys whose score is not -inf."""
  out = {}
  for name, pattern in cache.items():
    if name.endswith('.hook_pattern'):
      attn = name.removesuffix('.hook_pattern')
      out[attn] = head_entropy(pattern, np.asarray(cache[f'{attn}.hook_attn_scores']) != -np.inf)
  return out
