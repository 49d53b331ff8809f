"""Tests of the built-in generated tasks: numbers (digits <-> words) and the Markov grammar."""

import numpy as np
import pytest

from transformer import data
from transformer.config.experiment import DataConfig, section
from transformer.data import grammar
from transformer.data import number_words as numbers

# An independent, recursive speller to check numbers_to_words against.
_SMALL = (
  'zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen '
  'fifteen sixteen seventeen eighteen nineteen'.split()
)
_TENS = {20: 'twenty', 30: 'thirty', 40: 'forty', 50: 'fifty', 60: 'sixty', 70: 'seventy'}
_TENS |= {80: 'eighty', 90: 'ninety'}


def _spell(n: int) -> str:
  if n < 20:
    return _SMALL[n]
  if n < 100:
    head = _TENS[n - n % 10]
    return head if n % 10 == 0 else f'{head} {_SMALL[n % 10]}'
  for size, name in ((10**9, 'billion'), (10**6, 'million'), (1000, 'thousand'), (100, 'hundred')):
    if n >= size:
      head = f'{_spell(n // size)} {name}'
      return head if n % size == 0 else f'{head} {_spell(n % size)}'
  raise AssertionError(n)


def _cfg(**overrides):
  cfg = data.default_config()
  cfg.num_train_examples, cfg.num_eval_examples = 3000, 300
  cfg.update(overrides)
  return cfg


@pytest.mark.parametrize(
  'n, words',
  [
    (0, 'zero'),
    (10, 'ten'),
    (11, 'eleven'),
    (20, 'twenty'),
    (21, 'twenty one'),
    (100, 'one hundred'),
    (101, 'one hundred one'),
    (1000, 'one thousand'),
    (1010, 'one thousand ten'),
    (1_000_000, 'one million'),
    (2_000_017, 'two million seventeen'),
  ],
)
def test_numbers_edge_cases(n, words):
  assert data.numbers_to_words(n) == words
  assert data.words_to_numbers(words) == n


def test_numbers_roundtrip_against_reference():
  rng = np.random.default_rng(0)
  digits = rng.integers(1, 13, size=3000)
  values = [int(rng.integers(10 ** (d - 1), 10**d)) for d in digits] + list(range(1200))
  for n in values:
    words = data.numbers_to_words(n)
    assert words == _spell(n)
    assert data.words_to_numbers(words) == n


def test_numbers_bad_inputs():
  with pytest.raises(ValueError, match='out of range'):
    data.numbers_to_words(10**12)
  with pytest.raises(ValueError, match='unknown number word'):
    data.words_to_numbers('one hundred and five')
  with pytest.raises(ValueError, match='numbers_max=500'):
    numbers.generate(_cfg(numbers_max=500))
  with pytest.raises(ValueError, match='numbers_direction'):
    numbers.generate(_cfg(numbers_direction='sideways'))


def test_numbers_splits_disjoint_and_cover_all_magnitudes():
  train, evaluation, info = numbers.generate(_cfg(numbers_max=999_999))
  train_numbers = {int(src) for src, _ in train}
  eval_numbers = {int(src) for src, _ in evaluation}
  assert not train_numbers & eval_numbers
  assert all(tgt == _spell(int(src)) for src, tgt in train + evaluation)
  assert min(eval_numbers) >= 100 and max(train_numbers | eval_numbers) <= 999_999
  # The digit count is uniform over 1..6: every magnitude has about 1/6 of the training set.
  counts = np.bincount([len(src) for src, _ in train], minlength=7)[1:]
  assert np.all(np.abs(counts / len(train) - 1 / 6) < 0.03), counts
  assert info['word_types'] == 30  # 0-19, 8 tens, hundred, thousand


def test_numbers_words_to_digits_direction_swaps_sides():
  forward, _, _ = numbers.generate(_cfg())
  backward, _, _ = numbers.generate(_cfg(numbers_direction='words_to_digits'))
  assert backward[:50] == [(tgt, src) for src, tgt in forward[:50]]


def test_grammar_is_a_markov_chain_with_a_stationary_distribution():
  g = grammar.make_grammar(seed=3)
  p = g.transitions
  np.testing.assert_allclose(p.sum(axis=1), 1.0, atol=1e-12)
  # Independent reference: power iteration from the document-start state.
  pi = np.zeros(len(p))
  pi[g.end] = 1.0
  for _ in range(3000):
    pi = 0.5 * pi + 0.5 * pi @ p  # lazy chain: same stationary distribution, no periodicity
  np.testing.assert_allclose(g.stationary(), pi, atol=1e-9)


def test_grammar_sampled_entropy_matches_entropy_rate():
  g = grammar.make_grammar(seed=0)
  documents, num_words = g.sample(np.random.default_rng(5), 3000)
  log_probs = [g.log_prob(d) for d in documents]
  assert sum(n for _, n in log_probs) == num_words
  empirical = -sum(lp for lp, _ in log_probs) / num_words  # nats per word under the true model
  rate = g.entropy_per_word()
  assert abs(empirical - rate) < 0.03 * rate, (empirical, rate)
  # Empirical unigram entropy of the sample agrees with the stationary one, and is far higher.
  states = np.concatenate([g.parse(d) for d in documents])
  freq = np.bincount(states, minlength=len(g.transitions)) / len(states)
  freq = freq[freq > 0]
  unigram = g.unigram_entropy_per_word()
  assert abs(-np.sum(freq * np.log(freq)) - unigram) < 0.03 * unigram
  assert unigram > rate + 2.0


