"""The training loop: `train_and_evaluate(config, workdir)` is everything `python -m
experiments.train` does (tests and notebooks call it directly). The loop is short; `_Loop`'s
methods handle resuming, non-finite steps, spikes, logging, stop signals, evaluation and saving.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import shutil
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from transformer import data, util
from transformer.config import ModelConfig
from transformer.config.experiment import Config, DataConfig, TrainConfig
from transformer.data.prepare import NoRoomError
from transformer.model import entropy, hooks, models, probes
from transformer.training import checkpoint, events, faults, peers, provenance
from transformer.training.faults import (  # noqa: F401 - the loop's outcomes
  EXIT_PREEMPTED,
  NonFiniteError,
  OutOfMemoryError,
  Preempted,
)
from transformer.training.progress import Progress
from transformer.training.run import Run
from transformer.training.state import TrainState, model_inputs, weights

Array = jax.Array


def _log(*args) -> None:
  if jax.process_index() == 0:
    print(*args, flush=True)


def train_and_evaluate(
  config: ml_collections.ConfigDict, workdir: str, source: provenance.Source | None = None
) -> dict[str, Any]:
  """Trains `config` in `workdir`, resuming from its latest checkpoint; returns final metrics.

  `source` says where the code is and which paths in its checkout are output, not code (a sweep
  passes its own folder): the revision the run records (git_revision.txt, revisions.jsonl) is
  dirty only for changes elsewhere. Default: this package's checkout, leaving out the workdir.

  Raises:
    Preempted: SIGTERM or SIGINT stopped the run after its checkpoint (see `faults.StopSignals`);
      the same call resumes it. The signal handlers in place before the call are restored.
    PeerLost: another process of a multi-process run is gone (`peers`); nothing is cleaned up,
      so end the process (`peers.exit_now`) and rerun every process to resume.
    NonFiniteError: a non-finite step under train.nonfinite='halt', or one the policy gave up on.
    OutOfMemoryError: the train step does not fit in device memory.
  """
  config = ml_collections.ConfigDict(config.to_dict())  # never mutate the caller's config
  # Typed once: every knob that cannot work (alone or with another) fails here, before any work.
  experiment = Config.from_configdict(config)
  config.data.max_length = experiment.data.max_length  # the context, as from_configdict set it
  tcfg = experiment.train
  saved = checkpoint.read_run_config(workdir)
  if saved is not None:  # compare before touching anything; the vocabulary is checked below
    config.model.vocab_size = saved['model']['vocab_size']
    model = experiment.model.replace(vocab_size=config.model.vocab_size)
    experiment = dataclasses.replace(experiment, model=model)
  checkpoint.check_resume_compatible(workdir, config)
  if experiment.data.task == 'corpus':
    _prepare_corpus(experiment.data, workdir)
  ckpt, lost = None, None
  directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
  try:
    ckpt = checkpoint.Checkpointer(workdir, keep=tcfg.keep_checkpoints)  # checks it is writable
    peers.announce(ckpt.directory, jax.process_index())
    if jax.process_count() > 1:
      peers.start_beating(jax.process_index())  # so that survivors can name a lost process
    with faults.StopSignals() as signals:  # from here on a signal means: checkpoint, then stop
      run = Run(config, workdir, experiment=experiment)  # model.vocab_size from the tokenizer
      checkpoint.check_resume_compatible(workdir, config)
      provenance.write_run_metadata(workdir, config, source)
      return _train_loop(run, tcfg, ckpt, workdir, signals, source)
  except Exception as error:  # a collective or barrier that failed because a peer is gone
    if not peers.is_peer_lost(error, jax.process_count()):
      raise
    lost = peers.from_error(error, directory, jax.process_count())
    raise lost from error
  finally:
    if ckpt is not None and lost is None:  # a lost peer would never answer orbax's barriers
      ckpt.close()  # waits for pending saves and stops orbax's threads, also after an error


def _prepare_corpus(data_cfg: DataConfig, workdir: str) -> None:
  """task='corpus': tokenises the corpus into shards on first use, before the workdir is set up;
  a bad corpus (empty, a jsonl line without text, a bad shard) leaves no new workdir behind. A
  full disk keeps the shards written (in <workdir>/corpus by default): the rerun resumes them."""
  existed = os.path.exists(workdir)
  try:
    data.prepare_corpus(data_cfg, workdir, jax.process_index())
  except (ValueError, FileNotFoundError) as error:
    new = not existed and not isinstance(error, NoRoomError)
    if new and jax.process_index() == 0:
      shutil.rmtree(workdir, ignore_errors=True)
    raise


def _train_loop(
  run: Run,
  tcfg: TrainConfig,
  ckpt: checkpoint.Checkpointer,
  workdir: str,
  signals: faults.StopSignals | None = None,
  source: provenance.Source | None = None,
) -> dict[str, Any]:
  """The steps of `train_and_evaluate`, from the latest checkpoint of `ckpt` to train.steps.

  Each step's loss and finiteness are read back right after it (the next batch is prepared
  while it runs): a non-finite step or a loss spike is handled before anything is saved.
  """
  loop = _Loop(run, tcfg, ckpt, workdir, signals, source)
  state = loop.restore_or_init()
  util.release_host_memory()  # what compiling the initialisation freed
  step, steps = loop.begin(int(state.step))
  pending = None
  while step < steps:
    host_batch, batch, data_state = pending or loop.next_batch()
    state, metrics, pending = loop.train_step(state, step, host_batch, batch)
    step += 1
    loss = float(metrics['loss']) / max(float(metrics['denominator']), 1.0)
    if _nonfinite(metrics, run.model_cfg.dtype):  # train_step kept the parameters as they were
      reason = loop.nonfinite(state, step, loss, metrics, host_batch)
    else:
      reason = loop.spike(step, loss)
    if reason is not None:  # roll back to the last checkpoint and go on from there
      state = None  # frees its device memory before the restore allocates it again
      state, step = loop.rollback(step, reason)
      continue
    if step % loop.tcfg.log_every == 0 or step == steps:
      loop.log(step, loss, metrics)
    due = loop.stop_or_due(step, state, data_state)  # raises Preempted when the hosts agree
    loop.after_step(step, state, data_state, host_batch, save=due)
  return loop.finish(step)


class _Loop:
  """What `_train_loop` keeps between steps, and one method for each thing a step can meet:
  resuming, a non-finite step, a loss spike, logging, a stop signal, evaluation and saving."""

  def __init__(
    self,
    run: Run,
    tcfg: TrainConfig,
    ckpt: checkpoint.Checkpointer,
    workdir: str,
    signals,
    source: provenance.Source | None = None,
  ):
    self.run, self.ckpt, self.workdir, self.signals = run, ckpt, workdir, signals
    self.source = source  # where the code is, for the revision each start records
    self.tcfg = tcfg
    self.policy = faults.nonfinite_policy(tcfg.nonfinite, run.model_cfg.dtype)
    self.iterator = run.task.train_iterator()
    self.rng = run.replicate(jax.random.PRNGKey(run.experiment.seed + 1))
    self.compiled = False  # the train step, before its first call
    self.spikes = faults.SpikeDetector(tcfg.spike_factor, tcfg.spike_window)
    self.agreement = faults.HostAgreement(2)  # [a stop signal, a timed checkpoint due]
    self.every_seconds, self.last_save = tcfg.checkpoint_every_seconds, time.time()
    self.nonfinite_steps, self.skips_in_a_row = 0, 0
    self.rollbacks = collections.Counter()  # checkpoint step -> rollbacks to it
    self.history, self.eval_metrics = [], {}
    self.window_tokens, self.window_start = 0, time.time()
    self.writer = self.metrics_log = self.progress = None

  # Start ---------------------------------------------------------------------------------------
  def restore_or_init(self) -> TrainState:
    """The latest checkpoint with its data position, else a fresh state; logs what the run is."""
    run = self.run
    _log(f'task {run.task.name}: {json.dumps(util.jsonable(run.task.info))}')
    info = run.task.info
    if 'entropy_per_token' in info:  # generated corpus: the best loss any model reaches
      _log(
        f'entropy floor {info["entropy_per_token"]:.3f} nats/token '
        f'(unigram {info["unigram_entropy_per_token"]:.3f}): compare with the eval loss'
      )
    _log(f'model: {run.family}, {models.count_params(run.model_cfg):,} parameters')
    mesh = run.partitioner.mesh
    _log(f'devices: {mesh.devices.size} {jax.default_backend()}, mesh {dict(mesh.shape)}')
    if self.ckpt.latest_step() is None:
      return run.init_state()
    state, data_state, step = self.ckpt.restore(run.abstract_state)  # onto this run's shardings
    if data_state:  # {}: no data position yet (an imported model): start afresh
      self.iterator.set_state(data_state)
    _log(f'resumed from step {step} in {self.workdir}')
    return state

  def begin(self, start: int) -> tuple[int, int]:
    """Opens the logs at `start`; a stop signal that came during the set-up stops here."""
    self.writer = _summary_writer(self.workdir)
    self.metrics_log = _MetricsLog(self.workdir)
    self.metrics_log.start_from(start)
    self.progress = Progress(self.tcfg.steps, start)
    if start < self.tcfg.steps and self.agreement.now([self.received(), 0])[0]:
      got = self.signals.received if self.signals is not None else None
      where = f'no checkpoint yet in {self.ckpt.directory}'
      if self.ckpt.latest_step() is not None:
        where = f'checkpoint {start} in {self.ckpt.directory} is the latest'
      raise faults.Preempted(
        f'{got or "another process got a stop signal"}: stopped before the first step, so there '
        f'is nothing new to save ({where}); rerun the same command to resume',
        step=start,
        signal_name=got,
      )
    if start < self.tcfg.steps:  # the code that trains from here, for experiments.describe
      provenance.record_start(self.workdir, start, self.source)
    return start, self.tcfg.steps

  def received(self) -> bool:
    return self.signals is not None and self.signals.received is not None

  # One step ------------------------------------------------------------------------------------
  def next_batch(self) -> tuple[dict, dict, dict]:
    """(host batch, batch on the mesh, data position after it) of the next training step."""
    host_batch = next(self.iterator)
    return host_batch, self.run.place(host_batch), self.iterator.get_state()

  def train_step(self, state, step: int, host_batch: dict, batch: dict):
    """Runs one step; returns (state, metrics on the host, the next batch prepared meanwhile)."""
    self.window_tokens += int(np.count_nonzero(host_batch['inputs']))
    pending = None
    try:
      if not self.compiled:  # compile apart from the first step, and hand back what it freed
        if hasattr(self.run.train_step, 'lower'):  # not a test's stand-in
          self.run.train_step.lower(state, batch, self.rng).compile()
          util.release_host_memory()
        self.compiled = True
      state, metrics = self.run.train_step(state, batch, self.rng)
      if step + 1 < self.tcfg.steps:
        pending = self.next_batch()  # prepared on the host while the step runs
      metrics = jax.device_get(metrics)  # waits for the step
    except Exception as e:
      if faults.is_out_of_memory(e):
        raise faults.out_of_memory_error(self.run, e, host_batch) from e
      raise
    return state, metrics, pending

  def event(self, step: int, text: str, **values) -> None:
    self.progress.close()
    _log(f'step {step}: {text}')
    self.metrics_log.write(step, 'event', values)

  def nonfinite(self, state, step: int, loss: float, metrics: dict, host_batch: dict) -> str | None:
    """A step that was not finite, under train.nonfinite: raises (halt, or too many skips in a
    row), returns the reason to roll back, or records the skipped update and returns None."""
    self.nonfinite_steps += 1
    _write_scalars(self.writer, step, {'nonfinite': 1.0}, prefix='train/')
    reason = f'loss {loss:.4g}, gradient norm {float(metrics["grad_norm"]):.4g} (not finite)'
    if self.policy == 'halt':
      self.progress.close()
      scale = float(metrics['loss_scale'])
      try:
        report = faults.describe_nonfinite(
          self.run, state.params, host_batch, self.rng, step, scale
        )
      except Exception as e:  # the report must never hide the halt itself
        failure = f'{type(e).__name__}: {util.first_line(e)}'
        report = f'{reason}; the first non-finite tensor was not found ({failure})'
      last = self.ckpt.latest_step()
      kept = f'checkpoint {last} in {self.ckpt.directory}' if last is not None else 'no checkpoint'
      raise faults.NonFiniteError(
        f'step {step}: {report}. Stopped by train.nonfinite={_policy_name(self.tcfg, self.policy)} '
        f'(nothing was saved after it; the last good one is {kept}). Rerun to resume, or set '
        "train.nonfinite='skip' or 'rollback' to train past such steps"
      )
    if self.policy == 'rollback':
      return reason
    self.skips_in_a_row += 1
    self.event(step, f'{reason}; update skipped ({self.nonfinite_steps} so far)', event='nonfinite')
    if self.skips_in_a_row >= faults.MAX_SKIPS_IN_A_ROW:
      raise faults.NonFiniteError(
        f'step {step}: {self.skips_in_a_row} steps in a row were not finite and skipped '
        '(train.nonfinite=skip): the run has diverged. Lower optim.learning_rate or set '
        "optim.clip_norm, and resume, or use train.nonfinite='rollback'"
      )
    return None

  def spike(self, step: int, loss: float) -> str | None:
    """A finite step: a loss far above the recent median is logged, or returned to roll back."""
    self.skips_in_a_row = 0
    ratio = self.spikes.check(step, loss)
    if ratio is None:
      return None
    _write_scalars(self.writer, step, {'loss_spike': ratio}, prefix='train/')
    window = self.tcfg.spike_window
    text = f'loss spike: {loss:.4g} is {ratio:.1f}x the median of the last {window} losses'
    if self.tcfg.spike_rollback:
      return text
    self.event(step, text, event='loss_spike', loss=loss, ratio=ratio)
    return None

  def rollback(self, step: int, reason: str) -> tuple[TrainState, int]:
    """The last checkpoint's state (a fresh one if none); the data iterator is not rewound."""
    to_step = self.ckpt.latest_step()
    self.rollbacks[to_step] += 1
    if self.rollbacks[to_step] > faults.MAX_ROLLBACKS:
      raise faults.NonFiniteError(
        f'step {step}: {reason}, after {faults.MAX_ROLLBACKS} rollbacks to checkpoint '
        f'{to_step or 0} already; stopped. Lower optim.learning_rate or set optim.clip_norm'
      )
    if to_step is None:
      restored, to_step = self.run.init_state(), 0
    else:
      restored, _, to_step = self.ckpt.restore(self.run.abstract_state)
    self.history[:] = [h for h in self.history if h['step'] <= to_step]
    self.metrics_log.start_from(to_step)
    self.spikes.forget_after(to_step)
    skipped = (
      f'batches of steps {to_step + 1}-{step}' if step > to_step + 1 else f'batch of step {step}'
    )
    self.event(
      step,
      f'{reason}; rolled back to checkpoint {to_step}, skipping the {skipped}',
      event='rollback',
      to_step=to_step,
      reason=reason,
    )
    return restored, to_step

  # After a step --------------------------------------------------------------------------------
  def log(self, step: int, loss: float, metrics: dict) -> None:
    """Training scalars to TensorBoard, metrics.jsonl, the history and the progress line."""
    denominator = max(float(metrics['denominator']), 1.0)
    scalars = {
      'loss': loss,
      'perplexity': math.exp(min(float(metrics['nll']) / denominator, 700.0)),
      'learning_rate': float(metrics['learning_rate']),
      'grad_norm': float(metrics['grad_norm']),
      'tokens_per_sec': self.window_tokens / max(time.time() - self.window_start, 1e-9),
    }
    if self.run.model_cfg.dtype == 'float16':
      scalars.update(loss_scale=float(metrics['loss_scale']), skipped=float(metrics['skipped']))
    if self.nonfinite_steps:
      scalars['nonfinite_steps'] = float(self.nonfinite_steps)
    self.history.append({'step': step, **scalars})
    _write_scalars(self.writer, step, scalars, prefix='train/')
    self.metrics_log.write(step, 'train', scalars)
    self.progress.update(step, loss, scalars['learning_rate'], scalars['tokens_per_sec'])
    self.window_tokens, self.window_start = 0, time.time()

  def stop_or_due(self, step: int, state, data_state: dict) -> bool:
    """Stop signals and timed checkpoints, agreed over processes so that all act on one step.

    A stop saves and raises Preempted (at the last step the run saves and evaluates as usual);
    otherwise returns whether a timed checkpoint is due.
    """
    due = bool(self.every_seconds) and time.time() - self.last_save >= self.every_seconds
    stop, due = self.agreement.combine([self.received(), due])
    if not stop or step >= self.tcfg.steps:
      return due
    self.progress.close()
    self.ckpt.save(step, state, data_state)
    self.ckpt.wait()
    got = self.signals.received if self.signals is not None else None
    self.metrics_log.write(step, 'event', {'event': 'preempted', 'signal': got})
    self.metrics_log.close()
    if self.writer is not None:
      self.writer.flush()
    raise faults.Preempted(
      f'{got or "another process got a stop signal"}: saved checkpoint {step} (step {step} of '
      f'{self.tcfg.steps}, data position included) in {self.ckpt.directory}; rerun the same '
      'command to resume',
      step=step,
      signal_name=got,
    )

  def after_step(self, step: int, state, data_state: dict, host_batch: dict, save: bool) -> None:
    """Head entropy, evaluation and checkpoints, each on its own schedule."""
    tcfg, last = self.tcfg, step == self.tcfg.steps
    entropy_every = tcfg.head_entropy_every
    if entropy_every and step % entropy_every == 0:  # attention entropy per head, on this batch
      inputs = model_inputs(self.run.family, host_batch)
      log_head_entropy(self.writer, self.run.model_cfg, weights(state), inputs, step)
    induction_every = tcfg.induction_every
    if induction_every and (step % induction_every == 0 or step == 1):
      log_induction(self.writer, self.metrics_log, self.run.model_cfg, weights(state), host_batch,
                    step)  # fmt: skip
    if step % tcfg.eval_every == 0 or last:
      self.progress.close()
      self.eval_metrics, samples = self.run.evaluate(weights(state))
      util.release_host_memory()  # the eval step's compile, and its buffers
      _report_eval(self.writer, step, self.eval_metrics, samples[: tcfg.num_samples])
      self.metrics_log.write(step, 'eval', util.jsonable(self.eval_metrics))
    if step % tcfg.checkpoint_every == 0 or last or save:
      self.ckpt.save(step, state, data_state)
      self.last_save = time.time()

  def finish(self, step: int) -> dict[str, Any]:
    self.progress.close()
    self.ckpt.wait()
    self.metrics_log.close()
    if self.writer is not None:
      self.writer.close()
    return {'step': step, 'train': self.history, 'eval': self.eval_metrics}


