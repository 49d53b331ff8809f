"""A sweep's results: each run's curve and final numbers, and `results.jsonl`, one line per run."""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence

import ml_collections
import numpy as np

from transformer import util
from transformer.config import ModelConfig
from transformer.model import models
from transformer.training import checkpoint

RESULTS = 'results.jsonl'
SWEEP_JSON = 'sweep.json'
# The committed results (CPU, then one GPU), one sweep per folder: experiments.regenerate writes
# them, so changes under these (relative to the checkout) leave its tree clean.
RESULT_ROOTS = ('docs/results', 'docs/results_gpu')


def config_dict(config: ml_collections.ConfigDict) -> dict:
  """The config as JSON-normalised data (tuples become lists), as results.jsonl stores it."""
  return json.loads(config.to_json_best_effort())


def read_curve(workdir: str) -> dict[str, list[dict]]:
  """{'train': [...], 'eval': [...], 'event': [...], 'induction': [...]} from the run's
  metrics.jsonl (resumes included, once each)."""
  curve = {'train': [], 'eval': [], 'event': [], 'induction': []}
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return curve
  with open(path) as f:
    for line in f:
      try:
        entry = json.loads(line)
      except ValueError:
        continue
      kind = entry.pop('kind', None)
      if kind in curve:
        curve[kind].append(entry)
  return curve


LEARNED_FRACTION = 0.25  # a run has learned once its cross-entropy is below this x its first


