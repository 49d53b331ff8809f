"""The training loop: TrainState, pure `train_step`/`eval_step`, and `train_and_evaluate`.

`train_and_evaluate(config, workdir)` is everything `python -m experiments.train` does; tests and
notebooks call it directly.
"""

from __future__ import annotations

import collections
import functools
import json
import math
import os
import time
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from transformer import checkpoint, data, decode, faults, models, objectives, optim, sharding
from transformer.config import ModelConfig
from transformer.faults import (  # noqa: F401 - the loop's outcomes, also as train.Preempted etc.
  EXIT_PREEMPTED,
  NonFiniteError,
  OutOfMemoryError,
  Preempted,
)
from transformer.progress import Progress

Array = jax.Array


@flax.struct.dataclass
class TrainState:
  """Everything a step changes. `loss_scale`/`good_steps` drive float16 dynamic loss scaling."""

  step: Array  # int32 []
  params: Any
  opt_state: Any
  loss_scale: Array  # float32 []; 1 unless float16
  good_steps: Array  # int32 []: finite steps since the scale last changed


# Pure steps ------------------------------------------------------------------------------------
def model_inputs(family: str, batch: dict[str, Array]) -> dict[str, Array]:
  """The model's keyword arguments for a data batch of `family` (see transformer.data)."""
  if family == 'encoder_decoder':
    keys = ['inputs', 'decoder_inputs', 'inputs_segments', 'targets_segments']
    keys += ['inputs_positions', 'targets_positions']
  elif family == 'causal_lm':
    keys = ['inputs', 'segments', 'positions']
  else:
    keys = ['inputs', 'token_types', 'segments', 'positions']
  return {k: batch[k] for k in keys}


def _micro_batches(batch: dict[str, Array], k: int) -> dict[str, Array]:
  """[B, ...] -> [k, B/k, ...]: the gradient-accumulation split."""
  return jax.tree_util.tree_map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)


def train_step(
  state: TrainState,
  batch: dict[str, Array],
  rng: Array,
  *,
  model: Any,
  family: str,
  tx: optax.GradientTransformation,
  schedule: optax.Schedule,
  label_smoothing: float,
  accum_steps: int = 1,
  dynamic_scale: bool = False,
  scale_period: int = 2000,
) -> tuple[TrainState, dict[str, Array]]:
  """One optimizer step over `accum_steps` micro-batches; returns the new state and metrics.

  The gradient is that of the summed loss divided by the total weight of the whole batch, so k
  micro-batches give exactly the update of one batch k times larger.
  """
  dropout_rng = jax.random.fold_in(rng, state.step)

  def micro_step(params, micro, micro_rng):
    def loss_fn(p):
      logits = model.apply(
        {'params': p},
        **model_inputs(family, micro),
        deterministic=False,
        rngs={'dropout': micro_rng},
      )
      sums = objectives.compute_metrics(
        logits, micro['targets'], micro['weights'], label_smoothing, accuracy=False
      )
      # Normalise by a static size so fp16 gradients stay in range; undone below.
      return sums['loss'] * state.loss_scale / micro['weights'].size, sums

    grads, sums = jax.grad(loss_fn, has_aux=True)(params)
    grads = jax.tree_util.tree_map(lambda g: g * (micro['weights'].size / state.loss_scale), grads)
    return grads, sums

  if accum_steps == 1:
    grads, sums = micro_step(state.params, batch, dropout_rng)
  else:
    micros = _micro_batches(batch, accum_steps)

    def body(carry, xs):
      micro, index = xs
      g, s = micro_step(state.params, micro, jax.random.fold_in(dropout_rng, index))
      return jax.tree_util.tree_map(jnp.add, carry, (g, s)), None

    zeros = jax.tree_util.tree_map(
      jnp.zeros_like, jax.eval_shape(micro_step, state.params, batch_slice(micros), dropout_rng)
    )
    (grads, sums), _ = jax.lax.scan(body, zeros, (micros, jnp.arange(accum_steps)))

  denominator = jnp.maximum(sums['denominator'], 1.0)
  grads = jax.tree_util.tree_map(lambda g: g / denominator, grads)  # gradient of the mean loss
  grad_norm = optax.global_norm(grads)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)

  loss_scale, good_steps = state.loss_scale, state.good_steps
  # A non-finite step changes neither the parameters nor the optimizer state; the step counter
  # still advances. The loop's train.nonfinite policy decides what follows (skip, halt, rollback).
  finite = jnp.isfinite(grad_norm) & jnp.isfinite(sums['loss'])
  keep = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(finite, a, b), new, old)
  params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
  if dynamic_scale:  # float16: halve the scale after a non-finite step; double it after good ones
    grow = good_steps + 1 >= scale_period
    loss_scale = jnp.where(finite, jnp.where(grow, loss_scale * 2, loss_scale), loss_scale / 2)
    loss_scale = jnp.clip(loss_scale, 1.0, 2.0**24)
    good_steps = jnp.where(finite & ~grow, good_steps + 1, 0)

  metrics = {k: v for k, v in sums.items()}
  metrics.update(
    grad_norm=grad_norm,
    learning_rate=schedule(state.step),
    loss_scale=state.loss_scale,
    skipped=(~finite).astype(jnp.float32),
  )
  new_state = state.replace(
    step=state.step + 1,
    params=params,
    opt_state=opt_state,
    loss_scale=loss_scale,
    good_steps=good_steps,
  )
  return new_state, metrics


