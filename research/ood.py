"""Out-of-distribution probes, as sweep measures: translating numbers longer than any seen in
training (`numbers_by_digits`), and a grammar LM's loss on word transitions that training never
showed (`grammar_held_out`, with data.grammar_holdout). Each takes a `sweeps.MeasureContext`."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from research import measures
from transformer import data
from transformer.data import batching
from transformer.data import grammar as grammar_lib
from transformer.data import number_words as numbers_lib
from transformer.model import decode, models
from transformer.training.state import model_inputs

MAX_DIGITS = len(str(numbers_lib.LARGEST))  # 12: numbers_to_words spells up to 10**12 - 1
_NUMBERS_SEED = 2718  # the probe numbers are the same for every run and seed
_SAMPLES = 4  # wrong translations per digit count written to ood_samples.md


# Shared: teacher-forced scores of formatted batches ----------------------------------------------
@functools.partial(jax.jit, static_argnums=(0, 1))
def _token_scores(model, family: str, params, batch: dict) -> tuple[jax.Array, jax.Array]:
  """Per-token nll [B, T] (nats) and argmax hits [B, T] of batch['targets'], teacher forced."""
  logits = model.apply(models.variables(params), **model_inputs(family, batch), deterministic=True)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))  # [B, T, V]
  nll = -jnp.take_along_axis(logp, batch['targets'][..., None], axis=-1)[..., 0]
  return nll, jnp.argmax(logits, axis=-1) == batch['targets']


def _batch(family: str, parts: list[tuple[list[int], ...]], lengths: dict, vocab: int) -> dict:
  """One padded batch of token examples, formatted exactly as the training rows are."""
  columns = tuple(batching.Ragged.from_lists(c, np.int32) for c in zip(*parts))
  batcher = batching.Batcher(
    family=family,
    max_lengths=lengths,
    buckets={stream: (n,) for stream, n in lengths.items()},
    vocab_size=vocab,
    mlm_prob=0.0,
  )
  (batch,) = batching.eval_batches(batching.Examples(columns), batcher, len(parts), 1)
  return batch


# Numbers: exact match by digit count -------------------------------------------------------------
def check_digits(digits: Sequence[int]) -> None:
  """One ValueError naming the first digit count outside 1..MAX_DIGITS."""
  if isinstance(digits, int) or not len(digits):
    raise ValueError(f'digits={digits!r} must be a non-empty list of digit counts in 1..12')
  for d in digits:
    if isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= MAX_DIGITS:
      raise ValueError(
        f'digits={d!r} is out of range; numbers have 1..{MAX_DIGITS} digits (up to 10**12 - 1)'
      )


def numbers_with_digits(digits: int, count: int, seed: int = _NUMBERS_SEED) -> np.ndarray:
  """`count` numbers of exactly `digits` digits, fixed by `seed` (with replacement).

  From 3 digits on they are held-out numbers (`number_words.is_held_out`), which no training
  split holds whatever its numbers_max; below 100 every number is training data.
  """
  check_digits([digits])
  rng = np.random.default_rng([seed, digits])
  low, high = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
  out = np.zeros([0], np.int64)
  while len(out) < count:
    drawn = rng.integers(low, high + 1, size=2 * count + 16)
    out = np.concatenate([out, drawn[numbers_lib.is_held_out(drawn)] if digits >= 3 else drawn])
  return out[:count]


def number_pairs(digits: int, count: int, direction: str) -> list[tuple[str, str]]:
  """(source, reference) strings of `numbers_with_digits` in the task's direction."""
  pairs = [
    (str(n), numbers_lib.numbers_to_words(int(n))) for n in numbers_with_digits(digits, count)
  ]
  return pairs if direction == 'digits_to_words' else [(w, n) for n, w in pairs]


def exact_match(hypotheses: Sequence[str], references: Sequence[str]) -> float:
  """Share of hypotheses equal to their reference, up to spaces at the ends and between words."""
  if len(hypotheses) != len(references) or not references:
    raise ValueError(f'{len(hypotheses)} hypotheses for {len(references)} references')
  same = [h.split() == r.split() for h, r in zip(hypotheses, references)]
  return float(np.mean(same))


