"""Measurements that sweeps run after training (or instead of it), by name in `MEASURES`.

Each takes a `research.sweeps.MeasureContext` plus the sweep's `measure_args` and returns
{metric name: number}, optionally with 'figures' (PNG/Markdown files relative to the run
directory) or 'skipped' (why nothing was measured, e.g. a kernel this backend lacks).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench.timing import synthetic_batch
from research import inspection as inspect_lib
from transformer import data
from transformer.config.experiment import apply_overrides
from transformer.data import grammar as grammar_lib
from transformer.data import number_words as numbers_lib
from transformer.model import entropy, hooks, models, objectives
from transformer.training.run import Run
from transformer.training.state import model_inputs
from transformer.training.steps import eval_step

Array = jax.Array


def _eval_loss(model, family: str, params, batches) -> dict[str, float]:
  """Summed eval_step metrics over host batches -> means (loss, accuracy, perplexity)."""
  step = jax.jit(functools.partial(eval_step, model=model, family=family))
  totals: dict[str, float] = {}
  for batch in batches:
    for key, value in jax.device_get(step(params, batch)).items():
      totals[key] = totals.get(key, 0.0) + float(value)
  return objectives.summarize(totals)


# Training-set fit (dropout: does a high rate underfit?) ----------------------------------------
def trainset_loss(ctx, batches: int = 8) -> dict[str, float]:
  """Loss and accuracy of the final parameters on `batches` training batches, without dropout."""
  run, params = ctx.load()
  iterator = run.task.train_iterator()
  sums = _eval_loss(run.model, run.family, params, [next(iterator) for _ in range(batches)])
  return {'trainset.loss': sums['loss'], 'trainset.accuracy': sums.get('accuracy', math.nan)}


# Head entropy (heads: some sharp, some nearly uniform) -----------------------------------------
def head_entropy(ctx, examples: int = 16) -> dict[str, Any]:
  """Per-head attention entropy on the first eval examples, normalised by log(visible keys).

  Returns entropy.mean/min/max over every head of every attention module, entropy.spread (max -
  min) and the shares of sharp (< 0.5) and nearly uniform (> 0.9) heads, plus a bar plot.
  entropy.layer_spread is the max - min among the heads of one module, averaged over modules: it
  is 0 with one head, so it measures head specialisation apart from differences between layers
  (a causal self attention and a cross attention differ whatever the head count).
  """
  run, params = ctx.load()
  batch = {k: v[:examples] for k, v in run.task.eval_batches()[0].items()}
  inputs = model_inputs(run.family, batch)
  _, cache = hooks.run_xla(run.model_cfg, params, inputs, entropy.patterns_and_scores)
  by_layer = {n: s['normalized'] for n, s in entropy.attention_entropy(cache).items()}
  inspect_lib.plot_head_entropy(
    by_layer, os.path.join(ctx.run_dir, 'head_entropy.png'), f'{ctx.variant}: normalised entropy'
  )
  return {**entropy_summary(by_layer), 'figures': ['head_entropy.png']}


def entropy_summary(by_layer: dict[str, np.ndarray]) -> dict[str, float]:
  """The entropy.* metrics of `head_entropy` from each module's per-head entropies [..., N]."""
  values = np.concatenate([np.ravel(v) for v in by_layer.values()])
  within = [np.ptp(np.asarray(v), axis=-1).mean() for v in by_layer.values()]  # per module
  return {
    'entropy.mean': float(values.mean()),
    'entropy.min': float(values.min()),
    'entropy.max': float(values.max()),
    'entropy.spread': float(values.max() - values.min()),
    'entropy.layer_spread': float(np.mean(within)),
    'entropy.sharp_share': float(np.mean(values < 0.5)),
    'entropy.uniform_share': float(np.mean(values > 0.9)),
  }


