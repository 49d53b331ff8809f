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

Patterns and scores are computed only for the layers whose pattern or scores are asked for, on
the 'xla' path there; every other layer runs as configured, so a long text needs only the memory
of what was asked for.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.config import ModelConfig
from transformer.model import models
from transformer.model import positions as positions_lib
from transformer.model.attention import MultiHeadAttention
from transformer.model.capture import unscan_params
from transformer.model.layers import Block, FeedForward
from transformer.model.norms import BatchNorm, Norm

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


@dataclasses.dataclass
class _State:
  """What one forward pass keeps while the interceptor walks it."""

  keep: frozenset
  hooks: Mapping[str, Hook]
  cache: dict = dataclasses.field(default_factory=dict)
  resid_pre: dict = dataclasses.field(default_factory=dict)  # block prefix -> its input
  qk: dict = dataclasses.field(default_factory=dict)  # attention prefix -> (q, k) after hooks

  def see(self, name: str, value: Array) -> Array:
    """Applies the hook on `name` (if any), then caches the value if it was asked for."""
    if name in self.hooks:
      value = self.hooks[name](value, name)
    if name in self.keep:
      self.cache[name] = value
    return value

  def wants(self, *names: str) -> bool:
    return any(n in self.keep or n in self.hooks for n in names)


def _prefix(cfg: ModelConfig, path: tuple[str, ...]) -> str | None:
  """'blocks.3.' (or 'encoder.blocks.3.') for a module path inside layer 3 of a stack."""
  if 'stack' not in path:
    return None
  i = path.index('stack')
  if i + 1 >= len(path) or not path[i + 1].startswith('layer_'):
    return None
  layer = path[i + 1][len('layer_') :]
  side = f'{path[i - 1]}.' if cfg.family == 'encoder_decoder' and i else ''
  return f'{side}blocks.{layer}.'


def _scores(module: MultiHeadAttention, q, k, mask, positions, self_attention: bool) -> Array:
  """Scaled (and ALiBi-biased) attention scores [B, N, T, S], -inf where masked, recomputed from
  the hooked q [B, T, N, H] and k [B, S, K, H] as `MultiHeadAttention` does."""
  if module.qk_norm is not None:
    raise ValueError('hook_attn_scores is not available with qk_norm')
  T, S = q.shape[1], k.shape[1]
  if module.rope is not None and self_attention:
    theta, scaling, factor, original, low, high = module.rope
    inv_freq, mscale = positions_lib.rope_frequencies(
      module.head_dim, theta=theta, scaling=scaling, factor=factor,
      original_max_length=original, low_freq_factor=low, high_freq_factor=high,
    )  # fmt: skip
    pos = jnp.arange(T)[None] if positions is None else positions
    q = positions_lib.apply_rope(q, pos, inv_freq, mscale)
    k = positions_lib.apply_rope(k, pos, inv_freq, mscale)
  groups = q.shape[2] // k.shape[2]
  k = jnp.repeat(k, groups, axis=2)  # [B, S, N, H]
  scale = module.scale if module.scale is not None else module.head_dim**-0.5
  scores = jnp.einsum('btnh,bsnh->bnts', q, k).astype(jnp.float32) * scale
  if module.alibi and self_attention:
    slopes = positions_lib.alibi_slopes(module.num_heads)  # [N]
    scores = scores + positions_lib.alibi_bias(slopes, jnp.arange(T), jnp.arange(S))  # [N, T, S]
  if mask is not None:
    scores = jnp.where(mask.dense(T, S), scores, -jnp.inf)
  return scores