def _spells(tokenizer, text: str) -> bool:
  """Whether `tokenizer` gives `text` back from its ids (no unknown piece or character)."""
  try:
    ids = tokenizer.encode(text)
  except ValueError:  # a char tokenizer refuses characters it has not seen
    return False
  return data.UNK_ID not in ids and tokenizer.decode(ids) == text


def check_spelling(tokenizer, pairs: dict[int, list[tuple[str, str]]], train_digits: int) -> None:
  """One ValueError for the first digit count whose sources or references `tokenizer` cannot
  spell. SentencePiece trained on numbers up to 6 digits knows every word they use ('thousand'
  included), but 7 digits need 'million', whose 'm' it has never seen: it becomes the unknown
  piece and no model could write it. Digits are always known (one piece each)."""
  for d, examples in pairs.items():
    for text in (t for pair in examples for t in pair):
      if not _spells(tokenizer, text):
        raise ValueError(
          f'digits={d}: the {tokenizer.kind} tokenizer, trained on numbers of at most '
          f'{train_digits} digits, cannot spell {text!r} (an unknown piece); use digit counts '
          "whose words occur in training ('million' comes with 7 digits, 'billion' with 10)"
        )


def _saved_tokenizer(directory: str):
  """The run's saved tokenizer (cheap, no model), or None when it has none saved."""
  path = os.path.join(directory, 'tokenizer')
  return data.load_tokenizer(path) if os.path.isdir(path) else None


def numbers_by_digits(ctx, digits: Sequence[int] = (4, 5, 6), examples: int = 64) -> dict:
  """Greedy translation of numbers with exactly d digits, for each d in `digits`.

  Trained on numbers up to data.numbers_max (ood.train_digits digits), a model meets longer ones
  only here. The numbers are `numbers_with_digits` (fixed, held-out from 3 digits on); the same
  for every run. Either direction of the task works.

  Returns:
    ood.exact@d: the share of greedy translations equal to the reference (`exact_match`).
    ood.token_acc@d: teacher-forced argmax accuracy over the reference tokens and its eos.
    ood.nll@d: teacher-forced mean negative log-likelihood per reference token (nats).
    ood.train_digits: the digits of data.numbers_max. Also 'figures': ood_samples.md, wrong
    translations per digit count.

  Raises:
    ValueError: a digit count outside 1..12, a run that is not an encoder-decoder on the numbers
      task, or a digit count the run's tokenizer cannot spell (`check_spelling`), all before the
      model is loaded when the run saved its tokenizer.
  """
  check_digits(digits)
  if isinstance(examples, bool) or not isinstance(examples, int) or examples < 1:
    raise ValueError(f'examples={examples!r} must be a positive integer')
  dcfg = ctx.config.data
  if dcfg.task != 'numbers' or ctx.config.model.family != 'encoder_decoder':
    raise ValueError(
      'numbers_by_digits needs an encoder_decoder on the numbers task; this run is '
      f'family={ctx.config.model.family!r} on task={dcfg.task!r}'
    )
  train_digits = len(str(int(dcfg.numbers_max)))
  pairs = {d: number_pairs(d, examples, dcfg.numbers_direction) for d in digits}
  saved = _saved_tokenizer(ctx.checkpoint_dir)
  if saved is not None:
    check_spelling(saved, pairs, train_digits)
  run, params = ctx.load()
  tok = run.task.tokenizer
  check_spelling(tok, pairs, train_digits)  # cheap; the one the model was trained with
  encoded = {d: [(tok.encode(s), tok.encode(r)) for s, r in p] for d, p in pairs.items()}
  # One shape for every digit count (one compile each for scoring and decoding).
  lengths = {
    'inputs': max(len(s) for e in encoded.values() for s, _ in e) + 1,  # + eos
    'targets': max(len(r) for e in encoded.values() for _, r in e) + 1,
  }
  # Tokens to decode: the longest reference and its eos, and a few more to show what follows
  # (learned positions stop at the model's max_length).
  steps = lengths['targets'] + 4
  if run.model_cfg.position == 'learned':
    steps = max(lengths['targets'], min(steps, run.model_cfg.max_length))
  out: dict[str, Any] = {'ood.train_digits': float(train_digits)}
  notes = [f'# {ctx.variant}: wrong greedy translations (trained up to {train_digits} digits)\n']
  for d in digits:
    batch = _batch('encoder_decoder', encoded[d], lengths, tok.vocab_size)
    nll, hits = jax.device_get(_token_scores(run.model, run.family, params, batch))
    weights = batch['weights']
    out[f'ood.token_acc@{d}'] = float((hits * weights).sum() / weights.sum())
    out[f'ood.nll@{d}'] = float((nll * weights).sum() / weights.sum())
    rows = np.asarray(decode.greedy_translate(run.model, params, batch['inputs'], steps))
    hypotheses = [tok.decode(row.tolist()) for row in rows]  # decode stops at the first eos
    references = [r for _, r in pairs[d]]
    out[f'ood.exact@{d}'] = exact_match(hypotheses, references)
    wrong = [(s, r, h) for (s, r), h in zip(pairs[d], hypotheses) if h.split() != r.split()]
    notes.append(f'\n## {d} digits: exact match {out[f"ood.exact@{d}"]:.3f}\n')
    notes += [f'- `{s}` -> `{h}` (reference `{r}`)\n' for s, r, h in wrong[:_SAMPLES]]
  with open(os.path.join(ctx.run_dir, 'ood_samples.md'), 'w') as f:
    f.writelines(notes)
  out['figures'] = ['ood_samples.md']
  return out


