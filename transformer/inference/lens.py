"""TransformerLens's surface on `api.Model`, so that its notebooks port with a prefix change: the
weights under TransformerLens's names and shapes (`W_E`, `W_U`, `blocks[l].attn.W_Q`, ...),
persistent hooks (`add_hook`, `hooks(...)`, `reset_hooks`) and `to_string`.

The weights are read from the parameters as they are, processed (`Model.process_weights`) or not,
as NumPy float32 arrays. Shapes follow TransformerLens: W_Q/W_K/W_V [n_heads, d_model, d_head] (a
grouped-query model's keys and values repeated to every query head, as TransformerLens's W_K
does), W_O [n_heads, d_head, d_model], b_Q [n_heads, d_head], W_in [d_model, d_mlp], W_U
[d_model, d_vocab]; the stacked forms put the layer first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from transformer.model import hooks as hooks_lib
from transformer.model import scan


def _np(x: Any) -> np.ndarray:
  return np.asarray(x, np.float32)


class HookHandle:
  """`model.blocks[l].attn.hook_z` as TransformerLens's hook point: `.add_hook(fn)` puts a
  persistent hook on that name (`model.reset_hooks()` removes it)."""

  def __init__(self, model: Any, name: str):
    self._model, self.name = model, name

  def add_hook(self, fn: Callable, dir: str = 'fwd') -> None:
    self._model.add_hook(self.name, fn, dir)


class _Points:
  """Hook points by attribute: `.hook_<name>` is the HookHandle of `<prefix>.hook_<name>`."""

  def __getattr__(self, name: str) -> HookHandle:
    if not name.startswith('hook_') or self._model is None:
      raise AttributeError(name)
    return HookHandle(self._model, f'{self._prefix}.{name}')


class AttentionWeights(_Points):
  """One block's attention weights under TransformerLens's names (`model.blocks[l].attn`), and
  its hook points (`.hook_z.add_hook(fn)`)."""

  def __init__(self, cfg, params: dict, model: Any = None, prefix: str = ''):
    self._cfg, self._p, self._model, self._prefix = cfg, params, model, prefix

  def _qkv(self, name: str, what: str) -> np.ndarray:
    p = self._p[name]
    G = self._cfg.num_heads // (p['kernel'].shape[1])  # query heads per kv head
    if what == 'kernel':  # [D, K, H] -> [N, D, H]
      return np.repeat(_np(p['kernel']).transpose(1, 0, 2), G, axis=0)
    bias = _np(p['bias']) if 'bias' in p else np.zeros(p['kernel'].shape[1:], np.float32)
    return np.repeat(bias, G, axis=0)  # [N, H]

  W_Q = property(lambda self: self._qkv('query', 'kernel'))
  W_K = property(lambda self: self._qkv('key', 'kernel'))
  W_V = property(lambda self: self._qkv('value', 'kernel'))
  b_Q = property(lambda self: self._qkv('query', 'bias'))
  b_K = property(lambda self: self._qkv('key', 'bias'))
  b_V = property(lambda self: self._qkv('value', 'bias'))

  @property
  def W_O(self) -> np.ndarray:
    return _np(self._p['out']['kernel'])  # [N, H, D]

  @property
  def b_O(self) -> np.ndarray:
    out = self._p['out']
    return _np(out['bias']) if 'bias' in out else np.zeros(self._cfg.d_model, np.float32)


class MLPWeights:
  """One block's MLP weights under TransformerLens's names (`model.blocks[l].mlp`)."""

  def __init__(self, cfg, params: dict):
    self._cfg, self._p = cfg, params

  def _get(self, name: str, what: str) -> np.ndarray:
    if name not in self._p:
      raise AttributeError(
        f'this model has no {name!r} in its MLP (activation={self._cfg.activation!r})'
      )
    p = self._p[name]
    if what == 'bias' and 'bias' not in p:
      return np.zeros(p['kernel'].shape[-1], np.float32)
    return _np(p[what])

  W_in = property(lambda self: self._get('wi', 'kernel'))  # [D, F]
  b_in = property(lambda self: self._get('wi', 'bias'))
  W_gate = property(lambda self: self._get('gate', 'kernel'))  # gated MLPs only
  W_out = property(lambda self: self._get('wo', 'kernel'))  # [F, D]
  b_out = property(lambda self: self._get('wo', 'bias'))


class BlockWeights(_Points):
  """`model.blocks[l]`: `.attn` and `.mlp`, TransformerLens's per-block weights, and the block's
  hook points (`.hook_resid_pre.add_hook(fn)`)."""

  def __init__(self, cfg, params: dict, model: Any = None, layer: int = 0):
    self._model, self._prefix = model, f'blocks.{layer}'
    self.attn = AttentionWeights(cfg, params['self_attention'], model, f'blocks.{layer}.attn')
    self.mlp = MLPWeights(cfg, params.get('mlp', {}))


class WithWeights:
  """A method that also holds weights as attributes, for the names that TransformerLens gives a
  module and sparrow a method: `model.embed(texts)` embeds sentences, `model.embed.W_E` is the
  token table."""

  def __init__(self, method: Callable, **weights: Callable[[Any], np.ndarray]):
    self._method, self._weights = method, weights
    self.__doc__ = method.__doc__

  def __get__(self, model: Any, owner: type | None = None) -> Any:
    if model is None:
      return self
    return _Bound(self._method.__get__(model, owner), model, self._weights)


class _Bound:
  def __init__(self, fn: Callable, model: Any, weights: dict):
    self._fn, self._model, self._weights = fn, model, weights
    self.__doc__ = fn.__doc__

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    return self._fn(*args, **kwargs)

  def __getattr__(self, name: str) -> Any:  # read when asked for: a large table is not copied
    if name.startswith('_') or name not in self._weights:
      raise AttributeError(name)
    return self._weights[name](self._model)


class _Table:
  """A weight holder with one attribute: `model.embed.W_E`, `model.pos_embed.W_pos`, ..."""

  def __init__(self, **weights: np.ndarray):
    self.__dict__.update(weights)


class Lens:
  """The mixin `api.Model` takes TransformerLens's weights and persistent hooks from."""

  cfg: Any
  params: Any
  tokenizer: Any
  workdir: str

  # The weights ---------------------------------------------------------------------------------
  def _layers(self) -> list[dict]:
    if self.cfg.family != 'causal_lm':
      raise AttributeError(
        f"TransformerLens's weight names read a causal_lm's blocks; this is a {self.cfg.family}"
      )
    stack = scan.unscan_params(self.cfg, self.params)['decoder']['stack']
    return [stack[f'layer_{i}'] for i in range(self.cfg.num_layers)]

  @property
  def blocks(self) -> list[BlockWeights]:
    return [BlockWeights(self.cfg, p, self, i) for i, p in enumerate(self._layers())]

  def _stacked(self, part: str, name: str) -> np.ndarray:
    return np.stack([getattr(getattr(b, part), name) for b in self.blocks])

  W_Q = property(lambda self: self._stacked('attn', 'W_Q'))  # [L, N, D, H]
  W_K = property(lambda self: self._stacked('attn', 'W_K'))
  W_V = property(lambda self: self._stacked('attn', 'W_V'))
  W_O = property(lambda self: self._stacked('attn', 'W_O'))  # [L, N, H, D]
  b_Q = property(lambda self: self._stacked('attn', 'b_Q'))  # [L, N, H]
  b_K = property(lambda self: self._stacked('attn', 'b_K'))
  b_V = property(lambda self: self._stacked('attn', 'b_V'))
  b_O = property(lambda self: self._stacked('attn', 'b_O'))  # [L, D]
  W_in = property(lambda self: self._stacked('mlp', 'W_in'))  # [L, D, F]
  W_gate = property(lambda self: self._stacked('mlp', 'W_gate'))
  W_out = property(lambda self: self._stacked('mlp', 'W_out'))  # [L, F, D]
  b_in = property(lambda self: self._stacked('mlp', 'b_in'))
  b_out = property(lambda self: self._stacked('mlp', 'b_out'))

  @property
  def W_E(self) -> np.ndarray:
    return _np(self.params['embedding']['embedding'])  # [V, D]

  @property
  def W_pos(self) -> np.ndarray:
    embedder = self.params['decoder']['embedder']
    if 'positions' not in embedder:
      raise AttributeError(f'position={self.cfg.position!r} has no learned table W_pos')
    return _np(embedder['positions']['positions']['embedding'])  # [max_length, D]

  @property
  def W_U(self) -> np.ndarray:
    head = self.params.get('head', {}).get('logits')
    return self.W_E.T if head is None else _np(head['kernel'])  # [D, V]

  @property
  def b_U(self) -> np.ndarray:
    head = self.params.get('head', {}).get('logits', {})
    return _np(head['bias']) if 'bias' in head else np.zeros(self.cfg.vocab_size, np.float32)

  pos_embed = property(lambda self: _Table(W_pos=self.W_pos))
  unembed = property(lambda self: _Table(W_U=self.W_U, b_U=self.b_U))

  # Persistent hooks ----------------------------------------------------------------------------
  def add_hook(
    self, name: str | Callable[[str], bool], fn: Callable, dir: str = 'fwd', is_permanent=False
  ) -> None:
    """TransformerLens's `model.add_hook(name, fn)`: the hook stays on every later forward
    (`__call__`, run_with_cache, run_with_hooks) until `reset_hooks` (which keeps the
    `is_permanent` ones unless told otherwise), as TransformerLens 4.3's bridge keeps it."""
    if dir != 'fwd':
      raise ValueError(f"dir={dir!r}: sparrow's hooks run on the forward pass only; use 'fwd'")
    hooks_lib.resolve_hooks(self.cfg, [(name, fn)])  # a bad name fails here, not later
    self._persistent_hooks().append((name, fn, bool(is_permanent)))

  def reset_hooks(self, including_permanent: bool = False) -> None:
    """Removes the hooks `add_hook` put on (the permanent ones too with including_permanent)."""
    self._persistent_hooks()[:] = [
      h for h in self._persistent_hooks() if h[2] and not including_permanent
    ]

  @contextlib.contextmanager
  def hooks(self, fwd_hooks: list | None = None, reset_hooks_end: bool = True) -> Iterator[Any]:
    """`with model.hooks(fwd_hooks=[(name, fn)]):` the hooks are on inside the block; at its end
    the hooks added since are removed (with reset_hooks_end)."""
    before = list(self._persistent_hooks())
    for name, fn in fwd_hooks or []:
      self.add_hook(name, fn)
    try:
      yield self
    finally:
      if reset_hooks_end:
        self._persistent_hooks()[:] = before

  def _persistent_hooks(self) -> list:
    """(name, fn, permanent) of each hook add_hook put on, in order."""
    if not hasattr(self, '_hooks_on'):
      self._hooks_on = []
    return self._hooks_on

  def set_use_attn_result(self, use_attn_result: bool) -> None:
    """TransformerLens's switch for `hook_result`. sparrow computes each layer's per-head results
    whenever a cache or a hook asks for that layer's `attn.hook_result`, so there is nothing to
    turn on; the call only checks its argument."""
    if not isinstance(use_attn_result, bool):
      raise ValueError(f'set_use_attn_result takes True or False; got {use_attn_result!r}')

  # Text ----------------------------------------------------------------------------------------
  def to_string(self, tokens: Any) -> str | list[str]:
    """TransformerLens's `to_string`: the text of ids [T], or one text per row of [B, T]."""
    ids = np.asarray(tokens)
    if ids.ndim == 2:
      return [self.to_string(row) for row in ids]
    if ids.ndim != 1:
      raise ValueError(f'to_string takes token ids [T] or [B, T]; got shape {ids.shape}')
    if self.tokenizer is None:
      raise ValueError(f'workdir {self.workdir!r} has no tokenizer, which to_string needs')
    return self.tokenizer.decode([int(t) for t in ids])
