"""Named activations, cached and patchable: TransformerLens's hook points on sparrow's models.

`run(cfg, params, inputs, names=..., hooks=...)` runs one forward pass and returns the logits and
the activations named in `names` (a list of hook names, or a predicate on them). `hooks` is
{name: fn} or TransformerLens's fwd_hooks, [(name or predicate, fn), ...]; each fn is called as
fn(activation, hook), where `hook` is the name (a str) with TransformerLens's `hook.name` and
`hook.layer()`, and returns a replacement or None (no change). `run` is a pure function of its
arguments (flax method interception, no global state), so it runs under `jax.jit` and `jax.grad`.

The names follow TransformerLens, so its tutorials port line by line. For a decoder-only or an
encoder-only model, with l the layer:

  hook_embed                    [B, T, D]  the token embeddings (x sqrt(D) where the model scales)
  hook_pos_embed                [B, T, D]  learned or sinusoidal positions (none with RoPE, ALiBi)
  blocks.{l}.hook_resid_pre     [B, T, D]  the block's input (layer 0: the embeddings)
  blocks.{l}.ln1.hook_scale     [B, T, 1]  the norm's divisor sqrt(var + eps) (RMSNorm: of the mean
                                           square; none with norm='batchnorm')
  blocks.{l}.ln1.hook_normalized  [B, T, D]  the input divided by hook_scale (LayerNorm: centred
                                           first), before the weight and bias; float32
  blocks.{l}.ln1.hook_out       [B, T, D]  the norm's output: the attention's input with pre-LN
  blocks.{l}.attn.hook_q        [B, T, N, H]  queries, before RoPE (and k, v: [B, S, K, H])
  blocks.{l}.attn.hook_k, blocks.{l}.attn.hook_v
  blocks.{l}.attn.q_norm.hook_scale, hook_normalized, hook_out  qk-norm models: the norm of
  blocks.{l}.attn.k_norm.hook_scale, ...   the queries (keys) per head, [B, T, N, H]
  blocks.{l}.attn.hook_rot_q    [B, T, N, H]  queries after RoPE (RoPE models; and hook_rot_k)
  blocks.{l}.attn.hook_attn_scores  [B, N, T, S]  scaled scores, -inf where masked (softmax only)
  blocks.{l}.attn.hook_pattern  [B, N, T, S]  probabilities
  blocks.{l}.attn.hook_z        [B, T, N, H]  each head's output, before the output projection
  blocks.{l}.attn.hook_result   [B, T, N, D]  each head's output projected (no bias); computed
                                           only when asked for; a hook that replaces it makes
                                           the attention's output their sum plus the bias
  blocks.{l}.hook_attn_out      [B, T, D]  the attention's output, added to the residual stream
  blocks.{l}.hook_resid_mid     [B, T, D]  the residual stream between attention and MLP
  blocks.{l}.ln2.hook_scale, hook_normalized, hook_out  the MLP's norm
  blocks.{l}.ln1_post.*, ln2_post.*  sandwich norms (Gemma 2/3): the sub-layer's output, normalised
                                    before hook_attn_out / hook_mlp_out
  blocks.{l}.mlp.hook_pre       [B, T, F]  before the activation (SwiGLU: the gate; the linear
  blocks.{l}.mlp.hook_pre_linear           half is hook_pre_linear)
  blocks.{l}.mlp.hook_post      [B, T, F]  after it
  blocks.{l}.hook_mlp_out       [B, T, D]
  blocks.{l}.hook_resid_post    [B, T, D]  the block's output
  ln_final.hook_scale, hook_normalized  the final norm (pre-LN models)
  ln_final.hook_out             [B, T, D]  the final hidden state (pre-LN models)

A BERT-style model (bidirectional_lm) names its embeddings as TransformerLens's HookedEncoder
does: embed.hook_embed, embed.hook_pos_embed, embed.hook_token_type_embed and the embeddings'
norm embed.ln.hook_scale, hook_normalized and hook_out; its MLM head's norm is
mlm_head.ln.hook_scale, hook_normalized and hook_out. Pre-LN: hook_resid_mid = hook_resid_pre +
hook_attn_out. Post-LN (BERT, the 2017 paper): ln1 and ln2 normalise the sums after attention
and MLP, and hook_resid_mid is ln1's hook_out.

An encoder-decoder prefixes `encoder.` and `decoder.` to every name (each stack has its own
embeddings and, pre-LN, its own ln_final). Its decoder blocks add the cross attention between the
self attention and the MLP: decoder.blocks.{l}.ln_cross.hook_scale, hook_normalized and hook_out
(pre-LN: the decoder stream the queries come from), decoder.blocks.{l}.cross_attn.hook_q
(queries from the decoder), hook_k and hook_v (keys and values from the encoder's output,
[B, S, K, H]), hook_attn_scores and hook_pattern ([B, N, T, S]: decoder queries over encoder
keys), hook_z, hook_result, and decoder.blocks.{l}.hook_cross_attn_out, added to the residual
stream.

Each name is a `HookPoint` declared in the module where its activation is made (models.py,
layers.py, attention.py, parts.py, encoder_decoder.py); `hook_names` lists them as an
abstract forward pass calls them, and `run` intercepts those calls, so nothing here computes an
activation a second time or keeps a second list of them. Patterns and scores are computed only
for the layers whose pattern or scores are asked for or hooked, on the 'xla' path there, and
per-head results only for those whose hook_result is; every other layer runs as configured, so a
long text needs only the memory of what was asked for.

`run_jit` is `run` under `jax.jit` (see there what it compiles and when). `run_xla` runs every
attention on the 'xla' path, as the inspection tools do; entropy.py reads each head's entropy
from a cache of patterns and scores (`attention_entropy`, also importable from here).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer.config import ModelConfig
from transformer.model import jaxpr_cache, models, scan
from transformer.model.attention import MultiHeadAttention
from transformer.model.entropy import (  # noqa: F401  (public here too)
  attention_entropy,
  head_entropy,
  patterns_and_scores,
)
from transformer.model.jaxpr_cache import traced
from transformer.model.layers import HookPoint

Array = jax.Array
HookFn = Callable[[Array, 'HookName'], Array | None]
# {name: fn}, or TransformerLens's fwd_hooks: [(name or predicate on names, fn), ...].
Hooks = Mapping[str, HookFn] | Sequence[tuple[str | Callable[[str], bool], HookFn]]


class HookName(str):
  """What a hook function gets beside its activation: TransformerLens's `hook`, with `hook.name`
  and `hook.layer()`. It is the name itself too (a str), so a hook written `fn(act, name)` reads
  it as a string."""

  @property
  def name(self) -> str:
    return str(self)

  def layer(self) -> int | None:
    """The block index in the name ('blocks.3.attn.hook_z' -> 3), or None outside the blocks."""
    parts = self.split('.')
    return int(parts[parts.index('blocks') + 1]) if 'blocks' in parts else None


def hook_names(cfg: ModelConfig) -> list[str]:
  """Every hook name of a model of `cfg`, in forward order: the `HookPoint`s its modules declare,
  as one abstract forward pass calls them (shapes only, no arithmetic; once per config)."""
  return list(_declared(cfg))


@functools.lru_cache(maxsize=64)
def _declared(cfg: ModelConfig) -> tuple[str, ...]:
  model = models.build(hook_config(cfg))
  names = []

  def intercept(next_fun, args, kwargs, context):
    module = context.module
    if context.method_name == '__call__' and isinstance(module, HookPoint):
      names.append(hook_name(cfg, module.path))
    elif context.method_name == '__call__' and isinstance(module, MultiHeadAttention):
      # The points that exist on request: per-head results, and a softmax's scores and pattern.
      extra = {'per_head': True, 'return_probs': cfg.attention == 'softmax'}
      out = next_fun(*args, **{**kwargs, **extra})
      return out[0] if extra['return_probs'] else out
    return next_fun(*args, **kwargs)

  shapes = jax.eval_shape(lambda: models.init_variables(model, jax.random.PRNGKey(0)))
  with nn.intercept_methods(intercept):
    jax.eval_shape(lambda v: model.apply(v, **model.dummy_inputs()), shapes)
  return tuple(dict.fromkeys(names))


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
    if name.endswith('.hook_scale') and cfg.norm == 'batchnorm':
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


# Module path parts -> TransformerLens's; 'stack' and 'positions' drop out and 'layer_3' becomes
# 'blocks.3'.
_PARTS = {
  'embedder': 'embed',
  'norm': 'ln',  # the embeddings' norm (BERT's); the blocks' norms have longer names
  'self_attention': 'attn',
  'cross_attention': 'cross_attn',
  'self_attention_norm': 'ln1',
  'cross_attention_norm': 'ln_cross',
  'mlp_norm': 'ln2',
  'self_attention_post_norm': 'ln1_post',  # sandwich norms (Gemma 2): on each sub-layer's output
  'mlp_post_norm': 'ln2_post',
  'final_norm': 'ln_final',
  'query_norm': 'q_norm',  # qk-norm (Qwen3): the norms of each head's queries and keys
  'key_norm': 'k_norm',
  'mlm_norm': 'mlm_head.ln',  # BERT's MLM head (TransformerLens's HookedEncoder)
}


def hook_name(cfg: ModelConfig, path: tuple[str, ...]) -> str:
  """The TransformerLens name of a `HookPoint` (or module) at `path` in an unscanned model:
  ('decoder', 'stack', 'layer_3', 'self_attention', 'hook_z') -> 'blocks.3.attn.hook_z' (an
  encoder-decoder keeps its 'encoder.' or 'decoder.' in front)."""
  parts = []
  for part in path:
    if part.startswith('layer_'):
      parts += ['blocks', part[len('layer_') :]]
    elif part not in ('stack', 'positions'):
      parts.append(_PARTS.get(part, part))
  if cfg.family != 'encoder_decoder' and parts[0] in ('encoder', 'decoder'):
    parts = parts[1:]  # one stack: no prefix (the head's modules sit beside it)
  name = '.'.join(parts)
  if cfg.family != 'bidirectional_lm':  # GPT-2's hook_embed and hook_pos_embed sit at the top;
    name = name.replace('embed.hook_', 'hook_')  # BERT's under embed., as in TransformerLens
  return name


def resolve_hooks(cfg: ModelConfig, hooks: Hooks | None) -> dict[str, tuple[HookFn, ...]]:
  """{name: (fn, ...)} from {name: fn} or from TransformerLens's fwd_hooks [(name or predicate,
  fn), ...]; the hooks on one name run in the order given. Unknown names are one error."""
  pairs = list(hooks.items()) if isinstance(hooks, Mapping) else list(hooks or ())
  out: dict[str, list[HookFn]] = {}
  for pair in pairs:
    if not (isinstance(pair, tuple | list) and len(pair) == 2 and callable(pair[1])):
      raise ValueError(
        f'a hook is a (name or predicate on names, fn) pair, fn called as fn(activation, hook); '
        f'got {pair!r:.80}'
      )
    target, fn = pair
    for name in select(cfg, target if callable(target) else [target]):
      out.setdefault(name, []).append(fn)
  return {name: tuple(fns) for name, fns in out.items()}


def _replacement(name: str, value: Array, out: Any) -> Array:
  """What a hook returned, as the activation goes on: its shape, in the activation's dtype."""
  if not isinstance(out, jax.Array):
    out = jnp.asarray(out)
  if out.shape != value.shape:
    raise ValueError(
      f"the hook on {name} returned shape {tuple(out.shape)}; return the activation's shape "
      f'{tuple(value.shape)} (or None to leave it unchanged)'
    )
  return out if out.dtype == value.dtype else out.astype(value.dtype)