# Grammar: loss on held-out word transitions ------------------------------------------------------
def token_owners(
  grammar: grammar_lib.Grammar, text: str, spans: list[tuple[int, int]]
) -> tuple[list, list[int], set]:
  """Which state of `text` each token spells.

  Args:
    grammar: the chain; text: a document (or a prefix of whole words of one); spans: the
      character span of each token (`measures.token_spans`).

  Returns:
    (states, owners, mixed): the states of `text` (`measures._grammar_states`); per token, the
    index in `states` of the one it spells (a token of spaces only spells the next one; -1: none,
    or several); and the indices of the states that share a token with another (a word and its
    '.' in one piece, say).
  """
  states = measures._grammar_states(grammar, text)
  state_of_char = np.full(len(text), -1)  # -1: a space
  k = 0
  for at, piece in _pieces(text):
    word = piece.rstrip('.')
    state_of_char[at : at + len(word)] = k
    for j in range(len(word), len(piece)):  # each '.' is a state of its own
      state_of_char[at + j] = k + 1 + j - len(word)
    k += 1 + len(piece) - len(word)
  owners, mixed = [], set()
  for a, b in spans:
    inside = {int(s) for s in state_of_char[a:b] if s >= 0}
    if not inside and a < len(text):  # spaces only: it starts the next word
      after = state_of_char[b:][state_of_char[b:] >= 0]
      inside = {int(after[0])} if len(after) else set()
    if len(inside) > 1:
      mixed |= inside
    owners.append(inside.pop() if len(inside) == 1 else -1)
  return states, owners, mixed


def _pieces(text: str):
  """(offset, piece) of each space-separated piece of `text`."""
  at = 0
  for piece in text.split(' '):
    yield at, piece
    at += len(piece) + 1