def final_metrics(curve: Mapping[str, list[dict]]) -> dict[str, float]:
  """The run's numbers from its curve.

  train.loss / train.nll: mean of the last 10% of logged training losses (label-smoothed) and
  cross-entropies (log of the logged perplexity); train.loss_final: the last one;
  train.loss_rise: the largest rise of the loss above its lowest value so far (a spike; inf
  when a loss was not finite).
  train.oscillation: the std of the step-to-step changes of log(loss) over the second half of
  the logged curve (how much it zigzags, relative to its level; a steady trend only shifts the
  mean change, which the std ignores). Log often (train.log_every of a few steps) to see it; inf
  when a loss there was not finite. train.oscillation_detrended: the std of log(loss) about its
  least-squares line over that second half (slow swings count too, not only step-to-step ones).
  train.learned: 1 if train.nll (train.loss without a perplexity) is below LEARNED_FRACTION x
  the first logged one, else 0; train.learned_early: 1 if a logged one in the first half of the
  curve is. With train.log_every = 1 the first logged value is that of the initial parameters.
  train.spikes: the number of loss_spike events (training.faults.SpikeDetector, on when
  train.spike_factor > 0; 0 when it is off).
  train.nonfinite_skipped: the number of steps whose loss or gradient was not finite and whose
  update the loop skipped (its 'nonfinite' events, written under train.nonfinite='skip'; a run
  that rolls back instead records 'rollback' events, not counted here).
  eval.*: the last evaluation (loss and perplexity without label smoothing).
  """
  out: dict[str, float] = {}
  train = [h for h in curve.get('train', []) if 'loss' in h]
  if train:
    losses = np.array([h['loss'] for h in train], np.float64)
    tail = max(1, len(losses) // 10)
    out['train.loss'] = float(np.mean(losses[-tail:]))
    out['train.loss_final'] = float(losses[-1])
    nll = losses
    if all('perplexity' in h for h in train):
      nll = np.log(np.maximum([h['perplexity'] for h in train], 1.0))
      out['train.nll'] = float(np.mean(nll[-tail:]))
    finite = np.all(np.isfinite(losses))
    out['train.loss_rise'] = float(np.max(losses - np.minimum.accumulate(losses)))
    out['train.loss_rise'] = out['train.loss_rise'] if finite else math.inf
    half = losses[len(losses) // 2 :]
    if len(half) >= 3:
      ok = np.all(np.isfinite(half)) and np.all(half > 0)
      out['train.oscillation'] = float(np.std(np.diff(np.log(half)), ddof=1)) if ok else math.inf
      if ok:
        t = np.arange(len(half))
        residual = np.log(half) - np.polyval(np.polyfit(t, np.log(half), 1), t)
        out['train.oscillation_detrended'] = float(np.std(residual, ddof=2))
      else:
        out['train.oscillation_detrended'] = math.inf
    threshold = LEARNED_FRACTION * nll[0]
    with np.errstate(invalid='ignore'):  # NaN compares False: not learned
      out['train.learned'] = float(np.mean(nll[-tail:]) < threshold)
      out['train.learned_early'] = float(np.any(nll[: max(1, len(nll) // 2)] < threshold))
    events = curve.get('event', [])
    out['train.spikes'] = float(sum(e.get('event') == 'loss_spike' for e in events))
    out['train.nonfinite_skipped'] = float(sum(e.get('event') == 'nonfinite' for e in events))
  evals = curve.get('eval', [])
  if evals:
    for key, value in evals[-1].items():
      if key != 'step' and isinstance(value, int | float) and not isinstance(value, bool):
        out[f'eval.{key}'] = float(value)
  return out


def model_numbers(config: ml_collections.ConfigDict, workdir: str | None) -> dict[str, float]:
  """Parameters (all, and without embedding tables) and training FLOPs per token."""
  import jax

  model = dict(config.model, attention_impl=None, remat='none')  # the params do not depend on these
  saved = checkpoint.read_run_config(workdir) if workdir else None
  if saved is not None:
    model['vocab_size'] = saved['model']['vocab_size']
  cfg = ModelConfig.from_config(model)
  data = config.data
  seq_len = data.max_target_length if cfg.family == 'encoder_decoder' else data.max_length
  shapes = models.param_shapes(cfg)
  embedding = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
    if 'embedding' in jax.tree_util.keystr(path):
      embedding += math.prod(leaf.shape)
  params = models.count_params(cfg)
  return {
    'params': float(params),
    'params_non_embedding': float(params - embedding),
    'flops_per_token': models.flops_per_token(cfg, seq_len)['train'],
  }


@contextlib.contextmanager
def _locked(workdir: str) -> Iterator[None]:
  """An exclusive flock on the workdir itself: workers' appends and the final rewrite of
  results.jsonl take turns (a lock on the file would not survive its atomic rewrite)."""
  fd = os.open(workdir, os.O_RDONLY)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)  # releases the lock


def read_results(workdir: str) -> list[dict]:
  """The lines of workdir/results.jsonl ([] if none); a line cut short by a kill is skipped, so
  its run counts as not finished and runs again."""
  path = os.path.join(workdir, RESULTS)
  if not os.path.exists(path):
    return []
  results = []
  with open(path) as f:
    for line in f:
      try:
        results.append(json.loads(line))
      except ValueError:
        continue
  return results


def append_result(workdir: str, result: Mapping) -> None:
  """Appends one run's line to workdir/results.jsonl, whole, under the workdir's lock."""
  line = json.dumps(util.jsonable(dict(result))) + '\n'
  path = os.path.join(workdir, RESULTS)
  with _locked(workdir), open(path, 'a+') as f:
    f.seek(0, os.SEEK_END)
    if f.tell():  # after a line a kill cut short, start a new one
      f.seek(f.tell() - 1)
      line = ('' if f.read(1) == '\n' else '\n') + line
    f.write(line)
    f.flush()
    os.fsync(f.fileno())


def write_results(workdir: str) -> list[dict]:
  """Rewrites workdir/results.jsonl in sweep order (variant, then seed), one line per run (the
  last one written wins), and returns those lines."""
  with open(os.path.join(workdir, SWEEP_JSON)) as f:
    meta = json.load(f)
  order = list(meta['variants']) + list(meta.get('eval_variants') or {})
  with _locked(workdir):
    latest = {(r['variant'], r['seed']): r for r in read_results(workdir)}
    rank = lambda key: (order.index(key[0]) if key[0] in order else len(order), key)
    results = [latest[key] for key in sorted(latest, key=rank)]
    util.write_atomic(
      os.path.join(workdir, RESULTS), ''.join(json.dumps(r) + '\n' for r in results)
    )
  return results


def load_results(workdir: str) -> tuple[dict, list[dict]]:
  """(sweep.json metadata, results.jsonl lines) of a sweep workdir; one ValueError if missing."""
  path = os.path.join(workdir, RESULTS)
  if not os.path.exists(path) or not os.path.exists(os.path.join(workdir, SWEEP_JSON)):
    raise ValueError(
      f'no {RESULTS} in {workdir!r}: nothing to report. Run a sweep there first: python -m '
      f'experiments.sweep --sweep=configs/sweeps/<name>.py --workdir={workdir}'
    )
  with open(os.path.join(workdir, SWEEP_JSON)) as f:
    meta = json.load(f)
  results = read_results(workdir)
  if not results:
    raise ValueError(f'{path} has no finished runs yet; run the sweep to completion first')
  return meta, results


def metric_table(results: Sequence[Mapping]) -> dict[str, dict[str, list[float]]]:
  """variant -> metric -> values over seeds (seed order), as `research.verdicts` reads them."""
  table: dict[str, dict[str, list[float]]] = {}
  for r in sorted(results, key=lambda r: r['seed']):
    row = table.setdefault(r['variant'], {})
    for key, value in r['metrics'].items():
      row.setdefault(key, []).append(value)
  return table


# One run -------------------------------------------------------------------------------------
def run_dir(workdir: str, variant: str, seed: int) -> str:
  return os.path.join(workdir, variant, f'seed_{seed}')
