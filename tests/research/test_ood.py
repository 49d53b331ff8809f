"""research.ood: numbers longer than training's, and grammar transitions held out of training."""

import math
import os

import numpy as np
import pytest

import transformer
from research import ood, spec, verdicts
from research.sweeps import MeasureContext
from transformer import data
from transformer.data import grammar
from transformer.data import number_words as numbers
from transformer.training import checkpoint, provenance
from transformer.training.run import Run


def _workdir(path, config) -> str:
  """A workdir as training leaves it (config.json, tokenizer/, a checkpoint at step 0), untrained:
  the conftest's untrained_workdir with data knobs of its own."""
  run = Run(config, str(path))
  run.task.tokenizer.save(os.path.join(path, 'tokenizer'))
  provenance.write_run_metadata(str(path), run.config)
  ckpt = checkpoint.Checkpointer(str(path))
  ckpt.save(0, run.init_state(), {})
  ckpt.close()
  return str(path)


def _ctx(config, directory) -> MeasureContext:
  return MeasureContext(config, str(directory), str(directory), 'v', 0, 1, True)


# Numbers ----------------------------------------------------------------------------------------
def test_exact_match_against_a_count_by_hand():
  references = ['one hundred five', 'twelve', 'nine thousand', '40567', 'zero']
  hypotheses = ['one hundred five', ' twelve ', 'nine  thousand one', '40567', 'zer o']
  # By hand: equal, equal up to the ends' spaces, a word too many, equal, split word.
  assert ood.exact_match(hypotheses, references) == pytest.approx(3 / 5)
  assert ood.exact_match(['a b'], ['a  b']) == 1.0 and ood.exact_match([''], ['a']) == 0.0
  with pytest.raises(ValueError, match='2 hypotheses for 1 references'):
    ood.exact_match(['a', 'b'], ['a'])


def test_numbers_with_digits_have_exactly_that_many_and_are_held_out():
  for d in (1, 2, 3, 4, 7, 12):
    drawn = ood.numbers_with_digits(d, 50)
    assert len(drawn) == 50 and {len(str(n)) for n in drawn} == {d}
    if d >= 3:
      assert numbers.is_held_out(drawn).all()  # never a training number, whatever numbers_max
    assert np.array_equal(drawn, ood.numbers_with_digits(d, 50))  # fixed
  assert ood.number_pairs(5, 2, 'words_to_digits')[0] == tuple(
    reversed(ood.number_pairs(5, 2, 'digits_to_words')[0])
  )


@pytest.mark.parametrize('digits', [(0,), (4, 13), (True,), (2.0,), ()])
def test_a_digit_count_outside_1_12_is_one_error_before_any_model_work(
  tmp_path, tiny_config, digits
):
  ctx = _ctx(tiny_config('encoder_decoder'), tmp_path)  # no checkpoint there: no model to load
  with pytest.raises(ValueError, match=r'digits=.* 1\.\.12'):
    ood.numbers_by_digits(ctx, digits=digits)


def test_a_digit_count_the_tokenizer_cannot_spell_is_one_error_before_loading(
  tmp_path, tiny_config
):
  # SentencePiece trained on numbers up to 9999 knows every word up to 6 digits ('thousand'),
  # but not the 'm' of 'million'.
  config = tiny_config('encoder_decoder')
  config.data.numbers_max = 9999
  train, _, _ = numbers.generate(config.data)
  tokenizer = data.train_sentencepiece([x for pair in train for x in pair], 64)
  ood.check_spelling(
    tokenizer, {d: ood.number_pairs(d, 64, 'digits_to_words') for d in (4, 5, 6)}, 4
  )
  tokenizer.save(os.path.join(tmp_path, 'tokenizer'))  # the only file: loading would fail
  with pytest.raises(
    ValueError,
    match='digits=7: the sentencepiece tokenizer, trained on numbers of at most 4 digits',
  ):
    ood.numbers_by_digits(_ctx(config, tmp_path), digits=(4, 7))
  words = {7: ood.number_pairs(7, 4, 'words_to_digits')}
  with pytest.raises(ValueError, match='digits=7'):  # the other direction: an unknown source
    ood.check_spelling(tokenizer, words, 4)
  ood.check_spelling(data.ByteTokenizer(), words, 4)  # bytes spell anything


