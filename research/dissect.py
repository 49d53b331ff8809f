"""Dissecting any model that `transformer.load` opens (a Hugging Face folder or an imported
workdir): attention maps per layer and head, head entropy, per-layer activation distributions with
their outlier feature dimensions, and for causal LMs the logit lens."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from research.inspection import inspect_run, plot_attention, plot_head_entropy
from transformer import data, util
from transformer.config import ModelConfig
from transformer.model import entropy, hooks, norms


# Measures ------------------------------------------------------------------------------------
def outlier_dimensions(x: np.ndarray, top: int = 4, ratio: float = 6.0) -> list[tuple[int, float]]:
  """Feature dimensions whose largest |activation| is at least `ratio` times the median one's.

  Args:
    x: [..., D] activations (e.g. one layer's output over the tokens).
  Returns:
    Up to `top` (dimension, max |x|) pairs, largest first: the "massive activations" that
    Llama-style models carry in a few fixed channels.
  """
  peak = np.abs(np.asarray(x, np.float64)).reshape(-1, x.shape[-1]).max(0)  # [D]
  floor = max(float(np.median(peak)), 1e-12)
  order = np.argsort(-peak)[:top]
  return [(int(d), float(peak[d])) for d in order if peak[d] >= ratio * floor]


def _norm(cfg: ModelConfig, params: dict, x: np.ndarray) -> np.ndarray:
  """The model's final norm (pre-LN stacks) on hidden states [..., D], in float64."""
  if cfg.norm_placement != 'pre':
    return x
  p = {k: np.asarray(v, np.float64) for k, v in params['decoder']['stack']['final_norm'].items()}
  return norms.normalized(cfg.norm, x, cfg.norm_eps, p['scale'], p.get('bias'), 'the logit lens')


def logit_lens(cfg: ModelConfig, params: dict, layers: list[np.ndarray]) -> np.ndarray:
  """Each layer's next-token log-probabilities: the final norm and the output head applied to
  every layer's output [T, D] (a CausalLM). Returns float64 [L, T, V]."""
  if cfg.family != 'causal_lm':
    raise ValueError(f'the logit lens needs a causal_lm model; this one is {cfg.family!r}')
  if cfg.tie_output:
    unembed = np.asarray(params['embedding']['embedding'], np.float64).T  # [D, V]
  else:
    unembed = np.asarray(params['head']['logits']['kernel'], np.float64)  # [D, V]
  logits = np.stack([_norm(cfg, params, np.asarray(h, np.float64)) @ unembed for h in layers])
  logits -= logits.max(-1, keepdims=True)
  return logits - np.log(np.exp(logits).sum(-1, keepdims=True))  # [L, T, V]


# Plots ---------------------------------------------------------------------------------------
def plot_activation_histograms(layers: dict[str, np.ndarray], path: str) -> str:
  """One histogram (log counts) of every layer's output values, side by side."""
  plt = util.pyplot()
  names = list(layers)
  cols = min(4, len(names))
  rows = -(-len(names) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 2.2 * rows), squeeze=False)
  for ax, name in zip(axes.ravel(), names):
    ax.hist(np.asarray(layers[name], np.float64).ravel(), bins=80, log=True)
    ax.set_title(name, fontsize=7)
  for ax in axes.ravel()[len(names) :]:
    ax.axis('off')
  fig.tight_layout()
  return _save(fig, path)


def _save(fig, path: str) -> str:
  fig.savefig(path, dpi=110, bbox_inches='tight')
  util.pyplot().close(fig)
  return path


# The report ----------------------------------------------------------------------------------
def _tokens(model: Any, text: str) -> list[int]:
  tok = model.tokenizer
  if tok is None:
    raise ValueError(f'{model.workdir!r} has no tokenizer.json: inspect needs one to read --text')
  if model.cfg.family == 'causal_lm':  # as generate and score start a text: the model's own bos
    ids = model.prompt_prefix() + tok.encode(text)
  elif getattr(tok, 'kind', None) == 'hf':
    ids = tok.encode(text, add_special_tokens=True)
  else:
    ids = [data.BOS_ID] + tok.encode(text) + [data.EOS_ID]
  return ids[: model.cfg.max_length]