def _policy_name(tcfg: TrainConfig, policy: str) -> str:
  """'halt', or 'auto' (= 'halt' for float32) when it came from 'auto'."""
  chosen = tcfg.nonfinite
  return f'{chosen!r}' if chosen == policy else f'{chosen!r} (= {policy!r} for this dtype)'


def _nonfinite(metrics: dict, dtype: str) -> bool:
  """Whether a step was not finite in a way train.nonfinite handles.

  In float16 a step whose gradient overflows while its loss is finite is routine: loss scaling
  skips it and halves the scale. Only one it cannot fix (loss not finite, or scale at 1) counts.
  """
  if not metrics['skipped']:
    return False
  if dtype != 'float16':
    return True
  return not math.isfinite(float(metrics['loss'])) or float(metrics['loss_scale']) <= 1.0


class _MetricsLog:
  """workdir/metrics.jsonl: one JSON line per log step, eval and event, written by process 0.

  Each line has 'step' and 'kind' ('train' | 'eval' | 'event') plus the values, at full
  precision. `start_from(step)` (a resume or a rollback) drops the lines after `step`, and lines
  cut short by a killed process, so the file always tells one run's trajectory once.
  """

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, 'metrics.jsonl') if jax.process_index() == 0 else None
    self._file = None

  def start_from(self, step: int) -> None:
    if self.path is None:
      return
    self.close()
    kept = []
    if os.path.exists(self.path):
      with open(self.path) as f:
        for line in f:
          try:
            entry = json.loads(line)
          except ValueError:  # cut short by a killed process
            continue
          if isinstance(entry, dict) and isinstance(entry.get('step'), int):
            if entry['step'] <= step:
              kept.append(line.rstrip('\n') + '\n')
    util.write_atomic(self.path, ''.join(kept))
    self._file = open(self.path, 'a')

  def write(self, step: int, kind: str, values: dict) -> None:
    if self._file is not None:
      self._file.write(json.dumps({'step': step, 'kind': kind, **values}) + '\n')
      self._file.flush()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None