def batch_slice(micros: dict[str, Array]) -> dict[str, Array]:
  """The first micro-batch of a [k, B/k, ...] split."""
  return jax.tree_util.tree_map(lambda x: x[0], micros)


def eval_step(params: Any, batch: dict[str, Array], *, model: Any, family: str) -> dict:
  """Summed loss, nll, correct and denominator over one eval batch (no label smoothing)."""
  logits = model.apply({'params': params}, **model_inputs(family, batch), deterministic=True)
  return objectives.compute_metrics(logits, batch['targets'], batch['weights'])


# Setup -------------------------------------------------------------------------------------------
def optim_config(config: ml_collections.ConfigDict, model_cfg: ModelConfig) -> Any:
  """The optimizer ConfigDict plus the run length and model width that schedules need."""
  cfg = ml_collections.ConfigDict(config.optim.to_dict())
  cfg.total_steps = config.train.steps
  cfg.d_model = model_cfg.d_model
  return cfg


def resolve_model_config(config: ml_collections.ConfigDict, tokenizer) -> ModelConfig:
  """The model of the experiment, with the vocabulary taken from the tokenizer.

  The vocabulary is rounded up to a multiple of `config.data.vocab_multiple` (so that tensor
  parallelism can split it); the extra rows are never targets.
  """
  multiple = config.data.get('vocab_multiple', 1)
  if not isinstance(multiple, int) or multiple < 1:
    raise ValueError(f'data.vocab_multiple={multiple!r} must be a positive int')
  with config.unlocked():
    config.model.vocab_size = -(-tokenizer.vocab_size // multiple) * multiple
  return ModelConfig.from_config(config.model)


def create_state(
  model, model_cfg, tx, seed: int, loss_scale: float, *, boxed: bool = False
) -> TrainState:
  """A fresh TrainState; `boxed` keeps the parameters' logical axis names (for shardings)."""
  params = models.init_params(model, jax.random.PRNGKey(seed), boxed=True)
  scale = loss_scale if model_cfg.dtype == 'float16' else 1.0
  state = TrainState(
    step=jnp.zeros((), jnp.int32),
    params=params,
    opt_state=tx.init(params),  # moments inherit the parameters' logical axes
    loss_scale=jnp.asarray(scale, jnp.float32),
    good_steps=jnp.zeros((), jnp.int32),
  )
  return state if boxed else nn.meta.unbox(state)


class Run:
  """A model, its jitted steps and its data: what training and evaluation share."""

  def __init__(
    self,
    config: ml_collections.ConfigDict,
    workdir: str | None,
    devices: list | None = None,
    *,
    with_data: bool = True,
  ):
    """`devices` (default: all of them) are what `config.mesh.shape` lays out.

    `with_data=False` skips the data task (benchmarks): the model keeps config.model.vocab_size.
    """
    self.config = config
    self.partitioner = sharding.Partitioner.from_config(config.get('mesh'), devices)
    self.task = None
    if with_data:
      _check_batch_sizes(config.data, self.partitioner)
      self.task = data.build(
        config.data,
        family=config.model.family,
        workdir=workdir,
        seed=config.seed,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
      )
      self.model_cfg = resolve_model_config(config, self.task.tokenizer)
    else:
      self.model_cfg = ModelConfig.from_config(config.model)
    self.model = models.build(self.model_cfg)
    self.family = self.model_cfg.family
    ocfg = optim_config(config, self.model_cfg)
    self.schedule = optim.make_schedule(ocfg)
    self.tx = optim.make_optimizer(ocfg)
    accum = config.train.grad_accum_steps
    rows = config.data.batch_size // jax.process_count()
    if accum < 1 or rows % accum:
      raise ValueError(
        f'train.grad_accum_steps={accum} must be >= 1 and divide the per-process batch of {rows}'
      )
    # Shardings from the parameters' logical axes; the state is created directly on them.
    new_state = functools.partial(
      create_state, self.model, self.model_cfg, self.tx, config.seed, config.train.loss_scale
    )
    p = self.partitioner
    boxed = jax.eval_shape(functools.partial(new_state, boxed=True))
    self.state_shardings = p.tree_shardings(boxed)
    self.abstract_state = sharding.with_shardings(jax.eval_shape(new_state), self.state_shardings)
    self.param_shardings = self.state_shardings.params
    # Outside the mesh context: flax would constrain DenseGeneral's flat init shapes.
    self._init_state = jax.jit(new_state, out_shardings=self.state_shardings)
    batch, rep = p.batch_sharding(), p.replicated
    self.train_step = p.jit(
      functools.partial(
        train_step,
        model=self.model,
        family=self.family,
        tx=self.tx,
        schedule=self.schedule,
        label_smoothing=config.train.label_smoothing,
        accum_steps=accum,
        dynamic_scale=self.model_cfg.dtype == 'float16',
        scale_period=config.train.loss_scale_period,
      ),
      in_shardings=(self.state_shardings, batch, rep),
      out_shardings=(self.state_shardings, rep),
      donate_argnums=(0,),
    )
    self.eval_step = p.jit(
      functools.partial(eval_step, model=self.model, family=self.family),
      in_shardings=(self.param_shardings, batch),
      out_shardings=rep,
    )
    max_len = config.train.max_decode_length
    self._translate = p.jit(
      lambda params, inputs: decode.greedy_translate(self.model, params, inputs, max_len),
      in_shardings=(self.param_shardings, rep),
      out_shardings=rep,
    )
    self._continue = p.jit(
      lambda params, prompt: decode.greedy_continue(self.model, params, prompt, max_len),
      in_shardings=(self.param_shardings, rep),
      out_shardings=rep,
    )
    self._token_nll = p.jit(
      functools.partial(_token_nll, self.model),
      in_shardings=(self.param_shardings, rep, rep),
      out_shardings=rep,
    )

  def init_state(self) -> TrainState:
    """A fresh TrainState, each array created directly on its devices (never whole on one)."""
    return self._init_state()

  def place(self, batch: dict[str, np.ndarray]) -> dict[str, Array]:
    """This process's rows of a batch -> global arrays sharded over the mesh."""
    return self.partitioner.place_batch(batch)

  def replicate(self, x: Any) -> Array:
    """A host value that every process holds identically -> an array on every device."""
    return self.partitioner.replicate(x)

  # Evaluation ------------------------------------------------------------------------------------
  def evaluate(self, params, num_decode: int | None = None) -> tuple[dict, list[tuple]]:
    """Loss/accuracy/perplexity over the eval set, plus BLEU/exact match for translation.

    Returns (metrics, samples) where samples are (source, reference, output) strings.
    """
    totals: dict[str, float] = {}
    for batch in self.task.eval_batches():
      sums = jax.device_get(self.eval_step(params, self.place(batch)))
      for k, v in sums.items():
        totals[k] = totals.get(k, 0.0) + float(v)
    metrics = objectives.summarize(totals)
    metrics.pop('nll')
    tcfg = self.config.train
    num_decode = tcfg.eval_decode_examples if num_decode is None else num_decode
    samples = []
    if num_decode and self.family in ('encoder_decoder', 'causal_lm'):
      samples = self.generate(params, self.task.eval_examples(num_decode))
      if self.family == 'encoder_decoder':
        metrics.update(translation_metrics([s[2] for s in samples], [s[1] for s in samples]))
    return metrics, samples

  def generate(self, params, examples: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
    """Greedy outputs for (source, reference) pairs: translations, or LM continuations."""
    tok = self.task.tokenizer
    dcfg = self.config.data
    outputs = []
    for start in range(0, len(examples), dcfg.eval_batch_size):
      chunk = examples[start : start + dcfg.eval_batch_size]
      if self.family == 'encoder_decoder':
        ids = [tok.encode(src)[: dcfg.max_source_length - 1] + [data.EOS_ID] for src, _ in chunk]
        inputs = _pad(ids, dcfg.max_source_length, num_rows=dcfg.eval_batch_size)
        out = self._translate(params, self.replicate(inputs))
      else:
        ids = [[data.BOS_ID] + tok.encode(src)[: dcfg.max_length // 2] for src, _ in chunk]
        prompt = _pad(ids, dcfg.max_length // 2 + 1, num_rows=dcfg.eval_batch_size)
        out = self._continue(params, self.replicate(prompt))
      for (src, ref), row in zip(chunk, np.asarray(out)):
        outputs.append((src, ref, tok.decode(row.tolist())))
    return outputs

  def score(self, params, texts: list[str]) -> list[tuple[float, int]]:
    """CausalLM: summed negative log-likelihood (nats) and token count of each text (+ eos)."""
    if self.family != 'causal_lm':
      raise ValueError(f'scoring texts needs family=causal_lm, not {self.family!r}')
    tok, length = self.task.tokenizer, self.config.data.max_length
    results = []
    for start in range(0, len(texts), self.config.data.eval_batch_size):
      ids = [
        tok.encode(t)[: length - 1] for t in texts[start : start + self.config.data.eval_batch_size]
      ]
      rows = self.config.data.eval_batch_size
      inputs = _pad([[data.BOS_ID] + row for row in ids], length, rows)
      targets = _pad([row + [data.EOS_ID] for row in ids], length, rows)
      nll = self._token_nll(params, self.replicate(inputs), self.replicate(targets))
      weights = (inputs != data.PAD_ID).astype(np.float32)
      for row_nll, row_w in zip(np.asarray(nll)[: len(ids)], weights[: len(ids)]):
        results.append((float((row_nll * row_w).sum()), int(row_w.sum())))
    return results


def _token_nll(model, params, inputs, targets):
  """Per-token negative log-likelihood [B, T] of `targets` given `inputs`."""
  logits = model.apply({'params': params}, inputs).astype(jnp.float32)  # [B, T, V]
  logp = jax.nn.log_softmax(logits)
  return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]  # [B, T]


def _check_batch_sizes(data_cfg: Any, partitioner: sharding.Partitioner) -> None:
  """Global batch sizes must split evenly over processes and over the mesh's batch axes."""
  parts = partitioner.axis_size(partitioner.spec(('batch',))[0])
  for key in ('batch_size', 'eval_batch_size'):
    rows = data_cfg[key]
    for divisor, what in ((jax.process_count(), 'processes'), (parts, 'mesh batch shards')):
      if rows % divisor:
        raise ValueError(
          f'data.{key}={rows} does not divide over {divisor} {what} '
          f'(mesh {dict(partitioner.mesh.shape)}); use a multiple of {divisor}'
        )


def _pad(rows: list[list[int]], length: int, num_rows: int | None = None) -> np.ndarray:
  """Right-pads token rows to [num_rows, length]: one shape per call site, so one compile."""
  out = np.zeros((max(num_rows or 0, len(rows)), length), np.int32)
  out[len(rows) :, 0] = data.BOS_ID  # filler rows: a lone bos, never an all-padding row
  for i, row in enumerate(rows):
    out[i, : len(row)] = row
  return out


def translation_metrics(hypotheses: list[str], references: list[str]) -> dict[str, Any]:
  """Corpus BLEU (sacrebleu, on detokenised text) with its signature, and exact match."""
  import sacrebleu

  bleu = sacrebleu.BLEU()
  score = bleu.corpus_score(hypotheses, [references])
  exact = np.mean([h.strip() == r.strip() for h, r in zip(hypotheses, references)])
  return {
    'bleu': score.score,
    'exact_match': float(exact),
    'bleu_signature': str(bleu.get_signature()),
  }


def fit_mesh(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A saved run's config whose mesh fits this machine: its own, else all devices data parallel.

  Checkpoints restore onto any layout, so a run trained on (2, 2, 2) loads on 1 device.
  """
  if 'mesh' in config:
    try:
      sharding.mesh_shape(tuple(config.mesh.shape), jax.device_count())
    except ValueError:
      config.mesh.shape = type(config.mesh.shape)((-1, 1, 1))
  return config


def load_run(workdir: str, step: int | None = None) -> tuple[Run, TrainState, int]:
  """Rebuilds the Run of `workdir` from its config.json and restores a checkpoint (latest)."""
  saved = checkpoint.read_run_config(workdir)
  if saved is None:
    raise FileNotFoundError(
      f'no config.json in workdir {workdir!r}; is it a sparrow run directory?'
    )
  config = fit_mesh(ml_collections.ConfigDict(saved))
  run = Run(config, workdir)
  ckpt = checkpoint.Checkpointer(workdir, keep=run.config.train.keep_checkpoints)
  state, _, step = ckpt.restore(run.abstract_state, step)
  ckpt.close()
  return run, state, step


# The loop ----------------------------------------------------------------------------------------
def _log(*args) -> None:
  if jax.process_index() == 0:
    print(*args, flush=True)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains `config` in `workdir`, resuming from its latest checkpoint; returns final metrics.

  Raises:
    Preempted: SIGTERM or SIGINT stopped the run after its checkpoint (see `faults.StopSignals`);
      the same call resumes it. The signal handlers in place before the call are restored.
    NonFiniteError: a non-finite step under train.nonfinite='halt', or one the policy gave up on.
    OutOfMemoryError: the train step does not fit in device memory.
  """
  config = ml_collections.ConfigDict(config.to_dict())  # never mutate the caller's config
  tcfg = config.train
  ModelConfig.from_config(config.model)  # bad shapes and names fail before anything is written
  faults.check_config(tcfg)
  saved = checkpoint.read_run_config(workdir)
  if saved is not None:  # compare before touching anything; the vocabulary is checked below
    config.model.vocab_size = saved['model']['vocab_size']
  checkpoint.check_resume_compatible(workdir, config)
  ckpt = checkpoint.Checkpointer(workdir, keep=tcfg.keep_checkpoints)  # checks it is writable
  try:
    with faults.StopSignals() as signals:  # from here on a signal means: checkpoint, then stop
      run = Run(config, workdir)  # sets model.vocab_size from the tokenizer
      checkpoint.check_resume_compatible(workdir, config)
      checkpoint.write_run_metadata(workdir, config)
      return _train_loop(run, ckpt, workdir, signals)
  finally:
    ckpt.close()  # waits for pending saves and stops orbax's threads, also after an error


def _train_loop(
  run: Run,
  ckpt: checkpoint.Checkpointer,
  workdir: str,
  signals: faults.StopSignals | None = None,
) -> dict[str, Any]:
  """The steps of `train_and_evaluate`, from the latest checkpoint of `ckpt` to train.steps.

  Each step's loss and finiteness are read back right after it (the next batch is prepared
  while it runs): a non-finite step or a loss spike is handled before anything is saved.
  """
  config, tcfg = run.config, run.config.train
  _log(f'task {run.task.name}: {json.dumps(_jsonable(run.task.info))}')
  if 'entropy_per_token' in run.task.info:  # generated corpus: the best loss any model reaches
    info = run.task.info
    _log(
      f'entropy floor {info["entropy_per_token"]:.3f} nats/token '
      f'(unigram {info["unigram_entropy_per_token"]:.3f}): compare with the eval loss'
    )
  _log(f'model: {run.family}, {models.count_params(run.model_cfg):,} parameters')
  policy = faults.nonfinite_policy(tcfg, run.model_cfg.dtype)
  iterator = run.task.train_iterator()
  if ckpt.latest_step() is not None:
    state, data_state, step = ckpt.restore(run.abstract_state)  # onto this run's shardings
    if data_state:  # {}: no data position yet (a model imported by transformer.hf): start afresh
      iterator.set_state(data_state)
    _log(f'resumed from step {step} in {workdir}')
  else:
    state = run.init_state()

  writer = _summary_writer(workdir)
  start = int(state.step)
  metrics_log = _MetricsLog(workdir)
  metrics_log.start_from(start)
  progress = Progress(tcfg.steps, start)
  rng = run.replicate(jax.random.PRNGKey(config.seed + 1))
  history, eval_metrics = [], {}
  spikes = faults.SpikeDetector(tcfg.get('spike_factor', 0.0), tcfg.get('spike_window', 100))
  agreement = faults.HostAgreement(2)  # [a stop signal, a timed checkpoint due], over processes
  every_seconds, last_save = tcfg.get('checkpoint_every_seconds', 0), time.time()
  nonfinite_steps, skips_in_a_row, rollbacks = 0, 0, collections.Counter()
  window_tokens, window_start = 0, time.time()

  def event(step: int, text: str, **values) -> None:
    progress.close()
    _log(f'step {step}: {text}')
    metrics_log.write(step, 'event', values)

  def rollback(step: int, reason: str) -> tuple[TrainState, int]:
    """The last checkpoint's state (a fresh one if none); the data iterator is not rewound."""
    to_step = ckpt.latest_step()
    rollbacks[to_step] += 1
    if rollbacks[to_step] > faults.MAX_ROLLBACKS:
      raise faults.NonFiniteError(
        f'step {step}: {reason}, after {faults.MAX_ROLLBACKS} rollbacks to checkpoint '
        f'{to_step or 0} already; stopped. Lower optim.learning_rate or set optim.clip_norm'
      )
    if to_step is None:
      restored, to_step = run.init_state(), 0
    else:
      restored, _, to_step = ckpt.restore(run.abstract_state)
    history[:] = [h for h in history if h['step'] <= to_step]
    metrics_log.start_from(to_step)
    spikes.forget_after(to_step)
    skipped = (
      f'batches of steps {to_step + 1}-{step}' if step > to_step + 1 else f'batch of step {step}'
    )
    event(
      step,
      f'{reason}; rolled back to checkpoint {to_step}, skipping the {skipped}',
      event='rollback',
      to_step=to_step,
      reason=reason,
    )
    return restored, to_step

  step, pending = start, None
  received = lambda: signals is not None and signals.received is not None
  if start < tcfg.steps and agreement.now([received(), 0])[0]:  # a signal during the set-up
    got = signals.received if signals is not None else None
    where = f'no checkpoint yet in {ckpt.directory}'
    if ckpt.latest_step() is not None:
      where = f'checkpoint {start} in {ckpt.directory} is the latest'
    raise faults.Preempted(
      f'{got or "another process got a stop signal"}: stopped before the first step, so there is '
      f'nothing new to save ({where}); rerun the same command to resume',
      step=start,
      signal_name=got,
    )
  while step < tcfg.steps:
    host_batch, batch, data_state = pending or _next_batch(run, iterator)
    pending = None
    window_tokens += int(np.count_nonzero(host_batch['inputs']))
    try:
      state, metrics = run.train_step(state, batch, rng)
      if step + 1 < tcfg.steps:
        pending = _next_batch(run, iterator)  # prepared on the host while the step runs
      metrics = jax.device_get(metrics)  # waits for the step
    except Exception as e:
      if faults.is_out_of_memory(e):
        raise faults.out_of_memory_error(run, e, host_batch) from e
      raise
    step += 1
    loss = float(metrics['loss']) / max(float(metrics['denominator']), 1.0)

    # Non-finite steps: train_step has already left the parameters and optimizer state as they were.
    scale = float(metrics['loss_scale'])
    if _nonfinite(metrics, run.model_cfg.dtype):
      nonfinite_steps += 1
      _write_scalars(writer, step, {'nonfinite': 1.0}, prefix='train/')
      reason = f'loss {loss:.4g}, gradient norm {float(metrics["grad_norm"]):.4g} (not finite)'
      if policy == 'halt':
        progress.close()
        try:
          report = faults.describe_nonfinite(run, state.params, host_batch, rng, step, scale)
        except Exception as e:  # the report must never hide the halt itself
          failure = f'{type(e).__name__}: {faults._first_line(e)}'
          report = f'{reason}; the first non-finite tensor was not found ({failure})'
        last = ckpt.latest_step()
        kept = f'checkpoint {last} in {ckpt.directory}' if last is not None else 'no checkpoint'
        raise faults.NonFiniteError(
          f'step {step}: {report}. Stopped by train.nonfinite={_policy_name(tcfg, policy)} '
          f'(nothing was saved after it; the last good one is {kept}). Rerun to resume, or set '
          "train.nonfinite='skip' or 'rollback' to train past such steps"
        )
      if policy == 'rollback':
        state = None  # frees its device memory before the restore allocates it again
        state, step = rollback(step, reason)
        continue
      skips_in_a_row += 1
      event(step, f'{reason}; update skipped ({nonfinite_steps} so far)', event='nonfinite')
      if skips_in_a_row >= faults.MAX_SKIPS_IN_A_ROW:
        raise faults.NonFiniteError(
          f'step {step}: {skips_in_a_row} steps in a row were not finite and skipped '
          '(train.nonfinite=skip): the run has diverged. Lower optim.learning_rate or set '
          "optim.clip_norm, and resume, or use train.nonfinite='rollback'"
        )
    else:
      skips_in_a_row = 0
      ratio = spikes.check(step, loss)
      if ratio is not None:
        _write_scalars(writer, step, {'loss_spike': ratio}, prefix='train/')
        window = tcfg.get('spike_window', 100)
        text = f'loss spike: {loss:.4g} is {ratio:.1f}x the median of the last {window} losses'
        if tcfg.get('spike_rollback', False):
          state = None
          state, step = rollback(step, text)
          continue
        event(step, text, event='loss_spike', loss=loss, ratio=ratio)

    if step % tcfg.log_every == 0 or step == tcfg.steps:
      denominator = max(float(metrics['denominator']), 1.0)
      scalars = {
        'loss': loss,
        'perplexity': math.exp(min(float(metrics['nll']) / denominator, 700.0)),
        'learning_rate': float(metrics['learning_rate']),
        'grad_norm': float(metrics['grad_norm']),
        'tokens_per_sec': window_tokens / max(time.time() - window_start, 1e-9),
      }
      if run.model_cfg.dtype == 'float16':
        scalars.update(loss_scale=scale, skipped=float(metrics['skipped']))
      if nonfinite_steps:
        scalars['nonfinite_steps'] = float(nonfinite_steps)
      history.append({'step': step, **scalars})
      _write_scalars(writer, step, scalars, prefix='train/')
      metrics_log.write(step, 'train', scalars)
      progress.update(step, scalars['loss'], scalars['learning_rate'], scalars['tokens_per_sec'])
      window_tokens, window_start = 0, time.time()

    # Stop signals and timed checkpoints: every process acts on the same step.
    due = bool(every_seconds) and time.time() - last_save >= every_seconds
    stop, due = agreement.combine([received(), due])
    if stop and step < tcfg.steps:  # at the last step the run saves and evaluates as usual
      progress.close()
      ckpt.save(step, state, data_state)
      ckpt.wait()
      got = signals.received if signals is not None else None
      metrics_log.write(step, 'event', {'event': 'preempted', 'signal': got})
      metrics_log.close()
      if writer is not None:
        writer.flush()
      raise faults.Preempted(
        f'{got or "another process got a stop signal"}: saved checkpoint {step} (step {step} of '
        f'{tcfg.steps}, data position included) in {ckpt.directory}; rerun the same command to '
        'resume',
        step=step,
        signal_name=got,
      )
    entropy_every = tcfg.get('head_entropy_every', 0)
    if entropy_every and step % entropy_every == 0:  # attention entropy per head, on this batch
      from transformer import inspect as inspect_lib

      inputs = model_inputs(run.family, host_batch)
      inspect_lib.log_head_entropy(writer, run.model_cfg, state.params, inputs, step)
    if step % tcfg.eval_every == 0 or step == tcfg.steps:
      progress.close()
      eval_metrics, samples = run.evaluate(state.params)
      _report_eval(writer, step, eval_metrics, samples[: tcfg.num_samples])
      metrics_log.write(step, 'eval', _jsonable(eval_metrics))
    if step % tcfg.checkpoint_every == 0 or step == tcfg.steps or due:
      ckpt.save(step, state, data_state)
      last_save = time.time()
  progress.close()
  ckpt.wait()
  metrics_log.close()
  if writer is not None:
    writer.flush()
  return {'step': step, 'train': history, 'eval': eval_metrics}


def _policy_name(tcfg: ml_collections.ConfigDict, policy: str) -> str:
  """'halt', or 'auto' (= 'halt' for float32) when it came from 'auto'."""
  chosen = tcfg.get('nonfinite', 'auto')
  return f'{chosen!r}' if chosen == policy else f'{chosen!r} (= {policy!r} for this dtype)'


def _next_batch(run: Run, iterator) -> tuple[dict, dict, dict]:
  """(host batch, batch on the mesh, data position after it) of the next training step."""
  host_batch = next(iterator)
  return host_batch, run.place(host_batch), iterator.get_state()


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
    checkpoint._write_atomic(self.path, ''.join(kept))
    self._file = open(self.path, 'a')

  def write(self, step: int, kind: str, values: dict) -> None:
    if self._file is not None:
      self._file.write(json.dumps({'step': step, 'kind': kind, **values}) + '\n')
      self._file.flush()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None


def _jsonable(x):
  return json.loads(json.dumps(x, default=str))


def _summary_writer(workdir: str):
  if jax.process_index() != 0:
    return None
  from flax.metrics import tensorboard

  return tensorboard.SummaryWriter(os.path.join(workdir, 'tensorboard'))


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