def inspect_model(model: Any, text: str, out: str, *, top: int = 3, max_plots: int = 64) -> str:
  """Writes `out`/inspect.md and its PNGs for `model` (a `transformer.inference.api.Model`) on
  `text`; returns the path of inspect.md. At most `max_plots` attention modules are drawn."""
  if not text:
    raise ValueError('inspect needs --text for an imported model')
  cfg, params = model.cfg, model.params
  os.makedirs(out, exist_ok=True)
  ids = _tokens(model, text)
  piece = getattr(model.tokenizer, 'token', lambda i: None)  # HF tokenizers name [CLS] too
  labels = [model.tokenizer.decode([i]) or piece(i) or f'<{i}>' for i in ids]
  inputs = {'inputs': np.array([ids], np.int32), 'segments': np.ones((1, len(ids)), np.int32)}
  resid = lambda n: n == 'blocks.0.hook_resid_pre' or n.endswith('hook_resid_post')
  _, seen = hooks.run_xla(cfg, params, inputs, lambda n: entropy.patterns_and_scores(n) or resid(n))
  lines = [f'# Inspection of {model.workdir}', '', f'{model!r}', '', f'Input: `{text}`', '']
  lines += [f'Tokens ({len(ids)}): ' + ' '.join(f'`{t}`' for t in labels), '']
  lines += ['## Attention maps (the xla path on the same parameters)', '']
  lines += ['| attention | mean entropy per head (nats) | normalised (0 sharp, 1 uniform) |']
  lines += ['|---|---|---|']
  entropies = entropy.attention_entropy(seen)
  for name, stats in entropies.items():
    shown = ', '.join(f'{x:.2f}' for x in stats['entropy'])
    lines.append(f'| {name} | {shown} | {", ".join(f"{x:.2f}" for x in stats["normalized"])} |')
  lines += ['', '![head entropy](entropy.png)', '']
  plot_head_entropy(
    {n: s['normalized'] for n, s in entropies.items()}, os.path.join(out, 'entropy.png')
  )
  for name in list(entropies)[:max_plots]:
    file = name.replace('.', '_') + '.png'
    plot_attention(seen[f'{name}.hook_pattern'][0], os.path.join(out, file), query_labels=labels,
                   key_labels=labels, title=name)  # fmt: skip
    lines += [f'![{name}]({file})', '']
  # The embeddings (blocks.0.hook_resid_pre), then each layer's output.
  layers = {name: x[0] for name, x in seen.items() if resid(name)}
  lines += ['## Activations (the residual stream after each layer)', '']
  lines += [
    '| layer | mean | std | max abs | outlier dims (dim: max abs) |',
    '|---|---|---|---|---|',
  ]
  for name, x in layers.items():
    x64 = np.asarray(x, np.float64)
    outliers = ', '.join(f'{d}: {v:.3g}' for d, v in outlier_dimensions(x64)) or '-'
    lines.append(
      f'| {name} | {x64.mean():.3g} | {x64.std():.3g} | {np.abs(x64).max():.3g} | {outliers} |'
    )
  plot_activation_histograms(layers, os.path.join(out, 'activations.png'))
  lines += ['', '![activation histograms](activations.png)', '']
  if cfg.family == 'causal_lm':
    lens = logit_lens(cfg, params, list(layers.values())[1:])
    lines += ['## Logit lens (each layer through the final norm and the head)', '']
    lines += [f'Top {top} next-token guesses after the last token `{labels[-1]}`; then the top '
              'guess at every position.', '']  # fmt: skip
    lines += ['| layer | last position | every position |', '|---|---|---|']
    decode = lambda t: model.tokenizer.decode([int(t)]) or f'<{int(t)}>'
    for i, logp in enumerate(lens):
      best = np.argsort(-logp[-1])[:top]
      last = ', '.join(f'`{decode(t)}` {np.exp(logp[-1, t]):.2f}' for t in best)
      every = ' '.join(f'`{decode(t)}`' for t in logp.argmax(-1))
      lines.append(f'| blocks.{i}.hook_resid_post | {last} | {every} |')
    lines.append('')
  path = os.path.join(out, 'inspect.md')
  with open(path, 'w') as f:
    f.write('\n'.join(lines) + '\n')
  return path


def inspect(
  workdir: str, text: str | None = None, out: str | None = None, step=None, corrupt=None
) -> str:
  """What experiments.inspect runs: `inspect_model` for a Hugging Face folder or a workdir imported
  from one (default out: DIR/inspect), else `inspection.inspect_run` for a sparrow run. With
  `corrupt` (a causal LM and --text), also `interventions.corruption_report` into the same out."""
  from transformer.inference import hf
  from transformer.inference.api import load

  if corrupt is not None and not text:
    raise ValueError('--corrupt needs --text: the clean prompt it is compared with')
  out = out or os.path.join(workdir, 'inspect')
  if hf.is_hf_dir(workdir) or os.path.isfile(os.path.join(workdir, hf.HF_CONFIG)):
    path = inspect_model(load(workdir, step), text, out)
  else:
    path = inspect_run(workdir, text, out, step)
  if corrupt is not None:
    from research import interventions

    model = load(workdir, step)
    clean, corrupted = _tokens(model, text), _tokens(model, corrupt)
    piece = getattr(model.tokenizer, 'token', lambda i: None)
    label = lambda ids: [model.tokenizer.decode([i]) or piece(i) or f'<{i}>' for i in ids]
    interventions.corruption_report(model, clean, corrupted, (label(clean), label(corrupted)), out)
    with open(path, 'a') as f:
      f.write(f'\nPatching the clean prompt into `{corrupt}`: [patching.md](patching.md)\n')
  return path