def grammar_held_out(ctx, examples: int = 64) -> dict[str, float]:
  """Loss of a grammar LM on eval word transitions seen in training against held-out ones.

  With data.grammar_holdout > 0 the training documents never contain the held-out (word, next
  word) transitions (the task info's `held_out_transitions`); the eval documents come from the
  full chain. Each token of the first `examples` eval documents is given to the word it spells
  (`token_owners`); a word after a word is scored as a transition by all of its tokens. A word
  that shares a token with a '.' is left out, as is a word cut by max_length. The chain's own
  cost of a transition is -log P[prev, next] of the full chain, spread over the same tokens.
  (A word's tokens do not include the decision that it ends, which the next token makes: the
  comparison with the chain is close, not exact.)

  Returns:
    ood.loss_seen / ood.loss_held_out: mean model nll per token (nats) of the next words of
      seen / held-out transitions; ood.chain_nll_seen / ood.chain_nll_held_out: the chain's
      nll of those transitions per the same tokens; ood.excess_*: loss minus chain nll.
    ood.seen_prob / ood.held_out_prob: the mean probability the model gives the next word (the
      product of its tokens' probabilities); ood.chain_seen_prob / ood.chain_held_out_prob: the
      chain's, P[prev, next].
    ood.unigram_nll_* / ood.unigram_*_prob: the same for the best model that ignores the
      previous word (the chain's stationary probability of the next word): what a model that
      learned word frequencies but no transitions scores on the same transitions.
    ood.transitions_seen / ood.transitions_held_out: how many were scored; ood.holdout: the
      share of the chain's word transitions held out. NaN where none were scored.
  """
  if isinstance(examples, bool) or not isinstance(examples, int) or examples < 1:
    raise ValueError(f'examples={examples!r} must be a positive integer')
  dcfg = ctx.config.data
  if dcfg.task != 'grammar' or ctx.config.model.family != 'causal_lm':
    raise ValueError(
      'grammar_held_out needs a causal_lm on the grammar task; this run is '
      f'family={ctx.config.model.family!r} on task={dcfg.task!r}'
    )
  if not dcfg.get('grammar_holdout', 0.0):
    raise ValueError('grammar_held_out needs data.grammar_holdout > 0 (transitions to hold out)')
  grammar = grammar_lib.from_config(dcfg)
  run, params = ctx.load()
  held = run.task.info.get('held_out_transitions')
  if held is None:  # the same pick as the run's, from the config
    held = grammar_lib.held_out_transitions(grammar, dcfg.grammar_holdout, int(dcfg.grammar_seed))
  held = {tuple(edge) for edge in held}
  tok, length = run.task.tokenizer, int(run.config.data.max_length)  # resolved by the run
  rows, owned = [], []
  for prompt, rest in run.task.eval_examples(examples):
    document = f'{prompt} {rest}'.strip()  # eval_examples splits a document at a space
    ids = tok.encode(document)
    cut = len(ids) > length - 1  # as training cuts it: bos + ids + eos <= max_length
    ids = ids[: length - 1]
    text = tok.decode(ids)
    spans = measures.token_spans(tok, ids)
    if spans is None or not document.startswith(text):
      continue  # the tokens do not map back onto characters
    if cut:  # whole words only: drop the last, perhaps partial, one
      text = text[: max(text.rfind(' '), 0)]
    rows.append((ids,))
    owned.append(token_owners(grammar, text, spans))
  if not rows:
    return {'skipped': 'no eval document maps back onto characters'}
  batch = _batch('causal_lm', rows, {'': length}, tok.vocab_size)
  nll = np.asarray(jax.device_get(_token_scores(run.model, run.family, params, batch)[0]))
  # kind -> sums of [transitions, tokens, model nll, chain nll, model p, chain p, unigram nll,
  # unigram p]
  sums = {'seen': np.zeros(8), 'held_out': np.zeros(8)}
  words = grammar.period  # states below this are words
  unigram = grammar.stationary()  # [V+2] the best prediction that ignores the previous word
  for b, (states, owners, mixed) in enumerate(owned):
    owners = np.asarray(owners)
    for k in range(1, len(states)):
      prev, nxt = states[k - 1], states[k]
      if prev is None or nxt is None or prev >= words or nxt >= words or k in mixed:
        continue  # not a word after a word, or not scored by tokens of its own
      mine = np.flatnonzero(owners == k)
      if not len(mine):
        continue
      word_nll, chain_p = float(nll[b, mine].sum()), float(grammar.transitions[prev, nxt])
      kind = 'held_out' if (prev, nxt) in held else 'seen'
      sums[kind] += [
        *(1, len(mine), word_nll, -math.log(chain_p), math.exp(-word_nll), chain_p),
        *(-math.log(unigram[nxt]), unigram[nxt]),
      ]
  out = {'ood.holdout': len(held) / len(grammar_lib.word_transitions(grammar))}
  for kind, (count, tokens, model_nll, chain_nll, p, chain_p, uni_nll, uni_p) in sums.items():
    per = lambda x, n: float(x / n) if n else math.nan
    out[f'ood.transitions_{kind}'] = float(count)
    out[f'ood.loss_{kind}'] = per(model_nll, tokens)
    out[f'ood.chain_nll_{kind}'] = per(chain_nll, tokens)
    out[f'ood.excess_{kind}'] = per(model_nll - chain_nll, tokens)
    out[f'ood.{kind}_prob'] = per(p, count)
    out[f'ood.chain_{kind}_prob'] = per(chain_p, count)
    out[f'ood.unigram_nll_{kind}'] = per(uni_nll, tokens)
    out[f'ood.unigram_{kind}_prob'] = per(uni_p, count)
  return out