def test_grammar_render_parse_roundtrip_and_determinism():
  g = grammar.make_grammar(seed=1, num_words=100)
  docs_a, _ = g.sample(np.random.default_rng(0), 50)
  docs_b, _ = grammar.make_grammar(seed=1, num_words=100).sample(np.random.default_rng(0), 50)
  assert docs_a == docs_b
  for doc in docs_a:
    states = g.parse(doc)
    assert states[-1] == g.end and g.end not in states[:-1]
    assert g.render(states) == doc
  assert grammar.make_grammar(seed=2).words != g.words
  with pytest.raises(ValueError, match='grammar_words=10'):
    grammar.make_grammar(seed=0, num_words=10)


def test_grammar_task_info_converts_entropy_to_tokens():
  task = data.build(
    section(DataConfig, _cfg(task='grammar')), family='causal_lm', workdir=None, seed=0
  )
  info = task.info
  assert info['unigram_entropy_per_word'] > info['entropy_per_word'] + 2.0
  # Independent count on the eval documents: bytes + eos per word (incl. '.' and END).
  g = grammar.make_grammar(0)
  docs = [src + ' ' + ref for src, ref in task.eval_examples(300)]
  words = sum(len(g.parse(d)) for d in docs)
  tokens = sum(len(d.encode()) + 1 for d in docs)
  assert abs(info['tokens_per_word'] - tokens / words) < 0.1 * tokens / words
  np.testing.assert_allclose(
    info['entropy_per_token'], info['entropy_per_word'] / info['tokens_per_word']
  )


def test_grammar_join_makes_long_examples_of_consecutive_documents():
  plain_train, plain_eval, _ = grammar.generate(_cfg(task='grammar'))
  joined_train, joined_eval, _ = grammar.generate(
    _cfg(task='grammar', num_train_examples=40, num_eval_examples=5, grammar_join=3)
  )
  assert len(joined_train) == 40 and len(joined_eval) == 5
  assert joined_train[0] == ' '.join(plain_train[:3])  # the same documents, three per example
  assert joined_eval[1] == ' '.join(plain_eval[3:6])
  with pytest.raises(ValueError, match='grammar_join=0 must be >= 1'):
    grammar.generate(_cfg(task='grammar', grammar_join=0))


def test_grammar_repeat_follows_examples_by_verbatim_copies():
  plain_train, _, plain_info = grammar.generate(_cfg(task='grammar'))
  train, evaluation, info = grammar.generate(_cfg(task='grammar', grammar_repeat=0.5))
  copied = [t == f'{p} {p}' for t, p in zip(train, plain_train)]
  assert all(c or t == p for c, t, p in zip(copied, train, plain_train))  # copy or untouched
  assert 0.4 < np.mean(copied) < 0.6  # about half, drawn per example
  words = lambda docs: sum(d.count(' ') + 1 for d in docs)
  fresh = words(plain_train) / words(train)
  assert info['entropy_per_word'] == pytest.approx(plain_info['entropy_per_word'] * fresh)
  everything, _, _ = grammar.generate(_cfg(task='grammar', grammar_repeat=1.0))
  assert everything == [f'{p} {p}' for p in plain_train]
  assert grammar.generate(_cfg(task='grammar', grammar_repeat=0.5))[1] == evaluation  # seeded


def test_grammar_successors_fixes_how_many_words_may_follow_each_word():
  default = grammar.make_grammar(0)
  assert grammar.make_grammar(0, successors=0).transitions.tolist() == default.transitions.tolist()
  words = len(default.words)
  for k in (1, 16, words):
    g = grammar.make_grammar(0, successors=k)
    follow = (g.transitions[:words, :words] > 0).sum(1)  # word -> word transitions
    assert (follow == k).all()
  rates = [grammar.make_grammar(0, successors=k).entropy_per_word() for k in (4, 32, 256)]
  assert rates[0] < rates[1] < rates[2]  # closer to random words
  with pytest.raises(ValueError, match='grammar_successors=300 is out of range'):
    grammar.make_grammar(0, successors=300)


def test_repeat_subset_draws_a_fraction_from_a_few_examples_seen_many_times():
  from transformer.data.tasks import repeat_subset

  train = [f'doc {i}' for i in range(1000)]
  out, info = repeat_subset(train, 0.3, 10)
  assert len(out) == 1000
  pool = set(train[-10:])
  drawn = [x for x in out if x in pool]
  assert len(drawn) == 300 and all(drawn.count(x) == 30 for x in pool)
  fresh = [x for x in out if x not in pool]
  assert len(set(fresh)) == len(fresh) == 700  # the rest are distinct, never repeated
  assert info == {'repeat_fraction': 0.3, 'repeat_epochs': 30.0}
  assert out != sorted(out, key=train.index)  # shuffled, not a block at the end
  assert repeat_subset(train, 0.3, 10) == (out, info)  # the same every time
  with pytest.raises(ValueError, match='repeat_subset=1000 must be at least 1 and fewer than'):
    repeat_subset(train, 0.3, 1000)


def test_repeated_data_reaches_a_built_task_and_streamed_tasks_refuse_it():
  cfg = section(DataConfig, _cfg(task='grammar', repeat_fraction=0.5, repeat_subset=20))
  task = data.build(cfg, family='causal_lm', workdir=None, seed=0)
  assert task.info['repeat_epochs'] == pytest.approx(0.5 * 3000 / 20)
  with pytest.raises(ValueError, match="repeat_fraction=0.5 repeats examples .* task='tfds'"):
    data.build(
      section(DataConfig, _cfg(task='tfds', repeat_fraction=0.5)),
      family='causal_lm',
      workdir=None,
      seed=0,
    )
