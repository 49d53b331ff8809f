"""Depth and initialisation: how the residual stream grows through a freshly initialised stack,
and how often the training loss spikes (the output-init ablation, seed §4.2).

`residual_growth` reads the step-0 parameters of a run (the same seed, the same init as its
first step) through the hook points; `spikes` reads the run's own training curve.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from research import results as results_lib
from transformer.model import hooks as hooks_lib
from transformer.training.state import model_inputs


def _rms(x: np.ndarray, real: np.ndarray) -> float:
  """Root mean square over the real (non-padding) tokens of [B, T, D]."""
  x = np.asarray(x, np.float64)[real]
  return float(np.sqrt(np.mean(x * x)))


def residual_growth(cfg, params, inputs: dict, real: np.ndarray) -> dict[str, Any]:
  """Per-layer RMS of the residual stream and of what each block adds to it, for one batch.

  Returns `rms` [L + 1] (the stream entering each block, then leaving the last), `branch` [L]
  (RMS of the block's output minus its input: the residual branches' sum) and their ratios:
  init.growth = rms[-1] / rms[0] (how much the stack amplifies its input) and
  init.branch_ratio = mean over layers of branch / stream in (how far one block moves the stream;
  'keeps the early residual outputs near the input' means small).
  """
  layers = cfg.num_layers
  names = [f'blocks.{i}.hook_resid_pre' for i in range(layers)]
  names += [f'blocks.{layers - 1}.hook_resid_post']
  _, cache = hooks_lib.run_jit(cfg, params, inputs, names=names)
  streams = [cache[f'blocks.{i}.hook_resid_pre'] for i in range(layers)]
  streams.append(cache[f'blocks.{layers - 1}.hook_resid_post'])
  rms = np.array([_rms(s, real) for s in streams])
  branch = np.array(
    [_rms(np.asarray(b) - np.asarray(a), real) for a, b in zip(streams, streams[1:])]
  )
  return {
    'rms': rms,
    'branch': branch,
    'init.growth': float(rms[-1] / rms[0]),
    'init.branch_ratio': float(np.mean(branch / rms[:-1])),
  }


def spikes(losses: Sequence[float], window: int = 5, rise: float = 0.1, skip: int = 0) -> dict:
  """Loss spikes in a training curve: logs whose loss exceeds the median of the `window` logs
  before them by more than `rise` of that median (after the first `skip` logs).

  Returns train.spikes (how many) and train.max_jump (the largest such excess, as a share of the
  median; 0 when the curve never rises above it)."""
  losses = np.asarray(losses, np.float64)
  count, worst = 0, 0.0
  for i in range(max(window, skip), len(losses)):
    before = float(np.median(losses[i - window : i]))
    jump = (losses[i] - before) / before if before > 0 else 0.0
    if not np.isfinite(losses[i]):
      jump = np.inf
    worst = max(worst, jump)
    count += int(jump > rise)
  return {'train.spikes': float(count), 'train.max_jump': float(worst)}


def measure(ctx, batches: int = 2, window: int = 5, rise: float = 0.1) -> dict[str, Any]:
  """`residual_growth` of the step-0 parameters on `batches` training batches, `spikes` of the
  logged training loss after warmup, and a figure of the stream's RMS through the stack."""
  run, _ = ctx.load()
  if run.family != 'causal_lm':
    raise ValueError(f'the stability measure reads a causal LM; this run is {run.family!r}')
  params = run.init_state().params  # step 0: the seed's own init, exactly as training began
  iterator = run.task.train_iterator()
  rows = []
  for _ in range(batches):
    batch = next(iterator)
    real = (
      np.asarray(batch['weights']) > 0
      if 'weights' in batch
      else np.ones(batch['inputs'].shape, bool)
    )
    rows.append(residual_growth(run.model_cfg, params, model_inputs(run.family, batch), real))
  rms = np.mean([r['rms'] for r in rows], axis=0)
  out: dict[str, Any] = {
    'init.growth': float(np.mean([r['init.growth'] for r in rows])),
    'init.branch_ratio': float(np.mean([r['init.branch_ratio'] for r in rows])),
  }
  train = results_lib.read_curve(ctx.run_dir)['train']
  log_every = int(ctx.config.train.log_every)
  skip = int(ctx.config.optim.warmup_steps) // max(log_every, 1)
  out.update(spikes([r['loss'] for r in train], window, rise, skip))
  out['figures'] = [plot(rms, os.path.join(ctx.run_dir, 'residual_rms.png'), ctx.variant)]
  return out


def plot(rms: np.ndarray, path: str, title: str) -> str:
  """The residual stream's RMS entering each block (and leaving the last) at step 0."""
  from transformer import util

  plt = util.pyplot()
  fig, ax = plt.subplots(figsize=(4.5, 3))
  ax.plot(np.arange(len(rms)), rms, marker='o', ms=3)
  ax.set_yscale('log')
  ax.set_xlabel('layer (stream entering it; last: the output)')
  ax.set_ylabel('RMS at step 0')
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return os.path.basename(path)