# Length extrapolation --------------------------------------------------------------------------
def extrapolation(ctx, factors=(1, 2, 4, 8), examples: int = 32) -> dict[str, float]:
  """Held-out loss at k times the trained length L = data.max_length, for each k in `factors`.

  The eval rows are built like the training rows (bos + a long held-out example cut to k*L - 1
  tokens, targets ending with eos), so only the length differs, and no training row was longer
  than L. RoPE variants with a scaling (model.rope_scaling) use rope_scaling_factor = k at k*L.
  A model that cannot run at a length (learned positions past max_length) scores inf.
  """
  run, params = ctx.load()
  cfg, length = run.model_cfg, ctx.config.data.max_length
  out: dict[str, float] = {}
  for k in factors:
    data_cfg = dataclasses.replace(
      run.experiment.data,
      max_length=k * length,
      num_train_examples=1,  # only the eval split is used
      num_eval_examples=examples,
      eval_batch_size=min(examples, 16),
    )
    task = data.build(data_cfg, family=run.family, workdir=ctx.checkpoint_dir, seed=0)
    scaled = cfg.rope_scaling != 'none' and k > 1
    model_cfg = cfg.replace(
      rope_scaling_factor=float(k) if scaled else cfg.rope_scaling_factor,
      rope_original_max_length=cfg.rope_original_max_length or length,
    )
    try:
      sums = _eval_loss(models.build(model_cfg), run.family, params, task.eval_batches())
      loss = sums['loss']
    except ValueError as e:  # learned positions: 'sequence length ... exceeds max_length'
      if 'exceeds max_length' not in str(e):
        raise
      loss = math.inf
    out[f'extrap.loss_{k}x'] = loss
  base = out.get(f'extrap.loss_{factors[0]}x')
  for k in factors[1:]:
    out[f'extrap.ratio_{k}x'] = out[f'extrap.loss_{k}x'] / base if base else math.inf
  return out


# Step time and compiled memory (remat) ---------------------------------------------------------
def step_time_memory(ctx, steps: int = 5, against: dict | None = None) -> dict[str, float]:
  """Median time of a training step (after 2 warm-up steps) and XLA's compiled memory for it, on
  random tokens at the config's batch size and length. No training data, no checkpoint.

  `against` (config overrides, e.g. {'model.remat': 'none'}) also compiles that reference and
  times the two in turn, `steps` rounds after the warm-ups:
  'step_ratio' is the median of each round's ratio (this over the reference), so that a machine
  that slows down or speeds up during the measurement moves both sides of every ratio alike.
  """
  own, out = _compiled_step(ctx.config), {}
  if against is None:
    times = _time_steps([own], steps)[0]
  else:
    config = ctx.config.copy_and_resolve_references()
    apply_overrides(config, against, 'step_time_memory(against=...)')
    ref_times, times = _time_steps([_compiled_step(config), own], steps)
    out['step_ratio'] = float(np.median(np.asarray(times) / np.asarray(ref_times)))
    out['step_ms_reference'] = 1e3 * float(np.median(ref_times))
  step = float(np.median(times))
  return {**own['memory'], 'step_ms': 1e3 * step, 'tokens_per_sec': own['tokens'] / step, **out}


def _compiled_step(config) -> dict:
  """A config's training step compiled on random tokens, ready to time, with its memory."""
  run = Run(config, None, with_data=False)
  cfg, dcfg = run.model_cfg, config.data
  length = dcfg.max_target_length if cfg.family == 'encoder_decoder' else dcfg.max_length
  batch = run.place(synthetic_batch(cfg, dcfg.batch_size, length))
  state, key = run.init_state(), run.replicate(jax.random.PRNGKey(1))
  compiled = run.train_step.lower(state, batch, key).compile()
  analysis, memory = compiled.memory_analysis(), {}
  if analysis is not None:
    memory['temp_mib'] = analysis.temp_size_in_bytes / 2**20
    total = analysis.temp_size_in_bytes + analysis.argument_size_in_bytes
    memory['total_mib'] = (total + analysis.output_size_in_bytes) / 2**20
  return dict(fn=compiled, args=[state, batch, key], memory=memory, tokens=dcfg.batch_size * length)


