"""The built-in `grammar` LM task: documents from a random sparse word-level Markov chain, or
from one whose words fall into classes that share their next-word distribution.

Its entropy rate is known exactly, so a trained LM's loss can be compared with the floor.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses

import ml_collections
import numpy as np

_CONSONANTS = 'bdfgklmnprstvz'
_VOWELS = 'aeiou'
_START_WORDS = 24  # words that may begin a sentence
_SUCCESSORS = (2, 6)  # each word is followed by 2..6 distinct words (inclusive)
_SENTENCE_END = (0.1, 0.35)  # per-word probability that the sentence ends after it
_DOCUMENT_END = 0.6  # probability that a document ends after a sentence


@dataclasses.dataclass(frozen=True)
class Grammar:
  """A first-order Markov chain over word types plus two boundary symbols.

  States 0..V-1 are words, state V is '.' (end of sentence) and state V+1 is END (end of
  document, the tokenizer's eos). A document is the path from END back to END; '.' is written
  glued to the previous word: 'tabo ku rime. fa losi.'.

  Attributes:
    words: the V word strings.
    transitions: [V+2, V+2] row-stochastic matrix P[from, to].
    classes: the class of each word when words of a class share one row of P
      (`make_grammar(classes=C)`); None for the random chain.
  """

  words: tuple[str, ...]
  transitions: np.ndarray
  classes: tuple[int, ...] | None = None

  @property
  def period(self) -> int:
    return len(self.words)

  @property
  def end(self) -> int:
    return len(self.words) + 1

  def stationary(self) -> np.ndarray:
    """[V+2] stationary distribution pi of the chain (pi P = pi, sum 1)."""
    n = len(self.transitions)
    system = self.transitions.T - np.eye(n)  # (P^T - I) pi = 0 ...
    system[-1] = 1.0  # ... with the last equation replaced by sum(pi) = 1
    rhs = np.zeros(n)
    rhs[-1] = 1.0
    return np.linalg.solve(system, rhs)

  def entropy_per_word(self) -> float:
    """Entropy rate in nats per word ('.' and END count as words): sum_s pi_s H(P[s])."""
    p = self.transitions
    row_entropy = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=1)
    return float(self.stationary() @ row_entropy)

  def unigram_entropy_per_word(self) -> float:
    """Entropy in nats of the stationary word distribution (the best context-free model)."""
    pi = self.stationary()
    pi = pi[pi > 0]
    return float(-np.sum(pi * np.log(pi)))

  def sample(self, rng: np.random.Generator, count: int) -> tuple[list[str], int]:
    """Draws `count` documents; returns them and their total number of words (incl. '.', END)."""
    rows = [np.flatnonzero(row) for row in self.transitions]
    cdfs = [np.cumsum(row[nz]).tolist() for row, nz in zip(self.transitions, rows)]
    rows = [nz.tolist() for nz in rows]
    uniforms, used = rng.random(4096).tolist(), 0
    documents, num_words, end = [], 0, self.end  # a local: the loop runs millions of times
    for _ in range(count):
      state, states = end, []
      while True:
        if used == len(uniforms):
          uniforms, used = rng.random(4096).tolist(), 0
        cdf = cdfs[state]
        k = min(bisect.bisect_right(cdf, uniforms[used]), len(cdf) - 1)
        used += 1
        state = rows[state][k]
        states.append(state)
        if state == end:
          break
      documents.append(self.render(states))
      num_words += len(states)
    return documents, num_words

  def render(self, states: list[int]) -> str:
    """Text of a state path; END is not written."""
    text, period, end, words = [], self.period, self.end, self.words
    for s in states:
      if s == period:
        text[-1] += '.'
      elif s != end:
        text.append(words[s])
    return ' '.join(text)

  def parse(self, document: str) -> list[int]:
    """Inverse of `render` for a whole document: its states, ending with END."""
    index = {w: i for i, w in enumerate(self.words)}
    states = []
    for token in document.split():
      word = token.rstrip('.')
      states.append(index[word])
      states += [self.period] * (len(token) - len(word))
    return states + [self.end]

  def without(self, transitions: list[tuple[int, int]]) -> Grammar:
    """The chain with the (from, to) `transitions` removed and each changed row renormalised."""
    p = self.transitions.copy()
    for a, b in transitions:
      p[a, b] = 0.0
    p /= p.sum(axis=1, keepdims=True)
    return Grammar(words=self.words, transitions=p, classes=self.classes)

  def log_prob(self, document: str) -> tuple[float, int]:
    """(log p(document) in nats, number of words incl. '.' and END), starting from END."""
    states = [self.end] + self.parse(document)
    probs = self.transitions[states[:-1], states[1:]]
    return float(np.sum(np.log(probs))), len(states) - 1


def _make_words(rng: np.random.Generator, count: int) -> list[str]:
  """`count` distinct pronounceable words of 1-3 consonant-vowel syllables."""
  words: dict[str, None] = {}
  while len(words) < count:
    syllables = rng.integers(1, 4)
    word = ''.join(
      rng.choice(list(_CONSONANTS)) + rng.choice(list(_VOWELS)) for _ in range(syllables)
    )
    words[word] = None
  return list(words)


def make_grammar(seed: int, num_words: int = 256, successors: int = 0, classes: int = 0) -> Grammar:
  """A sparse Markov chain over `num_words` word types, fixed by `seed`.

  With classes=0 each word has its own random row: 2-6 successors, or exactly `successors` when
  > 0 (more: text closer to random words). With classes=C > 0 the words fall into C classes of
  near-equal size, and every word of a class has the class's row: the same sentence-end
  probability and the same next words, num_words/C of them, each word following exactly one
  class. A transition a -> b is then predictable from any classmate a' of a that goes to b.
  """
  if not 2 * _START_WORDS <= num_words <= 5000:
    raise ValueError(f'grammar_words={num_words} is out of range; use {2 * _START_WORDS}..5000')
  if not 0 <= successors <= num_words:
    raise ValueError(
      f'grammar_successors={successors} is out of range; use 1..grammar_words={num_words}, or '
      '0 for 2-6 per word'
    )
  if not 0 <= classes <= num_words // 2:
    raise ValueError(
      f'grammar_classes={classes} is out of range; use 0 (a random chain) or '
      f'1..{num_words // 2} (grammar_words={num_words}, at least 2 words a class)'
    )
  if classes and successors:
    raise ValueError(
      f'grammar_successors={successors} and grammar_classes={classes} do not combine: a class '
      'is followed by grammar_words / grammar_classes words; set grammar_successors=0'
    )
  rng = np.random.default_rng(seed)
  words = _make_words(rng, num_words)
  n = num_words + 2
  period, end = num_words, num_words + 1
  p = np.zeros([n, n])
  of_word = None
  if classes:
    of_word = rng.permutation(num_words) % classes  # [V] the class of each word
    followers = np.array_split(rng.permutation(num_words), classes)  # next words of each class
    for c, after in enumerate(followers):
      sentence_end = rng.uniform(*_SENTENCE_END)
      row = np.zeros(n)
      row[after] = (1 - sentence_end) * rng.dirichlet(np.ones(len(after)))
      row[period] = sentence_end
      p[np.flatnonzero(of_word == c)] = row
  else:
    for w in range(num_words):
      count = successors or rng.integers(*_SUCCESSORS, endpoint=True)
      after = rng.choice(num_words, size=count, replace=False)
      sentence_end = rng.uniform(*_SENTENCE_END)
      p[w, after] = (1 - sentence_end) * rng.dirichlet(np.ones(len(after)))
      p[w, period] = sentence_end
  starts = rng.choice(num_words, size=_START_WORDS, replace=False)
  start_probs = rng.dirichlet(np.ones(_START_WORDS))
  p[end, starts] = start_probs  # a new document starts a sentence
  p[period, starts] = (1 - _DOCUMENT_END) * start_probs
  p[period, end] = _DOCUMENT_END
  of_word = None if of_word is None else tuple(int(c) for c in of_word)
  return Grammar(words=tuple(words), transitions=p, classes=of_word)


def from_config(cfg) -> Grammar:
  """The chain of a data config (a ConfigDict or `DataConfig`): its grammar_* knobs."""
  return make_grammar(
    int(cfg.grammar_seed),
    int(cfg.grammar_words),
    int(getattr(cfg, 'grammar_successors', 0)),
    int(getattr(cfg, 'grammar_classes', 0)),
  )


def word_transitions(grammar: Grammar) -> list[tuple[int, int]]:
  """Every (word, next word) transition of the chain with p > 0; '.' and END are not words."""
  words = grammar.transitions[: grammar.period, : grammar.period]
  return [(int(a), int(b)) for a, b in zip(*np.nonzero(words))]


def held_out_transitions(grammar: Grammar, share: float, seed: int) -> list[tuple[int, int]]:
  """`share` of the chain's word transitions, to keep out of training (sorted (from, to) pairs).

  They are drawn at random (fixed by `seed`) among the words with at least 2 next words, and no
  word loses all of them: every held-out transition is valid in the chain, and every word can
  still be followed by a word in training. In a chain with classes, a transition a -> b is also
  kept in training when every other classmate a' of a already lost a' -> b: each held-out one
  keeps a classmate that shows it (`check_classmates`). round(share * transitions) are held out.
  """
  if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share < 1:
    raise ValueError(f'data.grammar_holdout={share!r} must be a number in [0, 1)')
  edges = word_transitions(grammar)
  count = round(share * len(edges))
  if share and not count:
    raise ValueError(
      f'data.grammar_holdout={share} holds out none of the {len(edges)} word transitions; use '
      f'0 (off) or at least {0.5 / len(edges):.2g}'
    )
  left = np.bincount([a for a, _ in edges], minlength=grammar.period)  # next words per word
  room = int(np.sum(np.maximum(left - 1, 0)))
  if count > room:
    raise ValueError(
      f'data.grammar_holdout={share} asks for {count} of the {len(edges)} word transitions, but '
      f'only {room} can go while every word keeps a next word; use at most '
      f'{room / len(edges):.3f}'
    )
  classes = grammar.classes
  shown = collections.Counter((classes[a], b) for a, b in edges) if classes else None
  rng = np.random.default_rng([seed, 5])
  chosen = []
  for i in rng.permutation(len(edges)):
    if len(chosen) == count:
      break
    a, b = edges[i]
    if left[a] > 1 and (shown is None or shown[classes[a], b] > 1):  # never the last one
      left[a] -= 1
      if shown is not None:
        shown[classes[a], b] -= 1
      chosen.append((a, b))
  if len(chosen) < count:  # only a chain with classes can run short
    raise ValueError(
      f'data.grammar_holdout={share} asks for {count} of the {len(edges)} word transitions, but '
      f'only {len(chosen)} can go while every word keeps a next word and every held-out '
      'transition keeps a classmate that shows it in training; use a smaller share or fewer '
      'classes'
    )
  return sorted(chosen)


def check_classmates(grammar: Grammar, held_out: list[tuple[int, int]]) -> None:
  """One ValueError naming a held-out transition a -> b whose class has no other word a' with
  a' -> b in training; nothing for a chain without classes."""
  if grammar.classes is None:
    return
  classes, held = np.asarray(grammar.classes), set(map(tuple, held_out))
  for a, b in sorted(held):
    mates = np.flatnonzero(classes == classes[a])
    if not any(m != a and grammar.transitions[m, b] > 0 and (m, b) not in held for m in mates):
      raise ValueError(
        f'held-out transition {grammar.words[a]!r} -> {grammar.words[b]!r} ({a} -> {b}) has no '
        f'classmate of {grammar.words[a]!r} that goes to {grammar.words[b]!r} in training: the '
        'model could not predict it from its class; hold out fewer transitions'
      )


def _repeat(examples: list[str], p: float, rng) -> tuple[list[str], float]:
  """Each example, with probability p, followed by a space and a verbatim copy of itself; and
  the share of words that are not copies."""
  out, words, copied = [], 0, 0
  for example, coin in zip(examples, rng.random(len(examples))):
    n = example.count(' ') + 1
    words += n
    if coin < p:
      example, words, copied = f'{example} {example}', words + n, copied + n
    out.append(example)
  return out, 1.0 - copied / max(words, 1)


def generate(cfg: ml_collections.ConfigDict) -> tuple[list[str], list[str], dict]:
  """Train documents, eval documents and info for the `grammar` task.

  With `cfg.grammar_join` = J > 1, each example is J consecutive documents joined by spaces (long
  rows for length extrapolation); the joins drop J - 1 END symbols, so the entropy floor in
  `info` is then a close approximation. With `cfg.grammar_repeat` = p > 0, each example is
  followed by a copy of itself with probability p (text with repeated spans); the floor then
  counts the copies' words as free, an approximation (where a copy starts is not known).

  With `cfg.grammar_holdout` = h > 0, a share h of the chain's word transitions
  (`held_out_transitions`) never occurs in training: the training documents come from the chain
  without them (the rest of each row renormalised), the eval documents from the full chain.
  With `cfg.grammar_classes` = C > 0 the chain has word classes (`make_grammar`), and each
  held-out transition keeps a classmate that shows it in training.

  Returns:
    (train, eval, info); info holds `entropy_per_word` and `unigram_entropy_per_word` in nats (of
    the full chain: the eval floor), and `train_words`, the number of words (incl. '.' and END)
    in the training documents. With a holdout, also `held_out_transitions`, the sorted [from,
    to] word indices held out, and `grammar_holdout`, their share of the word transitions.
  """
  grammar = from_config(cfg)
  join = int(cfg.grammar_join)
  if join < 1:
    raise ValueError(f'grammar_join={join} must be >= 1 (documents per example)')
  holdout = cfg.grammar_holdout
  held_out = held_out_transitions(grammar, holdout, int(cfg.grammar_seed)) if holdout else []
  check_classmates(grammar, held_out)
  train_chain = grammar.without(held_out) if held_out else grammar
  train, train_words = train_chain.sample(
    np.random.default_rng([cfg.grammar_seed, 1]), cfg.num_train_examples * join
  )
  evaluation, _ = grammar.sample(
    np.random.default_rng([cfg.grammar_seed, 2]), cfg.num_eval_examples * join
  )
  if join > 1:  # long examples: `join` documents in a row, separated by a space
    train = [' '.join(train[i : i + join]) for i in range(0, len(train), join)]
    evaluation = [' '.join(evaluation[i : i + join]) for i in range(0, len(evaluation), join)]
  repeat = cfg.grammar_repeat
  fresh = 1.0  # the share of words that are not copies
  if repeat:  # text with repeated spans: an example followed by itself, as induction heads use
    train, fresh = _repeat(train, repeat, np.random.default_rng([cfg.grammar_seed, 3]))
    evaluation, _ = _repeat(evaluation, repeat, np.random.default_rng([cfg.grammar_seed, 4]))
  info = {
    'entropy_per_word': grammar.entropy_per_word() * fresh,
    'unigram_entropy_per_word': grammar.unigram_entropy_per_word(),
    'train_words': train_words,
  }
  if held_out:
    info['held_out_transitions'] = [list(edge) for edge in held_out]
    info['grammar_holdout'] = len(held_out) / len(word_transitions(grammar))
  return train, evaluation, info
