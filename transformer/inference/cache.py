"""TransformerLens's calling conventions on sparrow's hook points: `get_act_name`, the
`ActivationCache` and its helpers, the forward's `return_type`, `loss_per_token` and
`stop_at_layer`.

The cache holds NumPy arrays; each helper follows TransformerLens's definition (its
`ActivationCache`), so a notebook that reads `cache['pattern', 0]` or calls
`cache.decompose_resid(apply_ln=True)` gives the same numbers here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from transformer.model import hooks as hooks_lib
from transformer.model import norms, scan

RETURN_TYPES = ('logits', 'loss', 'both', None)

# TransformerLens's shorthand (utils.get_act_name): what a short name stands for, and the part of
# the block a name lives in.
_LAYER_TYPES = {'a': 'attn', 'm': 'mlp', 'b': '', 'block': '', 'blocks': '', 'attention': 'attn'}
_NAMES = {
  'attn': 'pattern',
  'attn_logits': 'attn_scores',
  'key': 'k',
  'query': 'q',
  'value': 'v',
  'mlp_pre': 'pre',
  'mlp_mid': 'mid',
  'mlp_post': 'post',
}
_ATTN = ('k', 'v', 'q', 'z', 'rot_k', 'rot_q', 'result', 'pattern', 'attn_scores')
_MLP = ('pre', 'post', 'mid', 'pre_linear')


def get_act_name(name: str, layer: int | None = None, layer_type: str | None = None) -> str:
  """A full hook name from TransformerLens's shorthand: ('pattern', 0) ->
  'blocks.0.attn.hook_pattern', ('resid_pre', 3) -> 'blocks.3.hook_resid_pre', 'k6' ->
  'blocks.6.attn.hook_k', ('scale', 4, 'ln1') -> 'blocks.4.ln1.hook_scale', 'scale' ->
  'ln_final.hook_scale'. A full name comes back as it is."""
  if ('.' in name or name.startswith('hook_')) and layer is None and layer_type is None:
    return name
  match = re.fullmatch(r'([a-z_]+?)(\d+)([a-z]\w*)?', name)
  if match is not None:  # 'k6', 'scale4ln1'
    name, layer, layer_type = match.group(1), int(match.group(2)), match.group(3)
  if name == 'in' and layer is not None and layer_type is None:
    name = 'resid_pre'  # TransformerLens 4's bridge: blocks.L.hook_in, its alias of resid_pre
  name = _NAMES.get(name, name)
  if name in _ATTN:
    layer_type = 'attn'
  elif name in _MLP:
    layer_type = 'mlp'
  else:
    layer_type = _LAYER_TYPES.get(layer_type, layer_type)
  full = '' if layer is None else f'blocks.{layer}.'
  full += f'{layer_type}.' if layer_type else ''
  full += f'hook_{name}'
  if name in ('scale', 'normalized') and layer is None:
    full = f'ln_final.{full}'
  return full


def _pos(x: np.ndarray, pos_slice: Any, axis: int) -> np.ndarray:
  """TransformerLens's Slice on `axis`: None keeps all, an int picks one position (and drops the
  axis), a (start, stop[, step]) tuple slices, a list or array indexes."""
  if pos_slice is None:
    return x
  if isinstance(pos_slice, tuple):
    pos_slice = slice(*pos_slice)
  index = [slice(None)] * x.ndim
  index[axis] = pos_slice
  return x[tuple(index)]


class ActivationCache(Mapping):
  """The activations of one forward pass by hook name, as TransformerLens's `ActivationCache`.

  A Mapping from full names to arrays [B, ...] ([...] after `remove_batch_dim`), which also takes
  TransformerLens's shorthand: `cache['pattern', 0]`, `cache['resid_pre', -1]` (the last layer),
  `cache['q', 0, 'attn']`, `cache['scale', 2, 'ln1']`. The helpers need the model it came from
  (`model`, a `transformer.Model`) for its config and weights.
  """

  def __init__(self, activations: Mapping[str, Any], model: Any, has_batch_dim: bool = True):
    self.cache_dict = {name: np.asarray(value) for name, value in activations.items()}
    self.model, self.has_batch_dim = model, has_batch_dim

  def traced_copy(self, values: Mapping[str, Any]) -> ActivationCache:
    """This cache over other arrays of the same names: the tracers a hook reads it through while
    run_with_hooks traces the hook with its inputs as arguments (model.jaxpr_cache.lift)."""
    copy = object.__new__(type(self))
    copy.cache_dict, copy.model, copy.has_batch_dim = dict(values), self.model, self.has_batch_dim
    return copy

  def __getitem__(self, key: str | tuple) -> np.ndarray:
    if isinstance(key, str):
      return self.cache_dict[key]
    key = tuple(key)
    if len(key) > 1 and key[1] is not None and key[1] < 0:  # ('resid_pre', -1): the last layer
      key = (key[0], self.model.cfg.num_layers + key[1], *key[2:])
    return self.cache_dict[get_act_name(*key)]

  def __iter__(self) -> Iterator[str]:
    return iter(self.cache_dict)

  def __len__(self) -> int:
    return len(self.cache_dict)

  def __repr__(self) -> str:
    return f'ActivationCache with keys {list(self.cache_dict)}'

  def remove_batch_dim(self) -> ActivationCache:
    """Drops the batch axis of a cache of one row, in place (TransformerLens's), and returns it."""
    if not self.has_batch_dim:
      return self
    sizes = {value.shape[0] for value in self.cache_dict.values() if value.ndim}
    if sizes - {1}:
      raise ValueError(
        f'remove_batch_dim needs a batch of 1; this cache holds batch sizes {sorted(sizes)}'
      )
    self.cache_dict = {k: v[0] if v.ndim else v for k, v in self.cache_dict.items()}
    self.has_batch_dim = False
    return self

  # The residual stream and its parts --------------------------------------------------------
  def _layer(self, layer: int | None) -> int:
    """TransformerLens's default: None or -1 is the stream before the unembedding."""
    layers = self.model.cfg.num_layers
    layer = layers if layer is None or layer == -1 else layer
    if not 0 <= layer <= layers:
      raise ValueError(f'layer={layer} must be in [0, {layers}] (or -1 / None: {layers})')
    return layer

  def accumulated_resid(
    self,
    layer: int | None = None,
    incl_mid: bool = False,
    apply_ln: bool = False,
    pos_slice: Any = None,
    mlp_input: bool = False,
    return_labels: bool = False,
  ) -> np.ndarray | tuple[np.ndarray, list[str]]:
    """The residual stream before each layer up to `layer` (and after the last one, 'final_post',
    when `layer` is the number of layers), stacked [C, B, T, D]; with `incl_mid` the stream
    between attention and MLP too. `apply_ln` normalises each as the next norm would: at the
    end, the final norm itself (recomputed on each part, TransformerLens's logit lens)."""
    layer, layers = self._layer(layer), self.model.cfg.num_layers
    parts, labels = [], []
    for i in range(layer + 1):
      if i == layers:
        parts.append(self['resid_post', layers - 1])
        labels.append('final_post')
        continue
      parts.append(self['resid_pre', i])
      labels.append(f'{i}_pre')
      if (incl_mid and i < layer) or (mlp_input and i == layer):
        parts.append(self['resid_mid', i])
        labels.append(f'{i}_mid')
    stack = np.stack([_pos(p, pos_slice, -2) for p in parts])
    if apply_ln:
      final = layer == layers
      stack = self.apply_ln_to_stack(stack, layer, mlp_input, pos_slice, recompute_ln=final)
    return (stack, labels) if return_labels else stack

  def decompose_resid(
    self,
    layer: int | None = None,
    mlp_input: bool = False,
    mode: str = 'all',
    apply_ln: bool = False,
    pos_slice: Any = None,
    incl_embeds: bool = True,
    return_labels: bool = False,
  ) -> np.ndarray | tuple[np.ndarray, list[str]]:
    """What wrote the residual stream before `layer`, stacked [C, B, T, D]: the token and
    position embeddings, then each layer's attention and MLP output (`mode` 'attn' or 'mlp'
    keeps one kind). Without biases folded, their sum is the stream up to the biases' share."""
    if mode not in ('all', 'mlp', 'attn'):
      raise ValueError(f"mode={mode!r} is not valid; choose 'all', 'mlp' or 'attn'")
    layer = self._layer(layer)
    attn, mlp = mode != 'mlp', mode != 'attn' and bool(self.model.cfg.d_ff)
    parts, labels = [], []
    if incl_embeds:  # those this model has (RoPE has no position embedding)
      known = hooks_lib.hook_names(self.model.cfg)
      for name, label in (('hook_embed', 'embed'), ('hook_pos_embed', 'pos_embed')):
        if name in known:
          parts.append(self[name])
          labels.append(label)
    for i in range(layer):
      for on, name in ((attn, 'attn_out'), (mlp, 'mlp_out')):
        if on:
          parts.append(self[name, i])
          labels.append(f'{i}_{name}')
    if mlp_input and attn:
      parts.append(self['attn_out', layer])
      labels.append(f'{layer}_attn_out')
    stack = np.stack([_pos(p, pos_slice, -2) for p in parts])
    if apply_ln:
      stack = self.apply_ln_to_stack(stack, layer, mlp_input, pos_slice)
    return (stack, labels) if return_labels else stack

  def _head_results(self, layer: int) -> np.ndarray:
    """Layer `layer`'s per-head outputs [B, T, N, D]: `hook_result` where cached, else hook_z
    through each head's slice of the output projection (its bias left out, as in
    TransformerLens)."""
    name = f'blocks.{layer}.attn.hook_result'
    if name in self.cache_dict:
      return self.cache_dict[name]
    params = scan.unscan_params(self.model.cfg, self.model.params)
    w_o = np.asarray(_stack(params)[f'layer_{layer}']['self_attention']['out']['kernel'])
    z = self['z', layer]  # [B, T, N, H]
    return np.einsum('...nh,nhd->...nd', z, w_o.astype(z.dtype))  # [B, T, N, D]

  def stack_head_results(
    self,
    layer: int = -1,
    return_labels: bool = False,
    incl_remainder: bool = False,
    pos_slice: Any = None,
    apply_ln: bool = False,
  ) -> np.ndarray | tuple[np.ndarray, list[str]]:
    """Every head's output before `layer`, stacked [L * N, B, T, D] with labels 'L0H0', ...;
    `incl_remainder` adds what the heads did not write, so the parts sum to the stream."""
    layer = self._layer(layer)
    heads = [_pos(self._head_results(i), pos_slice, -3) for i in range(layer)]  # [B, T, N, D]
    labels = [f'L{i}H{h}' for i in range(layer) for h in range(self.model.cfg.num_heads)]
    if heads:
      stack = np.moveaxis(np.concatenate(heads, axis=-2), -2, 0)  # [L * N, B, T, D]
    else:  # no layer before: an empty stack of the embeddings' shape
      stack = np.zeros((0, *_pos(self['resid_pre', 0], pos_slice, -2).shape), np.float32)
    if incl_remainder:
      resid = self['resid_post', layer - 1] if layer else self['resid_pre', 0]
      rest = _pos(resid, pos_slice, -2) - stack.sum(0)
      stack, labels = np.concatenate([stack, rest[None]]), labels + ['remainder']
    if apply_ln:
      stack = self.apply_ln_to_stack(stack, layer, pos_slice=pos_slice)
    return (stack, labels) if return_labels else stack

  # The norms ---------------------------------------------------------------------------------
  def _ln_scale(self, layer: int, mlp_input: bool) -> np.ndarray:
    """The cached divisor sqrt(var + eps) [B, T, 1] of the norm that reads the stream at `layer`
    (ln_final at the end, else ln1, or ln2 with `mlp_input`), computed from the cached stream
    that norm read, the value TransformerLens keeps as its `hook_scale`."""
    cfg = self.model.cfg
    if layer == cfg.num_layers:
      resid = self['resid_post', layer - 1]
    else:
      resid = self['resid_mid' if mlp_input else 'resid_pre', layer]
    return norms.divisor(cfg.norm, resid.astype(np.float32), cfg.norm_eps, 'apply_ln_to_stack')

  def apply_ln_to_stack(
    self,
    residual_stack: np.ndarray,
    layer: int | None = None,
    mlp_input: bool = False,
    pos_slice: Any = None,
    recompute_ln: bool = False,
  ) -> np.ndarray:
    """Each part of a stack [C, B, T, D] through the norm that reads the stream at `layer`,
    as TransformerLens: centred (LayerNorm) and divided by the whole stream's cached scale, so
    the parts still sum to the normalised stream; the norm's weight and bias are left out
    (fold them into the next matrix). `recompute_ln` at the end runs the final norm itself on
    each part, its weight and bias included."""
    cfg = self.model.cfg
    norms.reapplied(cfg.norm, 'apply_ln_to_stack')
    if cfg.norm_placement != 'pre':
      raise ValueError(
        f'apply_ln_to_stack needs a pre-LN model (each norm reads the residual stream); this one '
        f'has norm_placement={cfg.norm_placement!r}'
      )
    layer = self._layer(layer)
    stack = np.asarray(residual_stack, np.float32)
    if recompute_ln and layer == cfg.num_layers:
      return self._final_norm(stack)
    stack = norms.centred(cfg.norm, stack)
    return stack / _pos(self._ln_scale(layer, mlp_input), pos_slice, -2)

  def _final_norm(self, x: np.ndarray) -> np.ndarray:
    """The final norm of the model, weight and bias included, on [..., D]."""
    cfg = self.model.cfg
    norm = _stack(scan.unscan_params(cfg, self.model.params))['final_norm']
    bias = np.asarray(norm['bias'], np.float32) if 'bias' in norm else None
    scale = np.asarray(norm['scale'], np.float32)
    return norms.normalized(cfg.norm, x, cfg.norm_eps, scale, bias, 'apply_ln_to_stack')


def _stack(params: Any) -> Any:
  """The layer stack's parameters of an LM (an encoder-decoder's decoder)."""
  params = params['params'] if 'params' in params else params
  return params['decoder']['stack'] if 'decoder' in params else params['encoder']['stack']


# The forward's outputs -----------------------------------------------------------------------
def loss(logits: Any, tokens: Any, per_token: bool = False) -> np.ndarray:
  """TransformerLens's `loss_fn`: the mean next-token NLL in nats of `tokens` [B, T] under
  `logits` [B, T, V] (position t predicts token t + 1), or per token [B, T - 1]."""
  logits = np.asarray(logits, np.float32)
  top = logits.max(-1, keepdims=True)  # log-softmax, shifted for stability
  logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
  tokens = np.asarray(tokens)
  nll = -np.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]  # [B, T - 1]
  return nll if per_token else nll.mean()


