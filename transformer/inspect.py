"""Looking inside a model: parameter tables, attention maps and head entropy, init and activation
statistics, and plots of the position encodings.

Attention maps always come from the 'xla' path (the only one that returns probabilities), rerun on
the same parameters: a model trained with 'chunked' or 'pallas' is inspected through the same
numbers up to floating-point tolerance. Nothing here changes how a model trains.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from transformer import models
from transformer import positions as positions_lib
from transformer.attention import MultiHeadAttention
from transformer.config import ModelConfig
from transformer.layers import Block


def param_table(cfg: ModelConfig, depth: int = 2) -> list[tuple[str, int]]:
  """Parameter counts grouped by the first `depth` levels of the parameter tree."""
  counts: dict[str, int] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(models.param_shapes(cfg))[0]:
    key = '/'.join(str(getattr(p, 'key', p)) for p in path[:depth])
    counts[key] = counts.get(key, 0) + math.prod(leaf.shape)
  return sorted(counts.items())


def describe(cfg: ModelConfig, seq_len: int | None = None) -> str:
  """A readable summary: the architecture, parameters per module, exact total and FLOPs/token."""
  seq_len = seq_len or cfg.max_length
  layers = f'{cfg.num_layers}'
  if cfg.family == 'encoder_decoder':
    layers = f'{cfg.num_layers} encoder + {cfg.decoder_layers} decoder'
  lines = [
    f'model: {cfg.family}',
    f'  layers {layers}, d_model {cfg.d_model}, d_ff {cfg.d_ff}, '
    f'heads {cfg.num_heads} (kv {cfg.kv_heads}, head_dim {cfg.head_size}), vocab {cfg.vocab_size}',
    f'  positions {cfg.position} (max_length {cfg.max_length}), {cfg.norm_placement}-{cfg.norm} '
    f'eps {cfg.norm_eps:g}, activation {cfg.activation}, dropout {cfg.dropout_rate:g}',
    f'  attention {cfg.attention_impl or "auto"}, scaled {cfg.attention_scale}, '
    f'window {cfg.window}, dtype {cfg.dtype} (params {cfg.param_dtype}), remat {cfg.remat}, '
    f'scan {cfg.scan_layers}',
    'parameters by module:',
  ]
  total = 0
  for name, count in param_table(cfg):
    lines.append(f'  {name:<40} {count:>14,}')
    total += count
  flops = models.flops_per_token(cfg, seq_len)
  lines += [
    f'parameters: {total}',
    f'training FLOPs per token: {flops["train"]:.4g} (forward {flops["forward"]:.4g}, '
    f'seq_len {seq_len}, matmul parameters {flops["matmul_params"]:,})',
  ]
  return '\n'.join(lines)


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


def inspection_config(cfg: ModelConfig) -> ModelConfig:
  """The same model on the 'xla' path, without remat or scan: same parameters, same numbers."""
  return cfg.replace(attention_impl='xla', remat='none', scan_layers=False)


def unscan_params(cfg: ModelConfig, params: Any) -> Any:
  """Parameters of a `scan_layers` model ([layers, ...] under 'layers') as layer_0, layer_1, ..."""
  if not cfg.scan_layers:
    return params

  def convert(tree):
    if not isinstance(tree, dict):
      return tree
    out = {}
    for key, value in tree.items():
      if key == 'layers' and isinstance(value, dict):
        count = jax.tree_util.tree_leaves(value)[0].shape[0]
        for i in range(count):
          out[f'layer_{i}'] = jax.tree_util.tree_map(lambda x, i=i: x[i], value)
      else:
        out[key] = convert(value)
    return out

  return convert(dict(params))


@functools.lru_cache(maxsize=8)
def _capture_fn(cfg: ModelConfig):
  """A jitted forward pass of `cfg` (an inspection config) that also returns the inside views."""
  model = models.build(cfg)

  def run(params, inputs):
    attention, visible, attention_inputs, blocks = {}, {}, {}, {}

    def interceptor(next_fun, args, kwargs, context):
      module = context.module
      if context.method_name != '__call__':
        return next_fun(*args, **kwargs)
      if isinstance(module, MultiHeadAttention) and kwargs.get('cache_mode') is None:
        y, probs = next_fun(*args, **{**kwargs, 'return_probs': True})
        name = '/'.join(module.path)
        attention[name] = probs  # [B, N, T, S]
        T, S = probs.shape[-2:]
        mask = kwargs.get('mask')
        visible[name] = np.ones((1, 1, T, S), bool) if mask is None else mask.dense(T, S)
        attention_inputs[name] = args[0]
        return y
      if isinstance(module, Block):
        y = next_fun(*args, **kwargs)
        blocks['/'.join(module.path)] = y[0] if isinstance(y, tuple) else y
        return y
      return next_fun(*args, **kwargs)

    with nn.intercept_methods(interceptor):
      logits = model.apply({'params': params}, **inputs, deterministic=True)
    return logits, attention, visible, attention_inputs, blocks

  return jax.jit(run)


def capture(cfg: ModelConfig, params: Any, inputs: dict[str, Any]) -> Capture:
  """Runs the model on `inputs` (its keyword arguments, e.g. `train.model_inputs(family, batch)`)
  through the 'xla' path and returns the logits, every attention map and every block's output."""
  inputs = {k: v for k, v in inputs.items() if v is not None}
  out = _capture_fn(inspection_config(cfg))(unscan_params(cfg, params), inputs)
  logits, attention, visible, attention_inputs, blocks = jax.device_get(out)
  as_np = lambda d: {k: np.asarray(v) for k, v in sorted(d.items())}
  return Capture(
    np.asarray(logits), as_np(attention), as_np(visible), as_np(attention_inputs), as_np(blocks)
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
  logs = np.log(np.where(p > 0, p, 1.0))
  return -np.sum(p * logs, axis=-1)


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
  rows = probs.sum(-1) > 0.5  # [B, N, T]: queries that attend (not padding)
  h = row_entropy(probs)  # [B, N, T]
  mean = lambda x, w: (x * w).sum((0, 2)) / np.maximum(w.sum((0, 2)), 1.0)  # over B and T
  several = rows & (counts >= 2)
  normalized = h / np.log(np.maximum(counts, 2))
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


def log_head_entropy(writer, cfg: ModelConfig, params: Any, inputs: dict, step: int, rows=4):
  """Writes each head's mean attention entropy (and each layer's mean) to TensorBoard.

  Called from the training loop every `train.head_entropy_every` steps with the batch it just
  trained on (its first `rows` rows). Only on process 0 of a single-process run: the host batch
  of one process cannot be fed to a computation that spans several.
  """
  if writer is None or jax.process_count() > 1:
    return
  inputs = {k: np.asarray(v)[:rows] for k, v in inputs.items() if v is not None}
  for name, stats in entropy_by_layer(capture(cfg, params, inputs)).items():
    for n, value in enumerate(stats['entropy']):
      writer.scalar(f'head_entropy/{name}/head_{n}', float(value), step)
    writer.scalar(f'head_entropy/{name}/mean', float(np.mean(stats['entropy'])), step)


# Initialisation and activation statistics ----------------------------------------------------
def intended_init(cfg: ModelConfig, path: tuple[str, ...], shape: tuple[int, ...]):
  """(mean, std) that the init scheme of `cfg` intends for the parameter at `path`, or None.

  Projections: Xavier uniform, std sqrt(2 / (fan_in + fan_out)), where an attention projection
  [D, N, H] has fan_in D and fan_out N * H and the output projection [N, H, D] the reverse (flax
  DenseGeneral initialises the flattened matrix); or normal(init_std). Projections into the
  residual stream (attention 'out', 'mlp/wo') are scaled by 1/sqrt(2 * layers of their stack)
  under init='scaled'. Token embeddings: std d_model^-0.5 when scaled by sqrt(d_model), else
  init_std; learned positions and token types: init_std. Biases 0, norm scales 1 (std 0).
  """
  leaf, module = path[-1], (path[-2] if len(path) > 1 else '')
  if leaf in ('bias', 'mlm_bias'):
    return 0.0, 0.0
  if leaf == 'scale':
    return 1.0, 0.0
  if leaf == 'embedding':
    if module == 'embedding':
      return 0.0, (cfg.d_model**-0.5 if cfg.scale_embeddings else cfg.init_std)
    return 0.0, cfg.init_std
  if leaf != 'kernel':
    return None
  residual = module == 'out' or (module == 'wo' and 'mlp' in path)
  if module == 'out':
    fan_in, fan_out = math.prod(shape[:-1]), shape[-1]
  else:
    fan_in, fan_out = shape[0], math.prod(shape[1:])
  if cfg.init_distribution == 'normal':
    std = cfg.init_std
  else:
    std = math.sqrt(2.0 / (fan_in + fan_out))
  if residual and cfg.init == 'scaled':
    layers = cfg.num_layers
    if 'decoder' in path and cfg.family == 'encoder_decoder':
      layers = cfg.decoder_layers
    std /= math.sqrt(2 * layers)
  return 0.0, std


def init_statistics(cfg: ModelConfig, seed: int = 0) -> list[dict[str, Any]]:
  """Mean and std of every freshly initialised parameter, beside what the scheme intends."""
  params = unscan_params(cfg, models.init_params(models.build(cfg), jax.random.PRNGKey(seed)))
  rows = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    names = tuple(str(getattr(p, 'key', p)) for p in path)
    x = np.asarray(leaf, np.float64)
    intended = intended_init(cfg, names, x.shape)
    rows.append(
      {
        'name': '/'.join(names),
        'shape': tuple(x.shape),
        'mean': float(x.mean()),
        'std': float(x.std()),
        'intended_mean': None if intended is None else intended[0],
        'intended_std': None if intended is None else intended[1],
      }
    )
  return rows


def activation_statistics(captured: Capture) -> list[dict[str, Any]]:
  """Mean, std, RMS and largest magnitude of each block's output (the residual stream)."""
  rows = []
  for name, x in captured.blocks.items():
    x = np.asarray(x, np.float64)
    rows.append(
      {
        'name': name,
        'mean': float(x.mean()),
        'std': float(x.std()),
        'rms': float(np.sqrt(np.mean(x**2))),
        'max_abs': float(np.max(np.abs(x))),
      }
    )
  return rows


# Plots (matplotlib, imported when needed) ------------------------------------------------------
def _pyplot():
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  return plt


def _save(fig, path: str) -> str:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110, bbox_inches='tight')
  _pyplot().close(fig)
  return path


