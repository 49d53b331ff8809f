"""Named activations, cached and patchable: TransformerLens's hook points on sparrow's models.

`run(cfg, params, inputs, names=..., hooks=...)` runs one forward pass and returns the logits and
the activations named in `names` (a list of hook names, or a predicate on them); `hooks` maps
names to `fn(activation, name) -> activation`, which may read or replace each one. It is a pure
function of its arguments (flax method interception, no global state), so it runs under
`jax.jit` and `jax.grad`.

The names follow TransformerLens, so its tutorials port line by line. For a decoder-only or an
encoder-only model, with l the layer:

  blocks.{l}.hook_resid_pre     [B, T, D]  the block's input (layer 0: the embeddings)
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

An encoder-decoder prefixes `encoder.` and `decoder.`, and its decoder blocks add the cross
attention as `decoder.blocks.{l}.cross_attn.hook_*` and `decoder.blocks.{l}.hook_cross_attn_out`.
Pre-LN: hook_resid_mid = hook_resid_pre + hook_attn_out. Post-LN (BERT, the 2017 paper): it is
the normalised sum after attention, as the block computes it.

Each name is a `HookPoint` declared in the module where its activation is made (layers.py,
attention.py, norms.py); `run` intercepts those calls, so nothing here computes an activation a
second time. Patterns and scores are computed only for the layers whose pattern or scores are
asked for, on the 'xla' path there; every other layer runs as configured, so a long text needs
only the memory of what was asked for.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import flax.linen as nn
import jax

from transformer.config import ModelConfig
from transformer.model import models
from transformer.model.attention import MultiHeadAttention
from transformer.model.capture import unscan_params
from transformer.model.hookpoint import HookPoint

Array = jax.Array
Hook = Callable[[Array, str], Array]

_ATTN = ('hook_q', 'hook_k', 'hook_v', 'hook_attn_scores', 'hook_pattern', 'hook_z')
READ_ONLY = ('hook_attn_scores', 'hook_pattern', 'hook_scale')


def hook_names(cfg: ModelConfig) -> list[str]:
  """Every hook name of a model of `cfg`, in forward order."""
  names = []

  def block(prefix: str, layer: int, cross: bool) -> list[str]:
    b = f'{prefix}blocks.{layer}.'
    out = [b + 'hook_resid_pre', *(f'{b}attn.{h}' for h in _ATTN), b + 'hook_attn_out']
    if cfg.d_ff or cross:  # attention-only: resid_post follows the attention (TransformerLens)
      out.append(b + 'hook_resid_mid')
    if cross:
      out += [*(f'{b}cross_attn.{h}' for h in _ATTN), b + 'hook_cross_attn_out']
    if cfg.d_ff:
      out.append(b + 'mlp.hook_pre')
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
  if cfg.norm_placement == 'pre' and cfg.norm != 'batchnorm':
    names.append(('decoder.' if cfg.family == 'encoder_decoder' else '') + 'ln_final.hook_scale')
  return names


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
