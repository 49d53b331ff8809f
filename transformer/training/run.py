"""`Run`: a model, its jitted steps, its data and its evaluation: what train and eval share."""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import jax
import ml_collections
import numpy as np

from transformer import data, sharding
from transformer.config import ModelConfig
from transformer.config.experiment import Config, TrainConfig
from transformer.model import decode, models, objectives
from transformer.training import optim, steps
from transformer.training.state import TrainState, create_state, weights

Array = jax.Array
_EVAL_IN_FLIGHT = 4  # eval steps queued before the oldest is read back


def loss_chunk_size(tcfg: TrainConfig, cfg: ModelConfig, device: Any) -> int | None:
  """The vocabulary chunk of the fused head + loss for `train.fused_loss`, or None for logits.

  'auto' fuses on CPU only: there it saves the [B, T, V] passes that XLA:CPU runs slowly, while GPU
  and TPU keep the path they were tuned on. Untied and classifier heads always use logits.
  """
  mode, chunk = tcfg.fused_loss, tcfg.loss_chunk_size  # checked by TrainConfig
  if mode == 'on' and not models.has_fused_head(cfg):
    raise ValueError(
      'train.fused_loss=on needs a tied token head (model.tie_output=True, num_classes=0); '
      "use 'auto' or 'off'"
    )
  fused = mode == 'on' or (
    mode == 'auto' and device.platform == 'cpu' and models.has_fused_head(cfg)
  )
  return chunk if fused else None


