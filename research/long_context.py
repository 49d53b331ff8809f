"""Measures of the long-context sweeps: recall accuracy on the `recall` task, the cost of a
training step against the sequence length, and RoPE scaling with an optional fine-tune.

Each is a sweep measure: `fn(ctx: sweeps.MeasureContext, **measure_args) -> {metric: number}`.
"""

from __future__ import annotations

import math
import time

import jax
import ml_collections
import numpy as np

from bench import timing
from transformer.data import recall
from transformer.training.run import Run
from transformer.training.state import model_inputs


def recall_accuracy(ctx) -> dict[str, float]:
  """Argmax accuracy on the held-out queries, each scored from the logits at the position that
  predicts it: `recall.accuracy` on the answers (the value after each queried key, the recall),
  `recall.key_accuracy` on the queried keys themselves.

  A queried key is predictable only when the keys are asked in the pairs' own order
  (recall_order='pairs'); in a random order the best guess is one of the keys not yet asked.
  `recall.min_distance` is the shortest distance in tokens from a queried key back to its pair.
  """
  run, params = ctx.load()
  dcfg = ctx.config.data
  pairs, gap = int(dcfg.recall_pairs), int(dcfg.recall_gap)
  logits_fn = jax.jit(lambda p, x: run.model.apply({'params': p}, **x))
  hits = {'value': 0, 'key': 0}
  total = 0
  distances = []
  for batch in run.task.eval_batches():
    logits = np.asarray(logits_fn(params, model_inputs(run.family, batch)))  # [B, T, V]
    predicted = logits.argmax(-1)  # [B, T]
    for row, targets in enumerate(batch['targets']):
      ids = [int(t) for t in targets if t > 0]
      if not ids:
        continue  # a padding row of the last batch
      text = run.task.tokenizer.decode(ids[:-1])  # one token per character, then eos
      if len(text) != len(ids) - 1:
        raise ValueError('recall_accuracy needs one token per character: data.tokenizer=byte')
      for offset, _ in recall.answers(text, pairs, gap):  # targets[t] is character t
        hits['value'] += int(predicted[row, offset] == targets[offset])
        hits['key'] += int(predicted[row, offset - 1] == targets[offset - 1])
        total += 1
        distances.append(offset - 1 - text.index(text[offset - 1]))
  return {
    'recall.accuracy': hits['value'] / total,
    'recall.key_accuracy': hits['key'] / total,
    'recall.min_distance': float(min(distances)),
  }


def elimination_accuracy(
  pairs: int,
  gap: int,
  queries: int,
  filler: str = 'constant',
  count: int = 20_000,
  seed: int = 0,
  vocab: int = len(recall.KEYS),
) -> list[float]:
  """The recall null: the expected value accuracy, per query position, of a model without any
  key-to-value lookup that keeps the bag of values from the pairs, drops those already answered
  and guesses a most frequent one of the rest (in a random query order each remaining value is
  equally likely to be asked next). Averaged over `count` examples of the task's own generator
  with `vocab` keys and values.

  It never falls below 1 / (pairs - j) at query j: asking a few of many pairs (queries << pairs)
  leaves elimination little more than 1 / pairs, copying any value of the pairs.

  Returns:
    one expected accuracy per query position, first query first.
  """
  rng = np.random.default_rng([seed, 3])  # not the train ([seed, 1]) or eval ([seed, 2]) stream
  texts = recall.sample(rng, count, pairs, gap, queries, 'random', filler, vocab)
  codes = np.frombuffer(''.join(texts).encode('utf-32-le'), np.uint32).reshape(count, -1)
  values = codes[:, 1 : 2 * pairs : 2]  # [N, pairs] code points
  answers = codes[:, 2 * pairs + gap + 1 :: 2]  # [N, queries]
  # Each value named by the first pair holding it: [N, pairs] counts, whatever the vocabulary.
  first = (values[:, :, None] == values[:, None, :]).argmax(2)  # [N, pairs]
  bag = (first[:, :, None] == np.arange(pairs)).sum(1)  # [N, pairs] multiplicities
  asked = (values[:, :, None] == answers[:, None, :]).argmax(1)  # [N, queries] first pair of each
  expected = []
  for j in range(queries):
    expected.append(float(np.mean(bag.max(1) / (pairs - j))))  # a most frequent one is right
    bag[np.arange(count), asked[:, j]] -= 1  # answered: out of the bag
  return expected