def test_numbers_by_digits_on_an_untrained_model(tmp_path_factory, tiny_config):
  directory = tmp_path_factory.mktemp('numbers')
  config = tiny_config('encoder_decoder')
  _workdir(directory, config)
  got = ood.numbers_by_digits(_ctx(config, directory), digits=(1, 3), examples=8)
  for d in (1, 3):
    assert 0.0 <= got[f'ood.exact@{d}'] <= 1.0 and 0.0 <= got[f'ood.token_acc@{d}'] <= 1.0
    assert 0.0 < got[f'ood.nll@{d}'] < 20.0
  assert got['ood.train_digits'] == 6.0  # the tiny config's numbers_max, 999_999
  assert got['figures'] == ['ood_samples.md'] and os.path.exists(directory / 'ood_samples.md')
  # The teacher-forced nll, recomputed with the inference API's score.
  model = transformer.load(str(directory))
  sources, references = zip(*ood.number_pairs(3, 8, 'digits_to_words'))
  scored = model.score(list(references), sources=list(sources))
  log_probs = np.concatenate([s['log_probs'] for s in scored])
  assert got['ood.nll@3'] == pytest.approx(-log_probs.mean(), rel=1e-4)
  with pytest.raises(ValueError, match="needs a causal_lm .* family='encoder_decoder'"):
    ood.grammar_held_out(_ctx(config, directory))  # and the grammar measure refuses it


# Grammar ----------------------------------------------------------------------------------------
def test_token_owners_give_spaces_to_the_next_word_and_flag_shared_tokens():
  chain = grammar.make_grammar(0)
  a, b, c = chain.words[:3]
  text = f'{a} {b}. {c}'
  tok = data.ByteTokenizer()
  spans = [(i, i + 1) for i in range(len(text))]  # one byte per token
  states, owners, mixed = ood.token_owners(chain, text, spans)
  assert states == [0, 1, chain.period, 2] and not mixed
  expected = [0] * len(a) + [1] * (1 + len(b)) + [2] + [3] * (1 + len(c))
  assert owners == expected and len(tok.encode(text)) == len(owners)
  # One token for the end of b and its '.': both states are flagged, the token owns neither.
  joined = [(0, len(a)), (len(a), len(a) + 1 + len(b) + 1), (len(a) + len(b) + 2, len(text))]
  states, owners, mixed = ood.token_owners(chain, text, joined)
  assert owners == [0, -1, 3] and mixed == {1, 2}


def _grammar_config(tiny_config, classes=0):
  config = tiny_config('causal_lm')
  config.data.update(grammar_holdout=0.2, max_length=128, num_eval_examples=32)
  config.data.grammar_classes = classes
  return config


@pytest.mark.parametrize('classes', [0, 16])
def test_grammar_held_out_on_an_untrained_model_matches_a_recount(
  tmp_path_factory, tiny_config, classes
):
  directory = tmp_path_factory.mktemp('grammar')
  config = _grammar_config(tiny_config, classes)
  _workdir(directory, config)
  got = ood.grammar_held_out(_ctx(config, directory), examples=32)
  assert got['ood.holdout'] == pytest.approx(0.2, abs=1e-3)
  assert got['ood.transitions_seen'] > got['ood.transitions_held_out'] > 10
  for kind in ('seen', 'held_out'):
    assert 0 < got[f'ood.loss_{kind}'] < 20 and got[f'ood.chain_nll_{kind}'] > 0
    assert 0 <= got[f'ood.{kind}_prob'] <= 1 and 0 < got[f'ood.chain_{kind}_prob'] <= 1
    assert got[f'ood.excess_{kind}'] == pytest.approx(
      got[f'ood.loss_{kind}'] - got[f'ood.chain_nll_{kind}']
    )
  # A recount with bytes: the tokens of a word after a word are the space before it and its
  # letters; their log-probabilities come from the inference API's score.
  chain = grammar.make_grammar(config.data.grammar_seed, config.data.grammar_words, 0, classes)
  assert (chain.classes is None) == (classes == 0)
  values, vectors = np.linalg.eig(chain.transitions.T)  # stationary: eigenvalue 1 of P^T
  pi = np.real(vectors[:, np.argmin(np.abs(values - 1))])
  pi /= pi.sum()
  _, evaluation, info = grammar.generate(config.data)
  held = {tuple(e) for e in info['held_out_transitions']}
  model = transformer.load(str(directory))
  # tokens, nll, chain nll, unigram nll, transitions, unigram p
  sums = {'seen': [0, 0.0, 0.0, 0.0, 0, 0.0], 'held_out': [0, 0.0, 0.0, 0.0, 0, 0.0]}
  # A document past 127 bytes (bos + 127 + eos = max_length) is cut, and its last word dropped;
  # a causal model scores the rest as it would in the whole row.
  kept = [d if len(d) <= 127 else d[: d[:127].rfind(' ')] for d in evaluation[:32]]
  assert kept != evaluation[:32] or classes  # some are cut (the class chain: maybe none)
  for document, scored in zip(kept, model.score(kept)):
    log_probs, at, previous = scored['log_probs'], 0, chain.end
    for piece in document.split(' '):
      word = piece.rstrip('.')
      state = chain.words.index(word)
      if previous < chain.period:  # a word after a word
        kind = 'held_out' if (previous, state) in held else 'seen'
        sums[kind][0] += len(word) + 1
        sums[kind][1] -= sum(log_probs[at - 1 : at + len(word)])
        sums[kind][2] -= math.log(chain.transitions[previous, state])
        sums[kind][3] -= math.log(pi[state])
        sums[kind][4] += 1
        sums[kind][5] += pi[state]
      previous = chain.period if piece != word else state
      at += len(piece) + 1
  for kind, (tokens, nll, chain_nll, unigram_nll, count, unigram_p) in sums.items():
    assert got[f'ood.loss_{kind}'] == pytest.approx(nll / tokens, rel=1e-4)
    assert got[f'ood.chain_nll_{kind}'] == pytest.approx(chain_nll / tokens, rel=1e-9)
    assert got[f'ood.unigram_nll_{kind}'] == pytest.approx(unigram_nll / tokens, rel=1e-6)
    assert got[f'ood.unigram_{kind}_prob'] == pytest.approx(unigram_p / count, rel=1e-6)


