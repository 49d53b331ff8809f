"""data.grammar_holdout: word transitions of the grammar chain kept out of training."""

import math
import re

import ml_collections
import numpy as np
import pytest

from configs import base
from transformer import data
from transformer.config.experiment import Config, DataConfig, section
from transformer.data import grammar


def _cfg(**overrides):
  cfg = data.default_config()
  cfg.task = 'grammar'
  cfg.num_train_examples, cfg.num_eval_examples = 3000, 300
  cfg.update(overrides)
  return cfg


def _transitions(documents, chain) -> set:
  """Every (state, next state) pair that occurs in the documents."""
  found = set()
  for document in documents:
    states = [chain.end] + chain.parse(document)
    found.update(zip(states[:-1], states[1:]))
  return found


def test_held_out_transitions_are_valid_unseen_in_training_and_seen_in_eval():
  cfg = _cfg(grammar_holdout=0.2)
  train, evaluation, info = grammar.generate(cfg)
  chain = grammar.make_grammar(cfg.grammar_seed, cfg.grammar_words)
  held = {tuple(edge) for edge in info['held_out_transitions']}
  assert held and all(a < chain.period and b < chain.period for a, b in held)  # words only
  assert all(chain.transitions[a, b] > 0 for a, b in held)  # valid in the full chain
  assert not held & _transitions(train, chain)  # never in training
  in_eval = held & _transitions(evaluation, chain)
  assert len(in_eval) > len(held) // 4  # 300 documents reach many of them
  # Held out, the rest of the training chain is still the full chain renormalised.
  assert info['entropy_per_word'] == pytest.approx(chain.entropy_per_word())


def test_share_is_honoured_and_no_word_loses_every_next_word():
  chain = grammar.make_grammar(3)
  edges = grammar.word_transitions(chain)
  for share in (0.05, 0.2, 0.5):
    held = grammar.held_out_transitions(chain, share, seed=3)
    assert len(held) == round(share * len(edges)) and len(set(held)) == len(held)
    assert held == sorted(held) and set(held) <= set(edges)
    kept = chain.without(held)
    np.testing.assert_allclose(kept.transitions.sum(1), 1.0)
    assert all(kept.transitions[a, b] == 0 for a, b in held)
    words = kept.transitions[: chain.period, : chain.period]
    assert (np.count_nonzero(words, axis=1) >= 1).all()  # every word keeps a next word
    assert np.array_equal(
      kept.transitions[:, chain.period] > 0, chain.transitions[:, chain.period] > 0
    )
  assert grammar.held_out_transitions(chain, 0.2, 3) == grammar.held_out_transitions(chain, 0.2, 3)
  assert grammar.held_out_transitions(chain, 0.2, 3) != grammar.held_out_transitions(chain, 0.2, 4)


def test_too_large_a_share_for_the_chain_is_one_error():
  two = grammar.make_grammar(0, num_words=64, successors=2)  # 128 transitions, 64 can go
  assert len(grammar.held_out_transitions(two, 0.5, 0)) == 64
  with pytest.raises(ValueError, match=r'grammar_holdout=0.6 asks for 77 .* use at most 0.500'):
    grammar.held_out_transitions(two, 0.6, 0)
  one = grammar.make_grammar(0, num_words=64, successors=1)
  with pytest.raises(ValueError, match='only 0 can go'):
    grammar.held_out_transitions(one, 0.2, 0)
  with pytest.raises(ValueError, match=r'holds out none of the 128 .* at least 0.0039'):
    grammar.held_out_transitions(two, 0.001, 0)


def test_off_by_default_and_deterministic():
  plain = grammar.generate(_cfg())
  assert 'held_out_transitions' not in plain[2]
  assert grammar.generate(_cfg(grammar_holdout=0.0)) == plain  # 0 changes nothing
  held = grammar.generate(_cfg(grammar_holdout=0.1))
  assert held == grammar.generate(_cfg(grammar_holdout=0.1))
  assert held[1] == plain[1]  # the eval documents come from the full chain
  assert held[2]['grammar_holdout'] == pytest.approx(0.1, abs=1e-3)


def test_the_held_out_list_reaches_a_built_task():
  cfg = _cfg(grammar_holdout=0.2, tokenizer='byte', num_train_examples=200, num_eval_examples=16)
  task = data.build(section(DataConfig, cfg), family='causal_lm', workdir=None, seed=0)
  assert task.info['held_out_transitions'] == grammar.generate(cfg)[2]['held_out_transitions']


def _with(**data_knobs):
  config = ml_collections.ConfigDict(base.get_config().to_dict(), type_safe=False)
  config.data.update(data_knobs)
  return config


@pytest.mark.parametrize('value', [1.0, -0.1, 1.5, float('nan'), '0.2'])
def test_a_share_outside_0_1_is_one_error_before_any_data_work(value):
  message = f'data.grammar_holdout={value!r} must be a number in [0, 1)'
  with pytest.raises(ValueError, match='^' + re.escape(message)):
    Config.from_configdict(_with(task='grammar', grammar_holdout=value))
  if isinstance(value, float) and not math.isnan(value):  # the generator refuses it too
    with pytest.raises(ValueError, match=re.escape(message)):
      grammar.generate(_cfg(grammar_holdout=value))


def test_a_holdout_on_another_task_is_one_error():
  Config.from_configdict(_with(task='grammar', grammar_holdout=0.2))
  Config.from_configdict(_with(task='numbers', grammar_holdout=0.0))
  with pytest.raises(
    ValueError, match=r"^data.grammar_holdout=0.2 .* data.task='numbers' has none"
  ):
    Config.from_configdict(_with(task='numbers', grammar_holdout=0.2))