def step_cost(config: ml_collections.ConfigDict, length: int, steps: int = 3) -> dict[str, float]:
  """Median training-step time (ms, after one warm-up) and XLA's compiled temp memory (MiB) of
  `config`'s model at batch 1 and `length` tokens, on random tokens. Compressed attention pools
  blocks of `timing.compress_block(length)` (about sqrt(length), where its cost is lowest)."""
  config = ml_collections.ConfigDict(config.to_dict())
  config.data.batch_size, config.data.max_length = 1, length
  config.model.max_length = max(int(config.model.max_length), length)
  if config.model.get('attention') == 'compressed':  # the block of least cost at this length
    config.model.compress_block = timing.compress_block(length)
  run = Run(config, None, with_data=False)
  batch = run.place(timing.synthetic_batch(run.model_cfg, 1, length))
  state, key = run.init_state(), run.replicate(jax.random.PRNGKey(1))
  compiled = run.train_step.lower(state, batch, key).compile()
  times = []
  for _ in range(steps + 1):
    start = time.perf_counter()
    state, metrics = compiled(state, batch, key)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  memory = compiled.memory_analysis()
  mib = math.nan if memory is None else memory.temp_size_in_bytes / 2**20
  return {'ms': 1e3 * float(np.median(times[1:])), 'mib': mib}


def long_context(ctx, lengths=(256, 512, 1024, 2048, 4096), cost_task: str = 'grammar') -> dict:
  """recall_accuracy on the recall task; on `cost_task`, also `step_cost` at each length
  (metrics ms@T and mib@T): the attention is the variant's, so its cost needs measuring once."""
  out = {}
  if ctx.config.data.task == 'recall':
    out.update(recall_accuracy(ctx))
  if ctx.config.data.task == cost_task:
    config = ml_collections.ConfigDict(ctx.config.to_dict())
    config.model.vocab_size = ctx.load()[0].model_cfg.vocab_size  # the tokenizer's, as trained
    for T in lengths:
      cost = step_cost(config, T)
      out[f'ms@{T}'], out[f'mib@{T}'] = cost['ms'], cost['mib']
  return out


# RoPE scaling against training long ------------------------------------------------------------
def _at_length(config, length: int, scaling: str, rows: int, steps: int):
  """`config` for rows of `length` tokens (eval or fine-tune); RoPE scaled by length / trained."""
  config = ml_collections.ConfigDict(config.to_dict())
  trained = int(config.data.max_length)
  factor = length / trained
  config.data.max_length = config.model.max_length = length
  config.data.batch_size = config.data.eval_batch_size = rows
  config.data.num_train_examples = max(rows * steps, 1)
  config.model.rope_scaling = scaling if factor > 1 else 'none'
  config.model.rope_scaling_factor = factor if factor > 1 else 1.0
  config.model.rope_original_max_length = trained
  config.train.steps = max(steps, 1)
  config.optim.warmup_steps = min(int(config.optim.warmup_steps), config.train.steps - 1)
  return config


def rope_scaling(
  ctx,
  length: int,
  factor: int = 4,
  finetune: tuple = (),
  finetune_fraction: float = 0.05,
  lr: float = 1e-3,
) -> dict[str, float]:
  """Held-out loss at `length` L and at factor * L (`loss@1x`, `loss@{factor}x`). Evaluated past
  its trained length, a model uses its model.rope_scaling at factor eval length / trained length.

  Variants named in `finetune` first train `finetune_fraction` of train.steps more at factor * L
  with that scaling, on factor times fewer rows per step (the same tokens per step), from fresh
  Adam moments and a warmup-cosine schedule peaking at `lr`; they are evaluated after it.
  """
  _, params = ctx.load()
  steps, rows = int(ctx.config.train.steps), int(ctx.config.data.batch_size)
  trained = int(ctx.config.data.max_length)
  scaling = str(ctx.config.model.rope_scaling)
  out = {}
  if ctx.variant in finetune:
    ft_steps = max(1, round(finetune_fraction * steps))
    ft_rows = max(1, rows * trained // (factor * length))  # the tokens of one training step
    config = _at_length(ctx.config, factor * length, scaling, ft_rows, ft_steps)
    config.optim.schedule, config.optim.learning_rate = 'warmup_cosine', lr
    config.optim.warmup_steps = max(1, ft_steps // 5)
    ft = Run(config, ctx.checkpoint_dir)  # the trained run's tokenizer
    state = ft.init_state().replace(params=params)
    key, batches = ft.replicate(jax.random.PRNGKey(ctx.seed)), ft.task.train_iterator()
    for _ in range(ft_steps):
      state, _ = ft.train_step(state, ft.place(next(batches)), key)
    params = state.params
    out['finetune_steps'] = float(ft_steps)
    out['finetune_tokens'] = float(ft_steps * ft_rows * factor * length)
  for k in (1, factor):
    config = _at_length(ctx.config, k * length, scaling, 16, 1)
    config.data.num_eval_examples = int(ctx.config.data.num_eval_examples)
    out[f'loss@{k}x'] = Run(config, ctx.checkpoint_dir).evaluate(params, num_decode=0)[0]['loss']
  return out