def _time_steps(compiled: list[dict], steps: int) -> list[list[float]]:
  """Seconds of each step of each compiled step, taking turns (one step of each per round, the
  order reversed every other round, so that going first or second favours neither) after 2
  warm-up rounds; each step carries its state on."""
  times: list[list[float]] = [[] for _ in compiled]
  for i in range(steps + 2):
    turns = list(zip(compiled, times, strict=True))
    for c, t in turns if i % 2 == 0 else turns[::-1]:
      start = time.perf_counter()
      c['args'][0], metrics = c['fn'](*c['args'])
      jax.block_until_ready(metrics)
      if i >= 2:
        t.append(time.perf_counter() - start)
  return times


# Cross-attention alignment on the numbers task -------------------------------------------------
def gold_alignment(digits: str) -> list[tuple[str, list[int]]]:
  """The words of a number with the indices of the digits that decide each word.

  Digits split into groups of three from the right (units, thousand, million, billion). In a
  group with digits (h, t, o): 'X hundred' <- h (both words); a tens word ('twenty'..'ninety')
  <- t; a ones word ('one'..'nine') <- o; 'ten'..'nineteen' <- t and o; the scale word
  ('thousand', ...) <- every digit of its group; 'zero' <- the digit 0.
  """
  text = str(int(digits))
  if text != digits:
    raise ValueError(f'digits={digits!r} must be a number without leading zeros')
  if text == '0':
    return [('zero', [0])]
  words: list[tuple[str, list[int]]] = []
  size = len(text)
  scales = dict((i + 1, name) for i, (_, name) in enumerate(reversed(numbers_lib.SCALES)))
  for group in reversed(range(-(-size // 3))):
    end = size - 3 * group
    start = max(0, end - 3)
    value = int(text[start:end])
    if value == 0:
      continue
    h_pos, t_pos, o_pos = end - 3, end - 2, end - 1
    hundreds, rest = value // 100, value % 100
    if hundreds:
      words += [(numbers_lib.ONES[hundreds], [h_pos]), ('hundred', [h_pos])]
    if rest >= 20:
      words.append((numbers_lib.TENS[rest // 10], [t_pos]))
      if rest % 10:
        words.append((numbers_lib.ONES[rest % 10], [o_pos]))
    elif rest >= 10:
      words.append((numbers_lib.ONES[rest], [t_pos, o_pos]))
    elif rest:
      words.append((numbers_lib.ONES[rest], [o_pos]))
    if group:
      words.append((scales[group], list(range(start, end))))
  assert ' '.join(w for w, _ in words) == numbers_lib.numbers_to_words(int(text))
  return words


def token_spans(tokenizer, ids: list[int]) -> list[tuple[int, int]] | None:
  """Character span of each token in tokenizer.decode(ids), from decoded prefixes; None when the
  prefixes do not line up (an unknown piece)."""
  full = tokenizer.decode(ids)
  spans, previous = [], 0
  for i in range(1, len(ids) + 1):
    prefix = tokenizer.decode(ids[:i])
    if not full.startswith(prefix):
      return None
    spans.append((previous, len(prefix)))
    previous = len(prefix)
  return spans


def gold_token_alignment(tokenizer, source: str, target: str):
  """(source ids, target ids, gold [len(target ids), len(source ids)] bool) for one number pair
  in the digits_to_words direction, or None when the tokens do not map back onto characters."""
  src_ids, tgt_ids = tokenizer.encode(source), tokenizer.encode(target)
  src_spans, tgt_spans = token_spans(tokenizer, src_ids), token_spans(tokenizer, tgt_ids)
  if src_spans is None or tgt_spans is None or tokenizer.decode(tgt_ids) != target:
    return None
  words = gold_alignment(source)
  word_of_char = np.full(len(target), -1)
  offset = 0
  for w, (word, _) in enumerate(words):
    offset = target.index(word, offset)
    word_of_char[offset : offset + len(word)] = w
    offset += len(word)
  gold = np.zeros((len(tgt_ids), len(src_ids)), bool)
  for t, (a, b) in enumerate(tgt_spans):
    digits = {d for w in set(word_of_char[a:b]) - {-1} for d in words[w][1]}
    for s, (c, d) in enumerate(src_spans):
      gold[t, s] = any(c <= digit < d for digit in digits)
  return src_ids, tgt_ids, gold


def alignment(ctx, examples: int = 64, figures: int = 2) -> dict[str, Any]:
  """Share of cross-attention mass on the gold alignment (`gold_alignment`), per decoder layer.

  Decoder query t (input: bos + target[:t]) predicts target token t, so its row is scored on the
  gold source tokens of target token t; the final eos row is not scored. The score of a layer is
  the mean over rows and examples of the head-averaged mass on gold source tokens; the chance
  level is the share of visible source tokens (eos included) that are gold.
  """
  run, params = ctx.load()
  dcfg, tok = ctx.config.data, run.task.tokenizer
  if run.family != 'encoder_decoder' or dcfg.numbers_direction != 'digits_to_words':
    raise ValueError('alignment needs family=encoder_decoder on the numbers task, digits_to_words')
  items = []
  for source, target in run.task.eval_examples(examples):
    found = gold_token_alignment(tok, source, target)
    if found and len(found[0]) < dcfg.max_source_length and len(found[1]) < dcfg.max_target_length:
      items.append(found)
  if not items:
    return {'skipped': 'no eval example maps back onto characters'}
  B = len(items)
  inputs = np.zeros((B, dcfg.max_source_length), np.int32)
  decoder_inputs = np.zeros((B, dcfg.max_target_length), np.int32)
  for b, (src, tgt, _) in enumerate(items):
    inputs[b, : len(src) + 1] = src + [data.EOS_ID]
    decoder_inputs[b, : len(tgt) + 1] = [data.BOS_ID] + tgt
  # Every pattern, though only the cross attention's are read: asking for a pattern puts its
  # attention on the dense path, and the inspections all read the same numbers.
  patterns = lambda n: n.endswith('hook_pattern')
  _, cache = hooks.run_xla(
    run.model_cfg, params, {'inputs': inputs, 'decoder_inputs': decoder_inputs}, patterns
  )
  out: dict[str, Any] = {}
  chance = np.mean([g.sum(1).mean() / (g.shape[1] + 1) for _, _, g in items])
  layer_scores, head_scores = {}, []
  for name, probs in cache.items():
    if 'cross_attn' not in name:  # decoder.blocks.{l}.cross_attn.hook_pattern
      continue
    per_head = np.zeros(probs.shape[1])
    for b, (_, _, gold) in enumerate(items):
      T, S = gold.shape
      mass = (probs[b, :, :T, :S] * gold[None]).sum(-1)  # [N, T]
      per_head += mass.mean(-1) / B
    layer = f'layer_{name.split(".")[2]}'  # the metric names: align.score_layer_0, ...
    layer_scores[layer] = float(per_head.mean())
    head_scores += list(per_head)
    out[f'align.score_{layer}'] = float(per_head.mean())
  best = max(layer_scores, key=layer_scores.get)
  out.update(
    {
      'align.score': layer_scores[best],
      'align.best_head': float(max(head_scores)),
      'align.chance': float(chance),
    }
  )
  pieces = lambda ids: [tok.decode([i]) or '▁' for i in ids]
  names = []
  for b in range(min(figures, B)):
    src, tgt, gold = items[b]
    attn = f'decoder.blocks.{best.removeprefix("layer_")}.cross_attn'
    probs = cache[f'{attn}.hook_pattern']
    maps = probs[b, :, : len(tgt), : len(src) + 1]
    gold_eos = np.concatenate([gold, np.zeros((len(tgt), 1), bool)], axis=1)
    name = f'alignment_{b}.png'
    inspect_lib.plot_attention(
      np.concatenate([maps.mean(0, keepdims=True), maps]),
      os.path.join(ctx.run_dir, name),
      query_labels=pieces(tgt),
      key_labels=pieces(src) + ['</s>'],
      title=f'{attn} (red: gold alignment)',
      gold=gold_eos,
      panel_titles=['mean of heads'] + [f'head {n}' for n in range(maps.shape[0])],
    )
    names.append(name)
  out['figures'] = names
  return out


# Left-to-right generation (bidirectional vs causal) --------------------------------------------
def _grammar_states(grammar, text: str) -> list[int | None]:
  """States of the words of `text` ('.' glued to words); an unknown word is None."""
  index = {w: i for i, w in enumerate(grammar.words)}
  states: list[int | None] = []
  for token in text.split():
    word = token.rstrip('.')
    states.append(index.get(word))
    states += [grammar.period] * (len(token) - len(word))
  return states


def generation(ctx, examples: int = 64, new_tokens: int = 24) -> dict[str, Any]:
  """Greedy left-to-right continuations of held-out prompts, scored by the true grammar.

  A causal LM predicts token t from the logits at t - 1. A bidirectional LM (BERT) is reused as
  generators built on it are: the row is bos + prompt + [MASK] and the logits at the mask give
  the next token, which replaces the mask before a new one is appended. gen.valid is the share of
  word transitions (from the prompt's last word through the generated words and the end) that the
  grammar allows; an unknown word counts as invalid. Samples go to samples.md.
  """
  run, params = ctx.load()
  if run.task.name != 'grammar':
    raise ValueError(
      f'generation needs data.task=grammar (the true grammar scores it), not {run.task.name!r}'
    )
  d = ctx.config.data
  grammar = grammar_lib.from_config(d)
  tok, family = run.task.tokenizer, run.family
  pairs = run.task.eval_examples(examples)
  prompts = [[data.BOS_ID] + tok.encode(p)[: ctx.config.data.max_length // 2] for p, _ in pairs]
  width = max(len(p) for p in prompts) + new_tokens + 1
  tokens = np.zeros((len(prompts), width), np.int32)
  lengths = np.array([len(p) for p in prompts])
  for b, p in enumerate(prompts):
    tokens[b, : len(p)] = p

  @jax.jit
  def next_tokens(params, tokens, lengths):  # [B, W], [B] -> [B]
    rows = jnp.arange(tokens.shape[0])
    if family == 'causal_lm':
      logits = run.model.apply({'params': params}, tokens, deterministic=True)
      return jnp.argmax(logits[rows, lengths - 1], axis=-1)
    masked = tokens.at[rows, lengths].set(data.MASK_ID)
    logits = run.model.apply({'params': params}, masked, deterministic=True)
    return jnp.argmax(logits[rows, lengths], axis=-1)

  done = np.zeros(len(prompts), bool)
  for _ in range(new_tokens):
    active = np.flatnonzero(~done)
    if not len(active):
      break
    step = np.asarray(next_tokens(params, tokens, lengths))
    tokens[active, lengths[active]] = step[active]
    done[active] |= step[active] == data.EOS_ID
    lengths[active] += 1
  valid, total, samples = 0, 0, []
  for b, (prompt, _) in enumerate(pairs):
    generated = [int(t) for t in tokens[b, len(prompts[b]) : lengths[b]]]
    ended = data.EOS_ID in generated
    text = tok.decode(generated[: generated.index(data.EOS_ID)] if ended else generated)
    states = _grammar_states(grammar, prompt)[-1:] + _grammar_states(grammar, text)
    states += [grammar.end] if ended else []
    for a, c in zip(states[:-1], states[1:]):
      total += 1
      valid += int(a is not None and c is not None and grammar.transitions[a, c] > 0)
    if len(samples) < 8:
      samples.append(f'- prompt: `{prompt}`\n  - continuation: `{text}`{" (end)" if ended else ""}')
  with open(os.path.join(ctx.run_dir, 'samples.md'), 'w') as f:
    f.write(f'# {ctx.variant}: greedy continuations\n\n' + '\n'.join(samples) + '\n')
  return {
    'gen.valid': valid / max(total, 1),
    'gen.transitions': float(total),
    'figures': ['samples.md'],
  }


MEASURES = {
  'trainset_loss': trainset_loss,
  'head_entropy': head_entropy,
  'extrapolation': extrapolation,
  'step_time_memory': step_time_memory,
  'alignment': alignment,
  'generation': generation,
}