def _summary_writer(workdir: str):
  if jax.process_index() != 0:
    return None
  return events.SummaryWriter(os.path.join(workdir, 'tensorboard'))


def _write_scalars(writer, step: int, scalars: dict, prefix: str) -> None:
  if writer is None:
    return
  for k, v in scalars.items():
    if isinstance(v, (int, float)):
      writer.scalar(prefix + k, v, step)


def _report_eval(writer, step: int, metrics: dict, samples: list[tuple]) -> None:
  shown = ', '.join(f'{k} {v:.4g}' for k, v in metrics.items() if isinstance(v, float))
  _log(f'eval @ {step}: {shown}')
  if 'bleu_signature' in metrics:
    _log(f'  sacrebleu signature: {metrics["bleu_signature"]}')
  for src, ref, out in samples:
    _log(f'  source: {src}\n    reference: {ref}\n    output:    {out}')
  _write_scalars(writer, step, metrics, prefix='eval/')
  if writer is not None and samples:
    text = '\n\n'.join(f'source: {s}  \nreference: {r}  \noutput: {o}' for s, r, o in samples)
    writer.text('eval/samples', text, step)


def log_induction(writer, log, cfg: ModelConfig, params: Any, batch: dict, step: int, rows=16):
  """Induction telemetry: every head's previous-token, duplicate-token and induction score on
  repeated random tokens drawn from the ids of the batch just trained on (`probes`), the loss on
  their second copy against the first, and the batch's in-context loss (last quarter of each
  document against its first). To metrics.jsonl (kind 'induction') and TensorBoard; process 0
  of a single-process run only, as `log_head_entropy`."""
  if jax.process_count() > 1:
    return
  batch = {k: np.asarray(v)[:rows] for k, v in batch.items() if v is not None}
  inputs = model_inputs('causal_lm', batch)
  pool = np.unique(batch['inputs'][batch['weights'] > 0])
  pool = pool[pool >= data.NUM_SPECIAL]  # padding, bos, eos, mask and unknown are not drawn
  if len(pool) < 2:
    return
  length = max(2, min(25, (cfg.max_length - 1) // 2))
  probe = probes.induction_probe(cfg, params, probes.repeated_tokens(0, length, 8, seed=step,
                                                                     pool=pool))  # fmt: skip
  values = {
    'induction.max': float(probe['induction'].max()),
    'previous_token.max': float(probe['previous_token'].max()),
    'induction.loss': probe['induction_loss'],
    'induction.first_copy_loss': probe['first_copy_loss'],
    **{f'induction.{k}': v for k, v in probes.in_context_loss(
      cfg, params, inputs, batch['targets'], batch['weights']).items()},
  }  # fmt: skip
  for kind in ('induction', 'previous_token'):
    for layer, heads in enumerate(probe[kind]):
      for head, value in enumerate(heads):
        values[f'{kind}.layer_{layer}.head_{head}'] = float(value)
  log.write(step, 'induction', values)
  _write_scalars(writer, step, values, prefix='telemetry/')


def log_head_entropy(writer, cfg: ModelConfig, params: Any, inputs: dict, step: int, rows=4):
  """Writes each head's mean attention entropy (and each attention's mean) to TensorBoard, as
  `head_entropy/blocks.0.attn/head_3` (TransformerLens's names; `entropy.attention_entropy`).

    Called from the training loop every `train.head_entropy_every` steps with the batch it just
    trained on (its first `rows` rows). Only on process 0 of a single-process run: the host batch
    of one process cannot be fed to a computation that spans several.
  """
  if writer is None or jax.process_count() > 1:
    return
  inputs = {k: np.asarray(v)[:rows] for k, v in inputs.items() if v is not None}
  _, cache = hooks.run_xla(cfg, params, inputs, entropy.patterns_and_scores)
  for name, stats in entropy.attention_entropy(cache).items():
    for n, value in enumerate(stats['entropy']):
      writer.scalar(f'head_entropy/{name}/head_{n}', float(value), step)
    writer.scalar(f'head_entropy/{name}/mean', float(np.mean(stats['entropy'])), step)