# What a hook written for torch tensors raises on the JAX array it is handed: a torch method
# (.clone, .unsqueeze, ...), an in-place assignment, or a value written into NumPy or turned into
# a Python number while the forward is traced (NumPy reports that one as a ValueError).
_TORCH_HABITS = (AttributeError, TypeError, ValueError)


def _habit_message(name: str, error: BaseException) -> str:
  first = str(error).strip().splitlines()[0] if str(error).strip() else ''
  return (
    f'the hook on {name} failed: {type(error).__name__}: {first[:300]}. A hook gets a JAX array '
    'being traced: it has no torch methods (.clone() is not needed, .unsqueeze(i) is '
    'x[..., None] or jnp.expand_dims, .detach()/.cpu() go), it cannot be assigned in place '
    '(x[idx] = v becomes x = x.at[idx].set(v), then return x), and its numbers do not exist '
    'yet (to record them, call jax.debug.callback(fn, x) or ask run_with_cache for the name). '
    'docs/dissect.md lists the torch idioms and their JAX forms.'
  )


@dataclasses.dataclass
class _State:
  """What one forward pass keeps while the interceptor walks it."""

  keep: frozenset
  hooks: Mapping[str, tuple[HookFn, ...]]
  given: list | None = None  # (name, weak reference) of each value handed to a hook, if watched
  cache: dict = dataclasses.field(default_factory=dict)

  def see(self, name: str, value: Array) -> Array:
    """Applies the hooks on `name` (if any), then caches the value if it was asked for. A hook
    that returns None leaves the activation as it was (TransformerLens's convention)."""
    for fn in self.hooks.get(name, ()):
      if self.given is not None:
        self.given.append(
          (name, weakref.ref(value), jax.ShapeDtypeStruct(value.shape, value.dtype))
        )
      try:
        out = fn(value, HookName(name))
      except _TORCH_HABITS as e:
        if str(e).startswith('the hook on '):  # a hook inside a hook: already said
          raise
        raise ValueError(_habit_message(name, e)) from e
      if out is not None:
        value = _replacement(name, value, out)
    if name in self.keep:
      self.cache[name] = value
    return value

  def wants(self, *names: str) -> bool:
    return any(n in self.keep or n in self.hooks for n in names)