def output(logits: Any, tokens: Any, return_type: str | None, per_token: bool = False) -> Any:
  """What a forward with `return_type` returns: the logits, the loss, both, or None."""
  if return_type not in RETURN_TYPES:
    raise ValueError(f'return_type={return_type!r} is not valid; choose one of {RETURN_TYPES}')
  if return_type is None:
    return None
  logits = np.asarray(logits)
  if return_type == 'logits':
    return logits
  nll = loss(logits, tokens, per_token)
  return nll if return_type == 'loss' else (logits, nll)


def truncate(
  model: Any, stop_at_layer: int, names: tuple[str, ...], hooks: Any
) -> tuple[Any, str, tuple[str, ...], Any]:
  """What a forward that stops before block `stop_at_layer` runs: (the config of the blocks
  before it, the hook name of the stream it returns, the names and hooks that exist before it).

  The blocks from `stop_at_layer` on are never built, and under jit nothing reads the truncated
  model's own final norm and head, so XLA drops them: the rest is never computed."""
  cfg, layers = model.cfg, model.cfg.num_layers
  if cfg.family == 'encoder_decoder':
    raise ValueError('stop_at_layer needs a causal_lm or bidirectional_lm model')
  stop = stop_at_layer + layers if stop_at_layer < 0 else stop_at_layer
  if not 0 <= stop <= layers:
    raise ValueError(f'stop_at_layer={stop_at_layer} must be in [-{layers}, {layers}]')
  short = cfg.replace(num_layers=max(stop, 1))
  # The stream before block `stop`: block stop-1's output; before block 0, the embeddings.
  last = f'blocks.{stop - 1}.hook_resid_post' if stop else 'blocks.0.hook_resid_pre'
  # The truncated model's own final norm is not the model's: its names are left out too.
  before = {n for n in hooks_lib.hook_names(short) if not n.startswith('ln_final.')}
  if not stop:  # only the embeddings run
    before = {n for n in before if not n.startswith('blocks.')}
  names = tuple(n for n in names if n in before or n == last)
  return short, last, names, _hooks_before(hooks, before)


def _hooks_before(hooks: Any, before: set[str]) -> Any:
  """`hooks` less those named for a point past the stop ({name: fn} or [(name or filter, fn)])."""
  if not hooks:
    return hooks
  if isinstance(hooks, Mapping):
    return {name: fn for name, fn in hooks.items() if name in before}
  kept = []
  for target, fn in hooks:
    if callable(target):
      kept.append((lambda n, t=target: n in before and t(n), fn))
    elif target in before:
      kept.append((target, fn))
  return kept
