"""Interventions on a model through its hook points (transformer.model.hooks): head ablation,
activation patching, attribution patching, direct logit attribution and head detectors.

Every function takes a model config, its parameters and model inputs (the keyword arguments of
the model, e.g. {'inputs': ids [B, T]}), so it serves sparrow's own runs and imported Hugging Face
models alike; `inference.Model` wraps the common ones. A `metric` maps logits [B, T, V] to a
scalar, e.g. `logit_diff(position, good, bad)`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer import data
from transformer.config import ModelConfig
from transformer.model import hooks, models, norms, probes

Metric = Callable[[jax.Array], jax.Array]
# The activations `patching` can patch, by position ([L, T] maps) or by head ([L, N] maps).
PATCHABLE = {
  'resid_pre': 'hook_resid_pre',
  'attn_out': 'hook_attn_out',
  'mlp_out': 'hook_mlp_out',
  'z': 'attn.hook_z',
}
ABLATIONS = ('zero', 'mean', 'resample')


def logit_diff(position: int, good: Any, bad: Any) -> Metric:
  """Mean over rows of logit[good] - logit[bad] at `position` (negative counts from the end).
  `good` and `bad` are token ids, or one id per row ([B], as in IOI: each prompt's own names)."""
  good, bad = jnp.asarray(good, jnp.int32), jnp.asarray(bad, jnp.int32)

  def metric(logits):
    last = logits[:, position]  # [B, V]
    pick = lambda ids: jnp.take_along_axis(last, jnp.broadcast_to(ids, last.shape[:1])[:, None], 1)
    return jnp.mean(pick(good) - pick(bad))

  return metric


def _check_heads(cfg: ModelConfig, heads: Sequence[tuple[int, int]]) -> None:
  for layer, head in heads:
    if not (0 <= layer < cfg.num_layers and 0 <= head < cfg.num_heads):
      raise ValueError(
        f'head (layer={layer}, head={head}) does not exist: layers are 0..{cfg.num_layers - 1} '
        f'and heads 0..{cfg.num_heads - 1}'
      )


def _ablation_source(cfg, params, inputs, layers, mode, reference, seed) -> Callable:
  """fn(z, name) -> what replaces every head of hook_z `name` under `mode` (the caller picks the
  heads): zeros, the mean over the rows of `reference` (per position), or a random reference
  row's."""
  if mode not in ABLATIONS:
    raise ValueError(f'mode={mode!r} is not valid; choose one of {ABLATIONS}')
  ref = None
  if mode != 'zero':
    if reference is None:
      raise ValueError(f"mode={mode!r} needs a reference batch (reference={{'inputs': ...}})")
    names = [f'blocks.{layer}.attn.hook_z' for layer in layers]
    ref = hooks.run_jit(cfg, params, reference, names=names)[1]
    T_ref, T = int(np.shape(reference['inputs'])[1]), int(np.shape(inputs['inputs'])[1])
    if T_ref != T:
      raise ValueError(f'the reference batch has rows of {T_ref} tokens and the input {T}')
  rows = np.random.default_rng(seed).integers(0, 1 << 30, int(np.shape(inputs['inputs'])[0]))

  def new(z, name):
    if mode == 'zero':
      return jnp.zeros_like(z)
    other = ref[name]  # [B', T, N, H]
    if mode == 'mean':
      return jnp.broadcast_to(other.mean(0), z.shape)
    return other[rows % other.shape[0]]

  return new


def ablate_heads(
  cfg: ModelConfig,
  params: Any,
  inputs: dict,
  heads: Sequence[tuple[int, int]],
  mode: str = 'zero',
  reference: dict | None = None,
  seed: int = 0,
) -> jax.Array:
  """Logits with the outputs (hook_z) of `heads` [(layer, head), ...] replaced: by zeros, by their
  mean over the rows of a `reference` batch (per position), or by a random reference row's."""
  _check_heads(cfg, heads)
  layers = sorted({layer for layer, _ in heads})
  new = _ablation_source(cfg, params, inputs, layers, mode, reference, seed)

  def replace(layer):
    which = [h for l_, h in heads if l_ == layer]
    return lambda z, name: z.at[:, :, which].set(new(z, name)[:, :, which])

  hook_fns = {f'blocks.{layer}.attn.hook_z': replace(layer) for layer in layers}
  return hooks.run(cfg, params, inputs, hooks=hook_fns)[0]


def head_ablation_effects(
  cfg: ModelConfig,
  params: Any,
  inputs: dict,
  metric: Metric,
  mode: str = 'zero',
  reference: dict | None = None,
  seed: int = 0,
) -> np.ndarray:
  """[L, N]: how much ablating each head alone (as `ablate_heads`) changes `metric`; one compiled
  forward per layer, the head a traced index."""
  new = _ablation_source(cfg, params, inputs, range(cfg.num_layers), mode, reference, seed)
  base = float(metric(hooks.run_jit(cfg, params, inputs)[0]))
  out = np.zeros((cfg.num_layers, cfg.num_heads))
  for layer in range(cfg.num_layers):
    name = f'blocks.{layer}.attn.hook_z'

    def ablated(params, inputs, head, name=name):
      put = lambda z, _: z.at[:, :, head].set(new(z, name)[:, :, head])
      return metric(hooks.run(cfg, params, inputs, hooks={name: put})[0])

    fn = jax.jit(ablated)
    for head in range(cfg.num_heads):
      out[layer, head] = float(fn(params, inputs, head)) - base
  return out


def _name(cfg: ModelConfig, activation: str, layer: int) -> str:
  if activation not in PATCHABLE:
    raise ValueError(f'activation={activation!r} is not valid; choose one of {tuple(PATCHABLE)}')
  return f'blocks.{layer}.{PATCHABLE[activation]}'


def patching(
  cfg: ModelConfig, params: Any, clean: dict, corrupted: dict, metric: Metric, activation: str
) -> np.ndarray:
  """Activation patching: the metric of the corrupted run with one activation taken from the
  clean run, for every layer and position ([L, T]; activation 'resid_pre', 'attn_out' or
  'mlp_out') or every layer and head ([L, N]; activation 'z', all positions at once)."""
  names = [_name(cfg, activation, layer) for layer in range(cfg.num_layers)]
  _, cache = hooks.run_jit(cfg, params, clean, names=names)
  T = int(np.shape(corrupted['inputs'])[1])
  if int(np.shape(clean['inputs'])[1]) != T:
    raise ValueError('clean and corrupted inputs must have the same shape [B, T]')
  count = cfg.num_heads if activation == 'z' else T
  out = np.zeros((cfg.num_layers, count), np.float32)
  for layer, name in enumerate(names):
    source = cache[name]

    def patched(params, inputs, index, name=name, source=source):
      axis = 2 if activation == 'z' else 1
      pick = lambda x: jnp.take(x, index, axis=axis)
      put = lambda x: (
        x.at[:, :, index].set(pick(source)) if axis == 2 else x.at[:, index].set(pick(source))
      )
      logits, _ = hooks.run(cfg, params, inputs, hooks={name: lambda x, _: put(x)})
      return metric(logits)

    fn = jax.jit(patched)
    for index in range(count):
      out[layer, index] = float(fn(params, corrupted, index))
  return out


def attribution_patching(
  cfg: ModelConfig, params: Any, clean: dict, corrupted: dict, metric: Metric, activation: str
) -> np.ndarray:
  """The gradient approximation of `patching` (Nanda 2023): metric(corrupted) plus
  (clean - corrupted) . d metric / d activation at the corrupted run, per layer and position (or
  head), from one forward and one backward pass."""
  names = [_name(cfg, activation, layer) for layer in range(cfg.num_layers)]
  clean_acts = hooks.run_jit(cfg, params, clean, names=names)[1]
  corr_logits, corr_acts = hooks.run_jit(cfg, params, corrupted, names=names)
  base = float(metric(corr_logits))

  def with_deltas(deltas):
    add = {name: (lambda x, n, name=name: x + deltas[name]) for name in names}
    return metric(hooks.run(cfg, params, corrupted, hooks=add)[0])

  zeros = {name: jnp.zeros_like(corr_acts[name]) for name in names}
  grads = jax.jit(jax.grad(with_deltas))(zeros)
  out = []
  for name in names:
    product = (clean_acts[name] - corr_acts[name]) * grads[name]  # [B, T, D] or [B, T, N, H]
    if activation == 'z':
      out.append(np.asarray(product.sum((0, 1, 3))))  # [N]
    else:
      out.append(np.asarray(product.sum((0, 2))))  # [T]
  return base + np.stack(out)


def direct_logit_attribution(
  cfg: ModelConfig, params: Any, inputs: dict, position: int, good: Any, bad: Any
) -> dict[str, np.ndarray]:
  """The logit difference logit[good] - logit[bad] at `position`, split over what wrote to the
  residual stream: the embeddings, every head, each attention's output bias, every MLP, and the
  final norm's bias. Each part goes through the final norm with its cached scale (centred for a
  LayerNorm) and the unembedding, so the parts sum to the logit difference. {part: [B]}.
  `good` and `bad` are token ids, or one id per row ([B])."""
  if cfg.family != 'causal_lm' or cfg.norm_placement != 'pre' or not cfg.residual:
    raise ValueError(
      'direct_logit_attribution splits the residual stream of a pre-LN causal_lm model; this one '
      f'is family={cfg.family!r}, norm_placement={cfg.norm_placement!r}, residual={cfg.residual}'
    )
  L = cfg.num_layers
  names = ['blocks.0.hook_resid_pre', 'ln_final.hook_scale']
  names += [f'blocks.{l_}.attn.hook_z' for l_ in range(L)]
  names += [f'blocks.{l_}.hook_mlp_out' for l_ in range(L) if cfg.d_ff]
  logits, cache = hooks.run_jit(cfg, params, inputs, names=names)
  module = models.build(hooks.hook_config(cfg))
  D = cfg.d_model
  unembed = module.apply({'params': params}, jnp.eye(D)[None], method=lambda m, x: m.head(x))[0]
  B = int(np.shape(inputs['inputs'])[0])
  good, bad = (np.broadcast_to(np.asarray(x, np.int64), (B,)) for x in (good, bad))
  unembed = np.asarray(unembed, np.float64)
  direction = unembed[:, good].T - unembed[:, bad].T  # [B, D]: each row's own target pair
  norm = params['decoder']['stack']['final_norm']
  w = norms.gain(cfg.norm, np.asarray(norm['scale'], np.float64))
  scale = np.asarray(cache['ln_final.hook_scale'], np.float64)[:, position]  # [B, 1]

  def through(x):  # [B, D] at `position` -> [B]
    x = norms.centred(cfg.norm, np.asarray(x, np.float64), 'direct logit attribution')
    return ((x / scale * w) * direction).sum(-1)

  parts = {'embed': through(cache['blocks.0.hook_resid_pre'][:, position])}
  for layer in range(L):
    attn = params['decoder']['stack'][f'layer_{layer}']['self_attention']['out']
    w_o = np.asarray(attn['kernel'], np.float64)  # [N, H, D]
    z = np.asarray(cache[f'blocks.{layer}.attn.hook_z'], np.float64)[:, position]  # [B, N, H]
    for head in range(cfg.num_heads):
      parts[f'blocks.{layer}.attn.head_{head}'] = through(z[:, head] @ w_o[head])
    if 'bias' in attn:
      bias = np.broadcast_to(np.asarray(attn['bias'], np.float64), (z.shape[0], D))
      parts[f'blocks.{layer}.attn.bias'] = through(bias)
    if cfg.d_ff:
      parts[f'blocks.{layer}.mlp'] = through(cache[f'blocks.{layer}.hook_mlp_out'][:, position])
  if 'bias' in norm:
    parts['ln_final.bias'] = direction @ np.asarray(norm['bias'], np.float64)
  last = np.asarray(logits[:, position], np.float64)  # [B, V]
  parts['total'] = last[np.arange(B), good] - last[np.arange(B), bad]
  return parts


# Head detectors on repeated random tokens -----------------------------------------------------
repeated_tokens = probes.repeated_tokens
detector_scores = probes.detector_scores


def head_detectors(
  cfg: ModelConfig,
  params: Any,
  length: int = 25,
  batch: int = 8,
  seed: int = 0,
  prefix: Sequence[int] = (data.BOS_ID,),
) -> dict[str, np.ndarray]:
  """`detector_scores` of every layer ({kind: [L, N]}) and the induction loss: the mean loss on
  the second copy of `repeated_tokens` (low when the model copies from context), with the
  first copy's for comparison. Each row starts with `prefix`: pass the model's own
  (`inference.Model.prompt_prefix()`: an imported GPT-2's bos is not sparrow's)."""
  tokens = repeated_tokens(cfg.vocab_size, length, batch, seed, prefix=prefix)
  return probes.induction_probe(cfg, params, tokens)


# The report of a clean and a corrupted prompt (experiments.inspect --corrupt) -----------------
def heatmap(values: np.ndarray, path: str, title: str, xlabel: str, xticks=None) -> str:
  """Saves [L, X] values as a heatmap, one row a layer, red/blue around 0; returns the file name."""
  from transformer import util

  plt = util.pyplot()
  L, X = values.shape
  fig, ax = plt.subplots(figsize=(1.5 + 0.35 * X, 1.0 + 0.35 * L))
  limit = max(float(np.nanmax(np.abs(values))), 1e-6)
  image = ax.imshow(values, cmap='RdBu', vmin=-limit, vmax=limit, aspect='auto')
  ax.set_xticks(range(X), xticks if xticks is not None else range(X), rotation=90, fontsize=6)
  ax.set_yticks(range(L), [f'layer {i}' for i in range(L)], fontsize=7)
  ax.set_xlabel(xlabel, fontsize=8)
  ax.set_title(title, fontsize=9)
  fig.colorbar(image, ax=ax, fraction=0.04)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return os.path.basename(path)


def bars(parts: dict[str, float], path: str, title: str) -> str:
  """Saves {name: value} as a bar chart; returns the file name."""
  from transformer import util

  plt = util.pyplot()
  fig, ax = plt.subplots(figsize=(max(4.0, 0.22 * len(parts)), 3.2))
  ax.bar(range(len(parts)), list(parts.values()), color='tab:blue')
  ax.set_xticks(range(len(parts)), list(parts), rotation=90, fontsize=6)
  ax.axhline(0, color='k', lw=0.5)
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return os.path.basename(path)


def corruption_report(model: Any, clean: list[int], corrupt: list[int], labels, out: str) -> str:
  """Writes `out`/patching.md for a causal LM (`inference.Model`) on a clean and a corrupted
  prompt of the same length: the logit difference between the clean and the corrupted run's
  top next tokens, activation patching of the residual stream, attention and MLP outputs by
  layer and position and of every head, the effect of zero-ablating each head on the clean run,
  direct logit attribution (pre-LN models) and the head detector scores."""
  cfg, params = model.cfg, model.params
  if cfg.family != 'causal_lm':
    raise ValueError(f'--corrupt needs a causal_lm model (next-token logits), not {cfg.family!r}')
  if len(clean) != len(corrupt):
    raise ValueError(
      f'--corrupt must give as many tokens as --text to patch position by position: {len(corrupt)} '
      f'against {len(clean)}'
    )
  os.makedirs(out, exist_ok=True)
  clean_in = {'inputs': jnp.asarray([clean], jnp.int32)}
  corr_in = {'inputs': jnp.asarray([corrupt], jnp.int32)}
  clean_logits = np.asarray(hooks.run_jit(cfg, params, clean_in)[0])[0, -1]
  corr_logits = np.asarray(hooks.run_jit(cfg, params, corr_in)[0])[0, -1]
  good, bad = int(clean_logits.argmax()), int(corr_logits.argmax())
  if good == bad:  # the corruption does not change the top guess: compare with the runner-up
    bad = int(np.argsort(-clean_logits)[1])
  metric = logit_diff(-1, good, bad)
  name = lambda t: model.tokenizer.decode([t]) or f'<{t}>'
  clean_m, corr_m = (
    float(clean_logits[good] - clean_logits[bad]),
    float(corr_logits[good] - corr_logits[bad]),
  )
  span = clean_m - corr_m if abs(clean_m - corr_m) > 1e-6 else 1.0
  lines = ['# Patching a clean into a corrupted prompt', '']
  lines += [f'Clean: {" ".join(f"`{t}`" for t in labels[0])}', '']
  lines += [f'Corrupted: {" ".join(f"`{t}`" for t in labels[1])}', '']
  lines += [
    f'Metric: logit(`{name(good)}`) - logit(`{name(bad)}`) after the last token: '
    f'{clean_m:.3f} clean, {corr_m:.3f} corrupted. The maps show (patched - corrupted) / '
    '(clean - corrupted): 1 where one activation taken from the clean run restores the clean '
    'metric, 0 where it changes nothing.',
    '',
  ]
  for activation, xlabel in (('resid_pre', 'position'), ('attn_out', 'position'),
                             ('mlp_out', 'position'), ('z', 'head')):  # fmt: skip
    if activation == 'mlp_out' and not cfg.d_ff:
      continue  # attention only
    values = (patching(cfg, params, clean_in, corr_in, metric, activation) - corr_m) / span
    ticks = labels[0] if xlabel == 'position' else None
    file = heatmap(values, os.path.join(out, f'patch_{activation}.png'),
                    f'patching {activation}', xlabel, ticks)  # fmt: skip
    lines += [
      f'## Patching `{activation}` by layer and {xlabel}',
      '',
      f'![{activation}]({file})',
      '',
    ]
  effect = head_ablation_effects(cfg, params, clean_in, metric)
  file = heatmap(effect, os.path.join(out, 'ablation.png'), 'zero-ablating one head', 'head')
  lines += ['## Zero-ablating each head (change of the clean metric)', '', f'![ablation]({file})']
  lines.append('')
  if cfg.norm_placement == 'pre':
    parts = direct_logit_attribution(cfg, params, clean_in, -1, good, bad)
    total = float(parts.pop('total')[0])
    parts = {k: float(v[0]) for k, v in parts.items()}
    file = bars(parts, os.path.join(out, 'dla.png'), f'direct logit attribution (sum {total:.3f})')
    top = sorted(parts.items(), key=lambda kv: -abs(kv[1]))[:5]
    lines += ['## Direct logit attribution on the clean prompt', '', f'![dla]({file})', '']
    lines += ['Largest parts: ' + ', '.join(f'{k} {v:+.3f}' for k, v in top), '']
  scores = head_detectors(cfg, params, prefix=model.prompt_prefix())
  lines += ['## Head detectors (repeated random tokens)', '']
  lines += [f'Induction loss {scores["induction_loss"]:.3f} nats on the repeated half, '
            f'{scores["first_copy_loss"]:.3f} on the first.', '']  # fmt: skip
  lines += ['| layer | previous token | duplicate token | induction |', '|---|---|---|---|']
  fmt = lambda row: ', '.join(f'{x:.2f}' for x in row)
  for layer in range(cfg.num_layers):
    row = [fmt(scores[k][layer]) for k in ('previous_token', 'duplicate_token', 'induction')]
    lines.append(f'| {layer} | ' + ' | '.join(row) + ' |')
  path = os.path.join(out, 'patching.md')
  with open(path, 'w') as f:
    f.write('\n'.join(lines) + '\n')
  return path
