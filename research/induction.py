"""The induction phase change (Olsson et al. 2022), read from a run's own telemetry.

A run trained with `train.induction_every` logs, every few steps, each head's induction score on
repeated random tokens and the in-context loss of the batch (`model.probes`). `phase_change`
turns that curve into numbers a rule can test: how high the best induction score ends, over how
few steps it rises, and whether the in-context loss falls at the same time.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from research import results as results_lib


def _smooth(values: np.ndarray, width: int = 3) -> np.ndarray:
  """A running median over `width` logs (the ends use what they have)."""
  half = width // 2
  return np.array([np.median(values[max(0, i - half) : i + half + 1]) for i in range(len(values))])


def _first(mask: np.ndarray) -> int | None:
  hits = np.flatnonzero(mask)
  return int(hits[0]) if len(hits) else None


def phase_change(rows: Sequence[dict], steps: int, window: int = 3) -> dict[str, float]:
  """Numbers of an induction curve (the 'induction' rows of metrics.jsonl) of a `steps`-step run.

  induction.final: the best head's induction score, mean of the last 3 logs (chance is about
    1 / the keys a query sees).
  induction.rise_fraction: the share of training in which the (smoothed) best score climbs from
    20% to 80% of its rise from the first log to the end; NaN when it rises by < 0.05.
  induction.onset: where it first reaches 50% of that rise, as a share of training.
  in_context.final / in_context.start: the in-context loss (late minus early tokens of each
    document), mean of the last 3 logs / the first log.
  phase.lag: the distance, as a share of training, between the steepest rise of the best
    induction score and the steepest fall of the in-context loss, each over `window` logs; NaN
    when the score does not rise.
  """
  rows = sorted((r for r in rows if 'induction.max' in r), key=lambda r: r['step'])
  if len(rows) < 2 * window:
    raise ValueError(
      f'{len(rows)} induction logs are too few to find a phase change; log more often '
      '(train.induction_every)'
    )
  at = np.array([r['step'] for r in rows], float)
  score = _smooth(np.array([r['induction.max'] for r in rows], float))
  icl = _smooth(np.array([r['induction.in_context_loss'] for r in rows], float))
  start, final = score[0], float(np.mean([r['induction.max'] for r in rows[-3:]]))
  out = {
    'induction.final': final,
    'in_context.final': float(np.mean([r['induction.in_context_loss'] for r in rows[-3:]])),
    'in_context.start': float(rows[0]['induction.in_context_loss']),
    'induction.rise_fraction': float('nan'),
    'induction.onset': float('nan'),
    'phase.lag': float('nan'),
  }
  rise = final - start
  if rise < 0.05:
    return out
  t20 = _first(score >= start + 0.2 * rise)
  t80 = _first(score >= start + 0.8 * rise)
  t50 = _first(score >= start + 0.5 * rise)
  if t20 is not None and t80 is not None:
    out['induction.rise_fraction'] = float((at[t80] - at[t20]) / steps)
  if t50 is not None:
    out['induction.onset'] = float(at[t50] / steps)
  climb = score[window:] - score[:-window]  # over `window` logs, ending at i + window
  fall = icl[:-window] - icl[window:]
  centre = (at[window:] + at[:-window]) / 2
  out['phase.lag'] = float(abs(centre[np.argmax(climb)] - centre[np.argmax(fall)]) / steps)
  return out


def measure(ctx) -> dict[str, Any]:
  """`phase_change` of this run's telemetry, and its curves as a figure."""
  rows = results_lib.read_curve(ctx.run_dir)['induction']
  out: dict[str, Any] = phase_change(rows, int(ctx.config.train.steps))
  out['figures'] = [plot(rows, os.path.join(ctx.run_dir, 'induction.png'), ctx.variant)]
  return out


def plot(rows: Sequence[dict], path: str, title: str) -> str:
  """The best induction and previous-token scores and the in-context loss against steps."""
  from transformer import util

  plt = util.pyplot()
  at = [r['step'] for r in rows]
  fig, left = plt.subplots(figsize=(5.5, 3.2))
  left.plot(at, [r['induction.max'] for r in rows], color='tab:red', label='best induction score')
  left.plot(at, [r['previous_token.max'] for r in rows], color='tab:orange', ls='--',
            label='best previous-token score')  # fmt: skip
  left.set_ylim(0, 1)
  left.set_xlabel('step')
  left.set_ylabel('attention score')
  right = left.twinx()
  right.plot(at, [r['induction.in_context_loss'] for r in rows], color='tab:blue',
             label='in-context loss (late - early)')  # fmt: skip
  right.set_ylabel('nats')
  lines = left.get_lines() + right.get_lines()
  left.legend(lines, [line.get_label() for line in lines], fontsize=7, loc='center right')
  left.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return os.path.basename(path)
