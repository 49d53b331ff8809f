"""One forward pass seen from inside: attention probabilities (through the 'xla' path), every
block's output, and the entropy of each head. Inspection and training's entropy log read it."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from transformer.config import ModelConfig
from transformer.model import models
from transformer.model.attention import MultiHeadAttention
from transformer.model.layers import Block, Stack


# Capturing attention and activations ---------------------------------------------------------
@dataclasses.dataclass
class Capture:
  """One forward pass, seen from inside. Keys are module paths such as
  'decoder/stack/layer_0/self_attention' (attention) or 'encoder/stack/layer_1' (blocks)."""

  logits: np.ndarray  # [B, T, V] (or [B, C] for a classifier)
  attention: dict[str, np.ndarray]  # float32 probabilities [B, N, T, S]
  visible: dict[str, np.ndarray]  # bool [B or 1, 1, T, S]: which keys each query may see
  attention_inputs: dict[str, np.ndarray]  # the attention's query-side input [B, T, D]
  blocks: dict[str, np.ndarray]  # each block's output, the residual stream [B, T, D]
  # The embedder's output ('decoder/embedder') and each stack's, after any final norm
  # ('decoder/stack'): [B, T, D].
  hidden: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


def inspection_config(cfg: ModelConfig) -> ModelConfig:
  """The same model on the 'xla' path, without remat or scan: same parameters, same numbers."""
  # Only 'xla' returns probabilities; the interceptor needs one module (and path) per layer, so
  # no scan; remat only trades memory for recompute, so dropping it changes no number.
  return cfg.replace(attention_impl='xla', remat='none', scan_layers=False)


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


@functools.lru_cache(maxsize=8)
def _capture_fn(cfg: ModelConfig, with_attention: bool = True):
  """A jitted forward pass of `cfg` (an inspection config) that also returns the inside views
  (without the attention probabilities unless `with_attention`)."""
  model = models.build(cfg)

  def run(params, inputs):
    attention, visible, attention_inputs, blocks, hidden = {}, {}, {}, {}, {}

    # Flax calls this around every module method; it records what it needs and passes through.
    def interceptor(next_fun, args, kwargs, context):
      module = context.module
      if context.method_name != '__call__':
        return next_fun(*args, **kwargs)
      if (
        with_attention
        and isinstance(module, MultiHeadAttention)
        and kwargs.get('cache_mode') is None  # the cache refuses return_probs
      ):
        y, probs = next_fun(*args, **{**kwargs, 'return_probs': True})  # [B, T, D], [B, N, T, S]
        name = '/'.join(module.path)
        attention[name] = probs  # [B, N, T, S]
        T, S = probs.shape[-2:]
        mask = kwargs.get('mask')
        visible[name] = np.ones((1, 1, T, S), bool) if mask is None else mask.dense(T, S)
        attention_inputs[name] = args[0]  # inputs_q [B, T, D]
        return y
      if isinstance(module, Block):
        y = next_fun(*args, **kwargs)
        # A scanned Block returns (x, None); inspection configs do not scan, but be safe.
        blocks['/'.join(module.path)] = y[0] if isinstance(y, tuple) else y  # [B, T, D]
        return y
      if isinstance(module, (Stack, models.Embedder)):
        y = next_fun(*args, **kwargs)
        hidden['/'.join(module.path)] = y  # [B, T, D]
        return y
      return next_fun(*args, **kwargs)

    with nn.intercept_methods(interceptor):
      logits = model.apply(models.variables(params), **inputs, deterministic=True)  # [B, T, V]
    return logits, attention, visible, attention_inputs, blocks, hidden

  return jax.jit(run)


def capture(
  cfg: ModelConfig, params: Any, inputs: dict[str, Any], *, with_attention: bool = True
) -> Capture:
  """Runs the model on `inputs` (its keyword arguments, e.g. `model_inputs(family, batch)`)
  through the 'xla' path and returns the logits, every attention map (unless not
  `with_attention`), every block's output and the embedder's and stacks' outputs."""
  inputs = {k: v for k, v in inputs.items() if v is not None}
  out = _capture_fn(inspection_config(cfg), with_attention)(unscan_params(cfg, params), inputs)
  logits, attention, visible, attention_inputs, blocks, hidden = jax.device_get(out)
  as_np = lambda d: {k: np.asarray(v) for k, v in sorted(d.items())}
  return Capture(
    np.asarray(logits),
    as_np(attention),
    as_np(visible),
    as_np(attention_inputs),
    as_np(blocks),
    as_np(hidden),
  )


def attention_maps(
  cfg: ModelConfig, params: Any, inputs: Any, decoder_inputs: Any = None
) -> dict[str, np.ndarray]:
  """Attention probabilities of every attention module: {module path: float32 [B, N, T, S]}.

  Args:
    inputs: token ids [B, T] (for an EncoderDecoder, the source [B, S]); 0 is padding.
    decoder_inputs: EncoderDecoder only: decoder input ids [B, T].
  """
  model_inputs = {'inputs': np.asarray(inputs)}
  if cfg.family == 'encoder_decoder':
    if decoder_inputs is None:
      raise ValueError('attention_maps of an encoder_decoder model needs decoder_inputs [B, T]')
    model_inputs['decoder_inputs'] = np.asarray(decoder_inputs)
  return capture(cfg, params, model_inputs).attention


# Head entropy ----------------------------------------------------------------------------------
def row_entropy(probs: np.ndarray) -> np.ndarray:
  """Entropy in nats of each attention row: probs [..., T, S] -> [..., T] (0 log 0 = 0)."""
  p = np.asarray(probs, np.float64)
  logs = np.log(np.where(p > 0, p, 1.0))  # log 1 = 0 where p = 0, so 0 log 0 counts as 0
  return -np.sum(p * logs, axis=-1)  # [..., T]


def head_entropy(probs: np.ndarray, visible: np.ndarray | None = None) -> dict[str, np.ndarray]:
  """Mean attention entropy of each head over the query rows that see at least one key.

  Args:
    probs: [B, N, T, S] attention probabilities.
    visible: bool [B or 1, 1, T, S] mask; None = every key visible.

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
  h = row_entropy(probs)  # [B, N, T]
  mean = lambda x, w: (x * w).sum((0, 2)) / np.maximum(w.sum((0, 2)), 1.0)  # over B and T
  several = rows & (counts >= 2)  # with one key, log(count) = 0 and H = 0: nothing to normalise
  normalized = h / np.log(np.maximum(counts, 2))  # [B, N, T]
  return {
    'entropy': mean(h, rows),
    'normalized': mean(normalized, several),
    'max': np.where(rows, h, 0.0).max((0, 2)),
  }


def entropy_by_layer(captured: Capture) -> dict[str, dict[str, np.ndarray]]:
  """`head_entropy` of every attention module of a capture, by module path."""
  return {
    name: head_entropy(probs, captured.visible[name]) for name, probs in captured.attention.items()
  }