def _interceptor(cfg: ModelConfig, state: _State):
  """Each `HookPoint` call passes its value through `state`; an attention whose pattern or
  scores are asked for runs the dense path, where those two hook points are, and one whose
  hook_result is asked for also projects head by head."""

  def intercept(next_fun, args, kwargs, context):
    module = context.module
    if context.method_name != '__call__':
      return next_fun(*args, **kwargs)
    if isinstance(module, HookPoint):
      return state.see(hook_name(cfg, module.path), next_fun(*args, **kwargs))
    if isinstance(module, MultiHeadAttention):
      attn, extra = hook_name(cfg, module.path), {}
      if not kwargs.get('return_probs'):
        if state.wants(f'{attn}.hook_pattern', f'{attn}.hook_attn_scores'):
          extra['return_probs'] = True
      if state.wants(f'{attn}.hook_result'):  # per-head outputs, only when asked for
        extra['per_head'] = True
      out = next_fun(*args, **{**kwargs, **extra})
      return out[0] if 'return_probs' in extra else out
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
  hooks: Hooks | None = None,
) -> tuple[Array, dict[str, Array]]:
  """One forward pass of `cfg`'s model on `inputs` (its keyword arguments): (logits, {name:
  activation}) for the names asked for, with `hooks` ({name: fn} or [(name or predicate, fn)])
  applied where each name is computed, as fn(activation, hook). `params` may be a variables
  dict (`models.variables`, a batchnorm model's). Pure: call it under jax.jit or jax.grad."""
  return _run(cfg, params, inputs, select(cfg, names), resolve_hooks(cfg, hooks))