def _interceptor(cfg: ModelConfig, state: _State):
  def intercept(next_fun, args, kwargs, context):
    module, method = context.module, context.method_name
    if method != '__call__':
      return next_fun(*args, **kwargs)
    path = module.path
    prefix = _prefix(cfg, path)
    name = path[-1] if path else ''

    if isinstance(module, Block):
      x = state.see(prefix + 'hook_resid_pre', args[0])
      state.resid_pre[prefix] = x
      y = next_fun(x, *args[1:], **kwargs)
      return state.see(prefix + 'hook_resid_post', y)

    if isinstance(module, MultiHeadAttention) and prefix is not None:
      attn = prefix + ('cross_attn.' if name == 'cross_attention' else 'attn.')
      out_name = prefix + ('hook_cross_attn_out' if name == 'cross_attention' else 'hook_attn_out')
      probs_wanted = state.wants(attn + 'hook_pattern')
      if any(attn + h in state.hooks for h in ('hook_pattern', 'hook_attn_scores')):
        raise ValueError(f'{attn}hook_pattern and hook_attn_scores are read only; patch hook_z')
      if probs_wanted:
        y, probs = next_fun(*args, **{**kwargs, 'return_probs': True})
        state.see(attn + 'hook_pattern', probs)
      else:
        y = next_fun(*args, **kwargs)
      if state.wants(attn + 'hook_attn_scores'):
        q, k = state.qk.pop(attn)
        mask, positions = kwargs.get('mask'), kwargs.get('positions')
        scores = _scores(module, q, k, mask, positions, name == 'self_attention')
        state.see(attn + 'hook_attn_scores', scores)
      y = state.see(out_name, y)
      if name == 'self_attention' and cfg.norm_placement == 'pre':
        # hook_resid_mid = resid_pre + attn_out: a hook on it replaces attn_out by the difference
        x = state.resid_pre[prefix] if cfg.residual else jnp.zeros_like(y)
        mid_name = prefix + 'hook_resid_mid'
        if mid_name in state.hooks:
          y = state.hooks[mid_name](x + y, mid_name) - x
        if mid_name in state.keep:
          state.cache[mid_name] = x + y
      return y

    parent = path[-2] if len(path) >= 2 else ''
    if prefix is not None and parent in ('self_attention', 'cross_attention'):
      attn = prefix + ('cross_attn.' if parent == 'cross_attention' else 'attn.')
      if name in ('query', 'key', 'value'):
        hook = attn + {'query': 'hook_q', 'key': 'hook_k', 'value': 'hook_v'}[name]
        out = state.see(hook, next_fun(*args, **kwargs))
        if name in ('query', 'key') and state.wants(attn + 'hook_attn_scores'):
          q, k = state.qk.get(attn, (None, None))
          state.qk[attn] = (out, k) if name == 'query' else (q, out)
        return out
      if name == 'out':
        z = state.see(attn + 'hook_z', args[0])
        return next_fun(z, *args[1:], **kwargs)

    if isinstance(module, FeedForward) and prefix is not None:
      return state.see(prefix + 'hook_mlp_out', next_fun(*args, **kwargs))
    if prefix is not None and parent == 'mlp':
      mlp = prefix + 'mlp.'
      if name == 'gate' or (name == 'wi' and cfg.activation != 'swiglu'):
        return state.see(mlp + 'hook_pre', next_fun(*args, **kwargs))
      if name == 'wi':  # SwiGLU's linear half
        return state.see(mlp + 'hook_pre_linear', next_fun(*args, **kwargs))
      if name == 'wo':
        h = state.see(mlp + 'hook_post', args[0])
        return next_fun(h, *args[1:], **kwargs)

    is_norm = isinstance(module, (Norm, BatchNorm))
    if is_norm and prefix is not None and cfg.norm_placement == 'post':
      if name == 'self_attention_norm':  # post-LN: the normalised sum is the residual stream
        return state.see(prefix + 'hook_resid_mid', next_fun(*args, **kwargs))
    if isinstance(module, Norm) and name == 'final_norm':
      if cfg.family == 'encoder_decoder' and path[0] != 'decoder':
        return next_fun(*args, **kwargs)  # the encoder's final norm has no hook point
      side = 'decoder.' if cfg.family == 'encoder_decoder' else ''
      if state.wants(side + 'ln_final.hook_scale'):
        if side + 'ln_final.hook_scale' in state.hooks:
          raise ValueError('ln_final.hook_scale is read only')
        x = args[0].astype(jnp.float32)
        if module.kind == 'layernorm':
          x = x - x.mean(-1, keepdims=True)
        scale = jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + module.eps)  # [B, T, 1]
        state.see(side + 'ln_final.hook_scale', scale)
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