def test_grammar_held_out_refuses_a_run_without_a_holdout(tmp_path, tiny_config):
  config = _grammar_config(tiny_config)
  config.data.grammar_holdout = 0.0
  with pytest.raises(ValueError, match='needs data.grammar_holdout > 0'):
    ood.grammar_held_out(_ctx(config, tmp_path))
  with pytest.raises(ValueError, match='examples=0 must be a positive integer'):
    ood.grammar_held_out(_ctx(config, tmp_path), examples=0)


# The sweep's positive controls ------------------------------------------------------------------
def test_the_control_rules_can_hold_and_fail_on_every_null():
  sweep = spec.load_sweep('configs/sweeps/ood_generalization.py')
  # Arms that generalise as the controls ask, at three seeds: rope_skip5 spells 5 digits, and the
  # class grammar gives held-out words 80% of the chain's probability, near its loss.
  arms = {
    'rope': {'ood.exact@4': 1.0, 'ood.exact@5': 0.0, 'ood.exact@6': 0.0},
    'rope_skip5': {'ood.exact@4': 1.0, 'ood.exact@5': 0.9, 'ood.exact@6': 1.0},
    'grammar_classes': {
      'ood.excess_seen': 0.1, 'ood.loss_seen': 2.7, 'ood.loss_held_out': 2.9,
      'ood.chain_nll_held_out': 2.6, 'ood.unigram_nll_held_out': 5.5,
      'ood.held_out_prob': 0.076, 'ood.chain_held_out_prob': 0.095,
      'ood.unigram_held_out_prob': 0.0055,
    },
  }  # fmt: skip
  table = {v: {m: [x * 0.99, x, x * 1.01] for m, x in row.items()} for v, row in arms.items()}
  controls = [r for r in sweep.rules if r['text'].startswith(('rope_skip5', 'grammar_classes'))]
  assert len(controls) == 5
  pre, found = verdicts.judge(controls, table, sweep.preconditions, sweep.nulls)
  for verdict in found:
    assert verdict.status == verdicts.REPRODUCED, verdict.text
    assert ': fails' in verdict.null and ': holds' not in verdict.null, verdict.null
  by_text = {v.rule['text']: v.null for v in found}
  for text, null in by_text.items():  # the grammar rules fail on both the memoriser and unigram
    if text.startswith('grammar_classes'):
      assert null.count(': fails') == 2, null
  # An arm that gives held-out words less than their frequency (a memoriser's way) fails them.
  table['grammar_classes']['ood.held_out_prob'] = [0.006, 0.0061, 0.0062]
  table['grammar_classes']['ood.loss_held_out'] = [6.0, 6.1, 6.2]
  _, found = verdicts.judge(controls[2:], table, sweep.preconditions, sweep.nulls)
  assert all(v.status == verdicts.NOT_REPRODUCED for v in found), [
    (v.status, v.text) for v in found
  ]