def _run(cfg, params, inputs, names: tuple[str, ...], hooks: Mapping[str, tuple[HookFn, ...]],
         given: list | None = None):  # fmt: skip
  """`run` on names and hooks already checked; `given` collects what the hooks were handed."""
  model = models.build(hook_config(cfg))
  state = _State(frozenset(names), hooks, given)
  with nn.intercept_methods(_interceptor(cfg, state)):
    variables = models.variables(scan.unscan_params(cfg, params))
    logits = model.apply(variables, **inputs, deterministic=True)
  return logits, dict(state.cache)


@functools.lru_cache(maxsize=16)
def _jitted(cfg: ModelConfig, names: tuple[str, ...]) -> Callable:
  return jax.jit(lambda params, inputs: _run(cfg, params, inputs, names, {}))


def run_jit(cfg, params, inputs, *, names=(), hooks=None) -> tuple[Array, dict[str, Array]]:
  """`run` under jax.jit. Without hooks it compiles once per (config, names). With hooks, the
  first call traces and compiles; a later call whose hooks differ only in the Python numbers,
  arrays and caches they hold or name (`jaxpr_cache.lift`) runs that compile with them as
  arguments, and replays the hooks' Python on the activations' shapes (a print prints). Hooks
  that need a number static trace at every call, and compile once per traced program."""
  inputs = {k: v for k, v in inputs.items() if v is not None}
  picked = select(cfg, names)
  resolved = resolve_hooks(cfg, hooks)
  if not resolved:
    return _jitted(cfg, picked)(params, inputs)
  plan = jaxpr_cache.lift(resolved)
  if plan is not None and (cfg, picked, plan[0]) not in _TRACE_EVERY_CALL:
    key, values, rebuild, keep = plan
    entry = _LIFTED.get((cfg, picked, key))
    if entry is None:  # the first call of these hooks: its rebuild serves every later one
      entry = _LIFTED[cfg, picked, key] = _lifted(cfg, picked, rebuild, keep)
      if len(_LIFTED) > _LIFTED_KEPT:
        _LIFTED.popitem(last=False)
    forward, given, _, shapes = entry
    try:
      out = forward(params, inputs, values)
    except Exception:  # noqa: BLE001 - hooks that need a number static: traced below
      del _LIFTED[cfg, picked, key]
      if len(_TRACE_EVERY_CALL) > 256:  # a bound, as for the compiles
        _TRACE_EVERY_CALL.clear()
      _TRACE_EVERY_CALL.add((cfg, picked, key))
    else:
      if given:  # traced now: the hooks ran; the shapes they were handed are kept for replays
        jaxpr_cache.check_nothing_kept(given)
        shapes.clear()
        shapes.update((name, shape) for name, _, shape in given)
        given.clear()
      else:  # the compile ran without tracing: the hooks' Python runs on their activations' shapes
        _replay(resolved, shapes)
      return out
  given = []
  return traced(lambda p, x: _run(cfg, p, x, picked, resolved, given), params, inputs, given)


