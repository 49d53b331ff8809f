"""The training loop: TrainState, pure `train_step`/`eval_step`, and `train_and_evaluate`.

`train_and_evaluate(config, workdir)` is everything `python -m experiments.train` does; tests and
notebooks call it directly.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from transformer import checkpoint, data, decode, models, objectives, optim
from transformer.config import ModelConfig

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
  *,
  model: Any,
  family: str,
  tx: optax.GradientTransformation,
  schedule: optax.Schedule,
  rng: Array,
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
  finite = jnp.isfinite(grad_norm)
  if dynamic_scale:  # skip non-finite steps, halve the scale; double it after `scale_period` good
    keep = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(finite, a, b), new, old)
    params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
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
  """The model of the experiment, with the vocabulary taken from the tokenizer."""
  with config.unlocked():
    config.model.vocab_size = tokenizer.vocab_size
  return ModelConfig.from_config(config.model)


def create_state(model, model_cfg, tx, seed: int, loss_scale: float) -> TrainState:
  params = model.init(jax.random.PRNGKey(seed), **model.dummy_inputs())['params']
  scale = loss_scale if model_cfg.dtype == 'float16' else 1.0
  return TrainState(
    step=jnp.zeros((), jnp.int32),
    params=params,
    opt_state=tx.init(params),
    loss_scale=jnp.asarray(scale, jnp.float32),
    good_steps=jnp.zeros((), jnp.int32),
  )


class Run:
  """A model, its jitted steps and its data: what training and evaluation share."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str | None):
    self.config = config
    self.task = data.build(
      config.data,
      family=config.model.family,
      workdir=workdir,
      seed=config.seed,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
    )
    self.model_cfg = resolve_model_config(config, self.task.tokenizer)
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
    self.train_step = jax.jit(
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
      donate_argnums=(0,),
    )
    self.eval_step = jax.jit(functools.partial(eval_step, model=self.model, family=self.family))

  def init_state(self) -> TrainState:
    return create_state(
      self.model, self.model_cfg, self.tx, self.config.seed, self.config.train.loss_scale
    )

  # Evaluation ------------------------------------------------------------------------------------
  def evaluate(self, params, num_decode: int | None = None) -> tuple[dict, list[tuple]]:
    """Loss/accuracy/perplexity over the eval set, plus BLEU/exact match for translation.

    Returns (metrics, samples) where samples are (source, reference, output) strings.
    """
    totals: dict[str, float] = {}
    for batch in self.task.eval_batches():
      sums = jax.device_get(self.eval_step(params, batch))
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
    dcfg, max_len = self.config.data, self.config.train.max_decode_length
    outputs = []
    for start in range(0, len(examples), dcfg.eval_batch_size):
      chunk = examples[start : start + dcfg.eval_batch_size]
      if self.family == 'encoder_decoder':
        ids = [tok.encode(src)[: dcfg.max_source_length - 1] + [data.EOS_ID] for src, _ in chunk]
        inputs = _pad(ids, dcfg.max_source_length, num_rows=dcfg.eval_batch_size)
        out = _jit_translate(self.model, params, inputs, max_len)
      else:
        ids = [[data.BOS_ID] + tok.encode(src)[: dcfg.max_length // 2] for src, _ in chunk]
        prompt = _pad(ids, dcfg.max_length // 2 + 1, num_rows=dcfg.eval_batch_size)
        out = _jit_continue(self.model, params, prompt, max_len)
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
      nll = _jit_token_nll(self.model, params, inputs, targets)
      weights = (inputs != data.PAD_ID).astype(np.float32)
      for row_nll, row_w in zip(np.asarray(nll)[: len(ids)], weights[: len(ids)]):
        results.append((float((row_nll * row_w).sum()), int(row_w.sum())))
    return results


@functools.partial(jax.jit, static_argnums=0)
def _jit_token_nll(model, params, inputs, targets):
  logits = model.apply({'params': params}, inputs).astype(jnp.float32)  # [B, T, V]
  logp = jax.nn.log_softmax(logits)
  return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]  # [B, T]


@functools.partial(jax.jit, static_argnums=(0, 3))
def _jit_translate(model, params, inputs, max_len):
  return decode.greedy_translate(model, params, inputs, max_len)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _jit_continue(model, params, prompt, max_len):
  return decode.greedy_continue(model, params, prompt, max_len)


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


def load_run(workdir: str, step: int | None = None) -> tuple[Run, TrainState, int]:
  """Rebuilds the Run of `workdir` from its config.json and restores a checkpoint (latest)."""
  saved = checkpoint.read_run_config(workdir)
  if saved is None:
    raise FileNotFoundError(
      f'no config.json in workdir {workdir!r}; is it a sparrow run directory?'
    )
  run = Run(ml_collections.ConfigDict(saved), workdir)
  ckpt = checkpoint.Checkpointer(workdir, keep=run.config.train.keep_checkpoints)
  state, _, step = ckpt.restore(jax.eval_shape(run.init_state), step)
  ckpt.close()
  return run, state, step


# The loop ----------------------------------------------------------------------------------------
class Progress:
  """One console line per log step: step, loss, learning rate, tokens/s and ETA."""

  def __init__(self, total: int, start: int):
    self.total, self.start_step, self.start_time = total, start, time.time()
    self.tty = sys.stdout.isatty()

  def update(self, step: int, loss: float, lr: float, tokens_per_sec: float) -> None:
    done = step - self.start_step
    rate = done / max(time.time() - self.start_time, 1e-9)
    eta = (self.total - step) / rate if rate > 0 else float('inf')
    width = 20
    filled = int(width * step / self.total)
    bar = '#' * filled + '.' * (width - filled)
    line = (
      f'[{bar}] step {step}/{self.total} | loss {loss:.4f} | lr {lr:.3g} | '
      f'{tokens_per_sec / 1e3:.1f}k tok/s | ETA {_duration(eta)}'
    )
    print(('\r' + line) if self.tty else line, end='' if self.tty else '\n', flush=True)

  def close(self) -> None:
    if self.tty:
      print()


def _duration(seconds: float) -> str:
  if not math.isfinite(seconds):
    return '?'
  minutes, seconds = divmod(int(seconds), 60)
  return f'{minutes}m{seconds:02d}s'


def _log(*args) -> None:
  if jax.process_index() == 0:
    print(*args, flush=True)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains `config` in `workdir`, resuming from its latest checkpoint; returns final metrics."""
  config = ml_collections.ConfigDict(config.to_dict())  # never mutate the caller's config
  tcfg = config.train
  ModelConfig.from_config(config.model)  # bad shapes and names fail before anything is written
  saved = checkpoint.read_run_config(workdir)
  if saved is not None:  # compare before touching anything; the vocabulary is checked below
    config.model.vocab_size = saved['model']['vocab_size']
  checkpoint.check_resume_compatible(workdir, config)
  ckpt = checkpoint.Checkpointer(workdir, keep=tcfg.keep_checkpoints)  # checks it is writable
  try:
    run = Run(config, workdir)  # sets model.vocab_size from the tokenizer
    checkpoint.check_resume_compatible(workdir, config)
    checkpoint.write_run_metadata(workdir, config)
    return _train_loop(run, ckpt, workdir)
  finally:
    ckpt.close()  # waits for pending saves and stops orbax's threads, also after an error


def _train_loop(run: Run, ckpt: checkpoint.Checkpointer, workdir: str) -> dict[str, Any]:
  config, tcfg = run.config, run.config.train
  _log(f'task {run.task.name}: {json.dumps(_jsonable(run.task.info))}')
  if 'entropy_per_token' in run.task.info:  # generated corpus: the best loss any model reaches
    info = run.task.info
    _log(
      f'entropy floor {info["entropy_per_token"]:.3f} nats/token '
      f'(unigram {info["unigram_entropy_per_token"]:.3f}): compare with the eval loss'
    )
  _log(f'model: {run.family}, {models.count_params(run.model_cfg):,} parameters')
  state = run.init_state()
  iterator = run.task.train_iterator()
  if ckpt.latest_step() is not None:
    state, data_state, step = ckpt.restore(state)
    iterator.set_state(data_state)
    _log(f'resumed from step {step} in {workdir}')

  writer = _summary_writer(workdir)
  start = int(state.step)
  progress = Progress(tcfg.steps, start)
  rng = jax.random.PRNGKey(config.seed + 1)
  history, eval_metrics = [], {}
  window_tokens, window_start = 0, time.time()
  step = start
  for step in range(start + 1, tcfg.steps + 1):
    batch = next(iterator)
    window_tokens += int(np.count_nonzero(batch['inputs']))
    state, metrics = run.train_step(state, batch, rng=rng)
    if step % tcfg.log_every == 0 or step == tcfg.steps:
      metrics = jax.device_get(metrics)
      denominator = max(float(metrics['denominator']), 1.0)
      scalars = {
        'loss': float(metrics['loss']) / denominator,
        'perplexity': math.exp(min(float(metrics['nll']) / denominator, 700.0)),
        'learning_rate': float(metrics['learning_rate']),
        'grad_norm': float(metrics['grad_norm']),
        'tokens_per_sec': window_tokens / max(time.time() - window_start, 1e-9),
      }
      if run.model_cfg.dtype == 'float16':
        scalars.update(loss_scale=float(metrics['loss_scale']), skipped=float(metrics['skipped']))
      history.append({'step': step, **scalars})
      _write_scalars(writer, step, scalars, prefix='train/')
      progress.update(step, scalars['loss'], scalars['learning_rate'], scalars['tokens_per_sec'])
      window_tokens, window_start = 0, time.time()
    if step % tcfg.eval_every == 0 or step == tcfg.steps:
      progress.close()
      eval_metrics, samples = run.evaluate(state.params)
      _report_eval(writer, step, eval_metrics, samples[: tcfg.num_samples])
    if step % tcfg.checkpoint_every == 0 or step == tcfg.steps:
      ckpt.save(step, state, iterator.get_state())
  progress.close()
  ckpt.wait()
  if writer is not None:
    writer.flush()
  return {'step': step, 'train': history, 'eval': eval_metrics}


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