class Run:
  """A model, its jitted steps and its data: what training and evaluation share."""

  def __init__(
    self,
    config: ml_collections.ConfigDict,
    workdir: str | None,
    devices: list | None = None,
    *,
    with_data: bool = True,
    experiment: Config | None = None,
  ):
    """`devices` are what `config.mesh.shape` lays out; default `sharding.default_devices`: all
    of them, or on CPU after `sharding.use_every_core`, the cores the batches divide over.

    `with_data=False` skips the data task (benchmarks): the model keeps config.model.vocab_size.
    `experiment`: `Config.from_configdict(config)`, when the caller has it already (it is built
    here otherwise, which checks every knob before any work). `config` is changed in place to
    what the run is: data.max_length follows model.max_length unless given, and the vocabulary
    is the tokenizer's; `self.experiment` is the same, typed.
    """
    cfg = Config.from_configdict(config) if experiment is None else experiment
    rows = {key: getattr(cfg.data, key) for key in ('batch_size', 'eval_batch_size')}
    if devices is None:
      devices = sharding.default_devices(cfg.mesh.shape, list(rows.values()))
    self.partitioner = sharding.Partitioner.from_config(cfg.mesh, devices)
    for key, n in rows.items() if with_data else ():
      self.partitioner.check_batch_rows(f'data.{key}', n)
    _check_grad_accum_steps(cfg)
    self.task = _build_task(cfg, workdir) if with_data else None
    self.experiment = _sized_to_tokenizer(cfg, self.task)
    self.model_cfg, self.family = self.experiment.model, self.experiment.model.family
    config.data.max_length = cfg.data.max_length  # the context, set once by from_configdict
    if with_data:
      with config.unlocked():
        config.model.vocab_size = self.model_cfg.vocab_size
    self.config = config
    self.model = models.build(self.model_cfg)
    self.schedule, self.tx = optim.for_run(self.experiment)
    # The state is created directly on its shardings. The seed is an argument, not a constant of
    # the program: another seed reuses the compiled initialisation (JAX's compile cache).
    self._seed = np.uint32(cfg.seed)  # in [0, 2**32), checked by Config
    new_state = lambda seed, boxed=False: create_state(
      self.model, self.model_cfg, self.tx, seed, cfg.train.loss_scale, boxed=boxed
    )
    self._init_state, self.state_shardings, self.abstract_state = self.partitioner.sharded_init(
      new_state, self._seed
    )
    self._jit_steps()

  def _jit_steps(self) -> None:
    """The jitted train and eval steps, greedy decoding and token scoring, on the mesh."""
    p, tcfg = self.partitioner, self.experiment.train
    batch, rep, state = p.batch_sharding(), p.replicated, self.state_shardings
    # What evaluation and decoding take: the parameters (+ a batchnorm model's running stats).
    weight_shardings = weights(state)
    max_len = tcfg.max_decode_length
    train_step = functools.partial(
      steps.train_step,
      model=self.model,
      family=self.family,
      tx=self.tx,
      schedule=self.schedule,
      label_smoothing=tcfg.label_smoothing,
      grad_accum_steps=tcfg.grad_accum_steps,
      dynamic_scale=self.model_cfg.dtype == 'float16',
      loss_scale_period=tcfg.loss_scale_period,
      loss_chunk_size=loss_chunk_size(tcfg, self.model_cfg, p.mesh.devices.flat[0]),
    )
    eval_step = functools.partial(steps.eval_step, model=self.model, family=self.family)
    translate = lambda params, inputs: decode.greedy_translate(self.model, params, inputs, max_len)
    extend = lambda params, prompt: decode.greedy_continue(self.model, params, prompt, max_len)
    token_nll = functools.partial(steps.token_nll, self.model)
    # (function, in_shardings, out_shardings, donated arguments): only the train state is donated.
    table = [
      (train_step, (state, batch, rep), (state, rep), (0,)),
      (eval_step, (weight_shardings, batch), rep, ()),
      (translate, (weight_shardings, rep), rep, ()),
      (extend, (weight_shardings, rep), rep, ()),
      (token_nll, (weight_shardings, rep, rep), rep, ()),
    ]
    jitted = [p.jit(fn, ins, outs, donate_argnums=donate) for fn, ins, outs, donate in table]
    self.train_step, self.eval_step, self._translate, self._continue, self.token_nll = jitted

  def init_state(self) -> TrainState:
    """A fresh TrainState, each array created directly on its devices (never whole on one)."""
    return self._init_state(self._seed)

  def place(self, batch: dict[str, np.ndarray]) -> dict[str, Array]:
    """This process's rows of a batch -> global arrays sharded over the mesh."""
    return self.partitioner.place_batch(batch)

  def replicate(self, x: Any) -> Array:
    """A host value that every process holds identically -> an array on every device."""
    return self.partitioner.replicate(x)

  # Evaluation ------------------------------------------------------------------------------------
  def evaluate(self, params, num_decode: int | None = None) -> tuple[dict, list[tuple]]:
    """Loss/accuracy/perplexity over the eval set, plus BLEU/exact match for translation.

    `params`: `state.weights(state)`, the parameters plus a batchnorm model's running statistics
    (the parameters alone for every other model). Returns (metrics, samples) where samples are
    (source, reference, output) strings.
    """
    metrics = self._scores(params, self.task.eval_batches())
    tcfg = self.experiment.train
    if tcfg.eval_train_loss and hasattr(self.task, 'train_eval_batches'):
      metrics['train_loss'] = self._scores(params, self.task.train_eval_batches())['loss']
    num_decode = tcfg.eval_decode_examples if num_decode is None else num_decode
    samples = []
    if num_decode and self.family in ('encoder_decoder', 'causal_lm'):
      samples = self.generate(params, self.task.eval_examples(num_decode))
      if self.family == 'encoder_decoder':
        metrics.update(translation_metrics([s[2] for s in samples], [s[1] for s in samples]))
    return metrics, samples

  def _scores(self, params, batches: list[dict]) -> dict[str, float]:
    """Loss, accuracy and perplexity summed over `batches`, then divided by their weight."""
    totals: dict[str, float] = {}

    def add_oldest():
      for k, v in jax.device_get(queued.popleft()).items():
        totals[k] = totals.get(k, 0.0) + float(v)

    queued = collections.deque()  # a few steps in flight: the next batch is placed while one runs
    for batch in batches:
      queued.append(self.eval_step(params, self.place(batch)))
      if len(queued) > _EVAL_IN_FLIGHT:
        add_oldest()
    while queued:
      add_oldest()
    metrics = objectives.summarize(totals)
    metrics.pop('nll')
    return metrics

  def generate(self, params, examples: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
    """Greedy outputs for (source, reference) pairs: translations, or LM continuations."""
    tok = self.task.tokenizer
    dcfg = self.experiment.data
    outputs = []
    for start in range(0, len(examples), dcfg.eval_batch_size):
      chunk = examples[start : start + dcfg.eval_batch_size]
      if self.family == 'encoder_decoder':
        ids = [tok.encode(src)[: dcfg.max_source_length - 1] + [data.EOS_ID] for src, _ in chunk]
        inputs = _pad(ids, dcfg.max_source_length, num_rows=dcfg.eval_batch_size)
        out = self._translate(params, self.replicate(inputs))
      else:
        prefix = list(self.task.prompt_prefix)  # as the training rows start
        ids = [prefix + tok.encode(src)[: dcfg.max_length // 2] for src, _ in chunk]
        prompt = _pad(ids, dcfg.max_length // 2 + len(prefix), num_rows=dcfg.eval_batch_size)
        out = self._continue(params, self.replicate(prompt))
      for (src, ref), row in zip(chunk, np.asarray(out)):
        outputs.append((src, ref, tok.decode(row.tolist())))
    return outputs

  def score(self, params, texts: list[str]) -> list[tuple[float, int]]:
    """CausalLM: summed negative log-likelihood (nats) and token count of each text (+ eos)."""
    if self.family != 'causal_lm':
      raise ValueError(f'scoring texts needs family=causal_lm, not {self.family!r}')
    tok, length = self.task.tokenizer, self.experiment.data.max_length
    rows = self.experiment.data.eval_batch_size
    results = []
    for start in range(0, len(texts), rows):
      ids = [tok.encode(t)[: length - 1] for t in texts[start : start + rows]]
      inputs = _pad([[data.BOS_ID] + row for row in ids], length, rows)
      targets = _pad([row + [data.EOS_ID] for row in ids], length, rows)
      nll = self.token_nll(params, self.replicate(inputs), self.replicate(targets))
      weights = (inputs != data.PAD_ID).astype(np.float32)
      for row_nll, row_w in zip(np.asarray(nll)[: len(ids)], weights[: len(ids)]):
        results.append((float((row_nll * row_w).sum()), int(row_w.sum())))
    return results


def _sized_to_tokenizer(cfg: Config, task: Any) -> Config:
  """The experiment with the model's vocabulary taken from the task's tokenizer (None: kept).

  The vocabulary is rounded up to a multiple of `data.vocab_multiple` (so that tensor
  parallelism can split it); the extra rows are never targets. An imported Hugging Face model
  (tokenizer kind 'hf') keeps its own vocabulary when the tokenizer fits in it.
  """
  if task is None:
    return cfg
  model, tokenizer, multiple = cfg.model, task.tokenizer, cfg.data.vocab_multiple
  if tokenizer.kind == 'hf' and model.vocab_size >= tokenizer.vocab_size:
    return cfg  # an imported model keeps its own (often padded) embedding table
  vocab_size = -(-tokenizer.vocab_size // multiple) * multiple
  return dataclasses.replace(cfg, model=model.replace(vocab_size=vocab_size))


def _check_grad_accum_steps(cfg: Config) -> None:
  """train.grad_accum_steps must split each process's batch into equal micro-batches."""
  accum = cfg.train.grad_accum_steps
  rows = cfg.data.batch_size // jax.process_count()
  if accum < 1 or rows % accum:
    raise ValueError(
      f'train.grad_accum_steps={accum} must be >= 1 and divide the per-process batch of {rows}'
    )


def _build_task(cfg: Config, workdir: str | None) -> Any:
  """The data task of `cfg`, this process's share of it."""
  return data.build(
    cfg.data,
    family=cfg.model.family,
    workdir=workdir,
    seed=cfg.seed,
    process_index=jax.process_index(),
    process_count=jax.process_count(),
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
