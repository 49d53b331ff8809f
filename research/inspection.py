"""Looking inside a model: parameter tables, attention maps and head entropy, init and activation
statistics, and plots of the position encodings.

Attention maps always come from the 'xla' path (the only one that returns probabilities), rerun on
the same parameters: a model trained with 'chunked' or 'pallas' is inspected through the same
numbers up to floating-point tolerance. Nothing here changes how a model trains.
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import numpy as np

from transformer import data, util
from transformer.config import ModelConfig
from transformer.model import entropy, hooks, models, scan
from transformer.model import positions as positions_lib
from transformer.training.workdir import load_run


# Initialisation and activation statistics ----------------------------------------------------
def intended_init(cfg: ModelConfig, path: tuple[str, ...], shape: tuple[int, ...]):
  """(mean, std) that the init scheme of `cfg` intends for the parameter at `path`, or None.

  Projections: Xavier uniform, std sqrt(2 / (fan_in + fan_out)), where an attention projection
  [D, N, H] has fan_in D and fan_out N * H and the output projection [N, H, D] the reverse (flax
  DenseGeneral initialises the flattened matrix); or normal(init_std). Projections into the
  residual stream (attention 'out', 'mlp/wo') are scaled by 1/sqrt(2 * layers of their stack)
  under init='scaled', by sqrt(2 * layers) under 'large'. Token embeddings: std d_model^-0.5
  when scaled by sqrt(d_model), else init_std; learned positions and token types: init_std.
  Biases 0, norm scales 1 (std 0).
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
  if residual and cfg.init != 'plain':
    layers = cfg.num_layers
    if 'decoder' in path and cfg.family == 'encoder_decoder':
      layers = cfg.decoder_layers
    std *= math.sqrt(2 * layers) ** (1 if cfg.init == 'large' else -1)
  return 0.0, std


def init_statistics(cfg: ModelConfig, seed: int = 0) -> list[dict[str, Any]]:
  """Mean and std of every freshly initialised parameter, beside what the scheme intends."""
  params = scan.unscan_params(cfg, models.init_params(models.build(cfg), jax.random.PRNGKey(seed)))
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


def activation_statistics(cache: dict[str, np.ndarray]) -> list[dict[str, Any]]:
  """Mean, std, RMS and largest magnitude of each block's output (hook_resid_post) in `cache`."""
  rows = []
  for name, x in cache.items():
    if not name.endswith('hook_resid_post'):
      continue
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


def _save(fig, path: str) -> str:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110, bbox_inches='tight')
  util.pyplot().close(fig)
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
  plt = util.pyplot()
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
  plt = util.pyplot()
  fig, ax = plt.subplots(figsize=(max(4, 0.35 * sum(len(v) for v in entropies.values())), 3))
  x, ticks = 0, []
  for values in entropies.values():
    positions = np.arange(x, x + len(values))
    ax.bar(positions, values, width=0.8)
    ticks.append(positions.mean())
    x += len(values) + 1
  ax.set_xticks(ticks)
  ax.set_xticklabels(list(entropies), rotation=30, ha='right', fontsize=7)
  ax.set_ylim(0, 1.05)
  ax.set_ylabel('entropy / log(keys)')
  ax.set_title(title or 'attention entropy per head (0 = sharp, 1 = uniform)', fontsize=9)
  return _save(fig, path)


def plot_sinusoidal(d_model: int, path: str, length: int = 128, channels=(0, 2, 8, 32)) -> str:
  """The paper's sinusoidal encoding: a few channels' waveforms and the whole [T, D] table."""
  plt = util.pyplot()
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
  plt = util.pyplot()
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
  plt = util.pyplot()
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
  position-encoding plots of a trained run; writes `out`/inspect.md (default workdir/inspect).

  `dissect.inspect` also takes Hugging Face folders and workdirs imported from them.
  """
  run, state, step = load_run(workdir, step)
  out = out or os.path.join(workdir, 'inspect')
  os.makedirs(out, exist_ok=True)
  if text is None:
    text = run.task.eval_examples(1)[0][0]
  inputs, target_labels, source_labels = _model_inputs(run, state.params, text)
  cfg = run.model_cfg
  wanted = lambda n: entropy.patterns_and_scores(n) or n.endswith('hook_resid_post')
  _, cache = hooks.run_xla(cfg, state.params, inputs, wanted)
  lines = [f'# Inspection of {workdir} (step {step})', '', f'Input: `{text}`', '']
  lines += ['## Attention maps (the xla path on the trained parameters)', '']
  lines += ['| attention | mean entropy per head (nats) | normalised (0 sharp, 1 uniform) |']
  lines += ['|---|---|---|']
  entropies = entropy.attention_entropy(cache)
  for name, stats in entropies.items():
    shown = ', '.join(f'{x:.2f}' for x in stats['entropy'])
    normalized = ', '.join(f'{x:.2f}' for x in stats['normalized'])
    lines.append(f'| {name} | {shown} | {normalized} |')
  lines.append('')
  for name in entropies:
    probs, file = cache[f'{name}.hook_pattern'], name.replace('.', '_') + '.png'
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
  for r in activation_statistics(cache):
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