def plot_attention(
  maps: np.ndarray,
  path: str,
  *,
  query_labels: list[str] | None = None,
  key_labels: list[str] | None = None,
  title: str = '',
  gold: np.ndarray | None = None,
  panel_titles: list[str] | None = None,
) -> str:
  """One heatmap per head of one example's maps [N, T, S]; `gold` [T, S] bool cells are boxed."""
  plt = _pyplot()
  N, T, S = maps.shape
  cols = min(N, 4)
  rows = -(-N // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(2.2 + 0.18 * S * cols, 0.6 + 0.18 * T * rows))
  axes = np.atleast_1d(axes).ravel()
  for n, ax in enumerate(axes):
    if n >= N:
      ax.axis('off')
      continue
    ax.imshow(maps[n], cmap='viridis', vmin=0, vmax=1, aspect='auto')
    if gold is not None:
      ts, ss = np.nonzero(gold)
      ax.scatter(ss, ts, marker='s', s=18, facecolors='none', edgecolors='red', linewidths=0.6)
    ax.set_title(panel_titles[n] if panel_titles else f'head {n}', fontsize=8)
    ax.set_xticks(range(S))
    ax.set_yticks(range(T))
    ax.set_xticklabels(key_labels or [''] * S, rotation=90, fontsize=6)
    ax.set_yticklabels(query_labels or [''] * T, fontsize=6)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  return _save(fig, path)


def plot_head_entropy(entropies: dict[str, np.ndarray], path: str, title: str = '') -> str:
  """Bars of each head's normalised entropy (0 = one key, 1 = uniform), one group per layer."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(max(4, 0.35 * sum(len(v) for v in entropies.values())), 3))
  x, ticks, labels = 0, [], []
  for name, values in entropies.items():
    positions = np.arange(x, x + len(values))
    ax.bar(positions, values, width=0.8)
    ticks.append(positions.mean())
    labels.append(name.replace('/stack/', '/').replace('_attention', ''))
    x += len(values) + 1
  ax.set_xticks(ticks)
  ax.set_xticklabels(labels, rotation=30, ha='right', fontsize=7)
  ax.set_ylim(0, 1.05)
  ax.set_ylabel('entropy / log(keys)')
  ax.set_title(title or 'attention entropy per head (0 = sharp, 1 = uniform)', fontsize=9)
  return _save(fig, path)


def plot_sinusoidal(d_model: int, path: str, length: int = 128, channels=(0, 2, 8, 32)) -> str:
  """The paper's sinusoidal encoding: a few channels' waveforms and the whole [T, D] table."""
  plt = _pyplot()
  table = np.asarray(positions_lib.sinusoidal(np.arange(length), d_model))  # [T, D]
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3))
  for c in [c for c in channels if c < d_model]:
    left.plot(table[:, c], label=f'channel {c} (sin)')
  left.set_xlabel('position')
  left.legend(fontsize=7)
  left.set_title('sinusoidal waveforms')
  image = right.imshow(table.T, aspect='auto', cmap='RdBu', vmin=-1, vmax=1)
  right.set_xlabel('position')
  right.set_ylabel('channel')
  right.set_title(f'PE table (d_model {d_model})')
  fig.colorbar(image, ax=right)
  return _save(fig, path)


def plot_rope(
  head_dim: int, path: str, *, theta: float = 10000.0, length: int = 256, factor: float = 4.0
) -> str:
  """RoPE: the rotation of a few channel pairs over positions, and the per-pair frequencies of
  each context scaling (none, linear, ntk, yarn at `factor`)."""
  plt = _pyplot()
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
  inv_freq, _ = positions_lib.rope_frequencies(head_dim, theta=theta)
  positions = np.arange(length)
  for i in sorted({0, 1, head_dim // 8, head_dim // 4, head_dim // 2 - 1}):
    angle = positions * float(inv_freq[i])
    left.plot(np.cos(angle) * (1 + 0.1 * i), np.sin(angle) * (1 + 0.1 * i), lw=0.8,
              label=f'pair {i}: {float(inv_freq[i]):.3g} rad/pos')  # fmt: skip
  left.set_aspect('equal')
  left.set_title(f'rotation of (1, 0) over {length} positions')
  left.legend(fontsize=6, loc='upper right')
  for scaling in positions_lib.ROPE_SCALINGS:
    freq, mscale = positions_lib.rope_frequencies(
      head_dim, theta=theta, scaling=scaling, factor=factor if scaling != 'none' else 1.0,
      original_max_length=length,
    )  # fmt: skip
    right.semilogy(np.asarray(freq), label=f'{scaling} (mscale {mscale:.2f})')
  right.set_xlabel('channel pair i')
  right.set_ylabel('frequency (rad / position)')
  right.set_title(f'RoPE frequencies, scaling factor {factor:g}')
  right.legend(fontsize=7)
  return _save(fig, path)


def plot_init_statistics(rows: list[dict], path: str) -> str:
  """Measured against intended std of every initialised weight matrix (the diagonal = as meant)."""
  plt = _pyplot()
  pts = [(r['intended_std'], r['std']) for r in rows if r['intended_std']]
  fig, ax = plt.subplots(figsize=(4, 4))
  if pts:
    x, y = np.array(pts).T
    ax.loglog(x, y, 'o', ms=3)
    low, high = min(x.min(), y.min()) * 0.8, max(x.max(), y.max()) * 1.2
    ax.plot([low, high], [low, high], 'k--', lw=0.7)
  ax.set_xlabel('intended std')
  ax.set_ylabel('measured std')
  ax.set_title('initial weights')
  return _save(fig, path)


# A whole inspection of a trained run ---------------------------------------------------------
def _model_inputs(run, params, text: str) -> tuple[dict[str, np.ndarray], list[str], list[str]]:
  """One example's model inputs for `text`, and the token labels of the target (decoder) and
  source (encoder) sides; an EncoderDecoder's target is its own greedy translation."""
  from transformer import data

  tok, dcfg = run.task.tokenizer, run.config.data
  labels = lambda ids: [tok.decode([i]) or f'<{i}>' for i in ids]
  if run.family == 'encoder_decoder':
    source = tok.encode(text)[: dcfg.max_source_length - 1] + [data.EOS_ID]
    output = run.generate(params, [(text, '')])[0][2]
    target = [data.BOS_ID] + tok.encode(output)[: dcfg.max_target_length - 1]
    inputs = {'inputs': np.array([source]), 'decoder_inputs': np.array([target])}
    return inputs, labels(target), labels(source)
  ids = [data.BOS_ID] + tok.encode(text)[: dcfg.max_length - 2]
  if run.family == 'bidirectional_lm':
    ids.append(data.EOS_ID)
  return {'inputs': np.array([ids])}, labels(ids), labels(ids)


def inspect_run(workdir: str, text: str | None = None, out: str | None = None, step=None) -> str:
  """Attention maps (every layer and head), head entropy, init and activation statistics, and the
  position-encoding plots of a trained run; writes `out`/inspect.md (default workdir/inspect)."""
  from transformer import train

  run, state, step = train.load_run(workdir, step)
  out = out or os.path.join(workdir, 'inspect')
  os.makedirs(out, exist_ok=True)
  if text is None:
    text = run.task.eval_examples(1)[0][0]
  inputs, target_labels, source_labels = _model_inputs(run, state.params, text)
  cfg = run.model_cfg
  captured = capture(cfg, state.params, inputs)
  lines = [f'# Inspection of {workdir} (step {step})', '', f'Input: `{text}`', '']
  lines += ['## Attention maps (the xla path on the trained parameters)', '']
  lines += ['| module | mean entropy per head (nats) | normalised (0 sharp, 1 uniform) |']
  lines += ['|---|---|---|']
  entropies = entropy_by_layer(captured)
  for name, stats in entropies.items():
    shown = ', '.join(f'{x:.2f}' for x in stats['entropy'])
    normalized = ', '.join(f'{x:.2f}' for x in stats['normalized'])
    lines.append(f'| {name} | {shown} | {normalized} |')
  lines.append('')
  for name, probs in captured.attention.items():
    file = name.replace('/', '_') + '.png'
    queries = source_labels if name.startswith('encoder') else target_labels
    keys = source_labels if name.startswith('encoder') or 'cross' in name else target_labels
    T, S = len(queries), len(keys)
    plot_attention(probs[0, :, :T, :S], os.path.join(out, file), query_labels=queries,
                   key_labels=keys, title=name)  # fmt: skip
    lines += [f'![{name}]({file})', '']
  plot_head_entropy(
    {n: s['normalized'] for n, s in entropies.items()}, os.path.join(out, 'entropy.png')
  )
  lines += ['![head entropy](entropy.png)', '', '## Activations (each block output)', '']
  lines += ['| block | mean | std | rms | max abs |', '|---|---|---|---|---|']
  for r in activation_statistics(captured):
    lines.append(
      f'| {r["name"]} | {r["mean"]:.3g} | {r["std"]:.3g} | {r["rms"]:.3g} | {r["max_abs"]:.3g} |'
    )
  rows = init_statistics(cfg, run.config.seed)
  plot_init_statistics(rows, os.path.join(out, 'init.png'))
  lines += ['', f'## Initial weights (seed {run.config.seed}) against the init scheme', '']
  lines += [f'init={cfg.init}, init_distribution={cfg.init_distribution}: see `intended_init`.', '']
  lines += ['| parameter | shape | mean | std | intended std |', '|---|---|---|---|---|']
  for r in rows:
    if r['intended_std']:
      lines.append(
        f'| {r["name"]} | {r["shape"]} | {r["mean"]:.2g} | {r["std"]:.4g} | '
        f'{r["intended_std"]:.4g} |'
      )
  lines += ['', '![init](init.png)', '', '## Position encodings', '']
  if cfg.d_model % 2 == 0:
    plot_sinusoidal(cfg.d_model, os.path.join(out, 'sinusoidal.png'))
    lines += ['![sinusoidal](sinusoidal.png)', '']
  if cfg.head_size % 2 == 0:
    plot_rope(cfg.head_size, os.path.join(out, 'rope.png'), theta=cfg.rope_theta)
    lines += ['![rope](rope.png)', '']
  path = os.path.join(out, 'inspect.md')
  with open(path, 'w') as f:
    f.write('\n'.join(lines) + '\n')
  return path