# Compiled forwards of hooks whose numbers are arguments, by (config, names, hooks' key), and the
# keys whose hooks need their numbers static (jaxpr_cache.lift).
_LIFTED: collections.OrderedDict = collections.OrderedDict()
_LIFTED_KEPT = 32
_TRACE_EVERY_CALL: set = set()


def _lifted(cfg: ModelConfig, names: tuple[str, ...], rebuild: Callable, keep: list) -> tuple:
  """(the jitted forward with hooks whose numbers, arrays and caches are its argument `values`,
  the list its trace fills for the kept-tracer check, `keep`: the objects the hooks' key names by
  identity, held so that no other object takes their ids, and the hooked activations' shapes):
  a loop over layers, positions or heads reuses the one compile."""
  given: list = []

  def forward(params, inputs, values):
    return _run(cfg, params, inputs, names, rebuild(values), given)

  return jax.jit(forward), given, keep, {}


def _replay(hooks: Mapping[str, tuple[HookFn, ...]], shapes: Mapping[str, Any]) -> None:
  """Runs the hooks' Python again, as a traced forward would (a print, a check), on abstract
  values of their activations' shapes, in forward order; nothing is computed."""
  given: list = []
  state = _State(frozenset(), hooks, given)
  for name, shape in shapes.items():
    jax.eval_shape(functools.partial(state.see, name), shape)
  jaxpr_cache.check_nothing_kept(given)


def run_xla(cfg, params, inputs, names) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """`run_jit` with every attention on the 'xla' path whatever `cfg.attention_impl`, as NumPy
  arrays in forward order: a model trained on another path is inspected through the same numbers
  up to rounding."""
  logits, cache = jax.device_get(run_jit(cfg.replace(attention_impl='xla'), params, inputs,
                                         names=names))  # fmt: skip
  return np.asarray(logits), {name: np.asarray(cache[name]) for name in select(cfg, names)}
