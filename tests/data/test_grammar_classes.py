"""data.grammar_classes: a grammar chain whose word classes share one next-word row, so that a
held-out transition is predictable from the classmates that show it in training."""

import dataclasses
import hashlib
import re

import ml_collections
import numpy as np
import pytest

from configs import base
from transformer import data
from transformer.config.experiment import Config
from transformer.data import grammar


def _digest(value) -> str:
  return hashlib.sha256(value).hexdigest()[:16]


def test_the_random_chain_is_unchanged_without_classes():
  # Pinned digests of the chain, its holdout and its documents: the recorded runs of every sweep
  # on the grammar task were trained on exactly these. grammar_classes=0 must not move them.
  chain = grammar.make_grammar(0)
  assert chain.classes is None
  assert _digest(np.ascontiguousarray(chain.transitions).tobytes()) == '21c6a8e551ea96e0'
  held = grammar.held_out_transitions(chain, 0.2, 0)
  assert len(held) == 197 and _digest(repr(held).encode()) == 'db5484ce525ba363'
  cfg = data.default_config()
  cfg.update(task='grammar', grammar_holdout=0.2, num_train_examples=200, num_eval_examples=20)
  assert cfg.grammar_classes == 0
  train, evaluation, _ = grammar.generate(cfg)
  assert _digest(repr((train, evaluation)).encode()) == '6a85943afec8d5aa'
  explicit = grammar.make_grammar(0, classes=0)
  assert np.array_equal(explicit.transitions, chain.transitions)


def test_every_word_of_a_class_has_the_same_row_and_classes_differ():
  chain = grammar.make_grammar(0, num_words=256, classes=16)
  p, classes = chain.transitions, np.asarray(chain.classes)
  np.testing.assert_allclose(p.sum(axis=1), 1.0)
  assert sorted(np.bincount(classes).tolist()) == [16] * 16
  rows = {}
  for word, c in enumerate(classes):
    rows.setdefault(int(c), []).append(p[word])
  for c, members in rows.items():
    for row in members[1:]:
      assert np.array_equal(row, members[0]), c  # the whole row, '.' and END included
  firsts = [members[0] for members in rows.values()]
  assert all(not np.array_equal(a, b) for i, a in enumerate(firsts) for b in firsts[i + 1 :])
  # Every word follows exactly one class, 16 words after each.
  words = p[: chain.period, : chain.period] > 0
  followed_by = [{int(classes[a]) for a in np.flatnonzero(words[:, b])} for b in range(256)]
  assert all(len(s) == 1 for s in followed_by)
  assert (words.sum(axis=1) == 16).all()
  # The words, starts and boundaries are those of the same seed's random chain.
  plain = grammar.make_grammar(0)
  assert chain.words == plain.words


def test_holding_out_keeps_a_classmate_for_every_held_out_transition():
  cfg = data.default_config()
  cfg.update(task='grammar', grammar_classes=16, grammar_holdout=0.2)
  cfg.update(num_train_examples=3000, num_eval_examples=100)
  train, _, info = grammar.generate(cfg)
  chain = grammar.make_grammar(0, classes=16)
  held = {tuple(edge) for edge in info['held_out_transitions']}
  assert len(held) == round(0.2 * 256 * 16)
  classes = np.asarray(chain.classes)
  seen = set()  # (word, next word) pairs that occur in the training documents
  for document in train:
    states = chain.parse(document)
    seen.update(zip(states[:-1], states[1:]))
  assert not held & seen
  shown = 0
  for a, b in held:
    mates = [m for m in np.flatnonzero(classes == classes[a]) if m != a]
    kept = [m for m in mates if chain.transitions[m, b] > 0 and (m, b) not in held]
    assert kept, (a, b)
    shown += any((m, b) in seen for m in kept)
  assert shown >= 0.95 * len(held)  # and 3000 documents do show nearly all of them


def _without_classmate(chain, held) -> list:
  """The held-out (a, b) with no other word of a's class going to b in training (a recount)."""
  classes, held = np.asarray(chain.classes), set(held)
  return [
    (a, b)
    for a, b in held
    if not any(
      m != a and chain.transitions[m, b] > 0 and (m, b) not in held
      for m in np.flatnonzero(classes == classes[a])
    )
  ]


def test_small_classes_at_a_large_share_still_keep_a_classmate():
  # 3 words a class at a 60% holdout: a pick blind to the classes strands some transitions.
  chain = grammar.make_grammar(0, num_words=48, classes=16)
  held = grammar.held_out_transitions(chain, 0.6, 0)
  assert len(held) == round(0.6 * 144) and _without_classmate(chain, held) == []
  blind = grammar.held_out_transitions(dataclasses.replace(chain, classes=None), 0.6, 0)
  assert _without_classmate(chain, blind)  # the recount can fail


def test_a_held_out_transition_without_a_classmate_is_one_error():
  chain = grammar.make_grammar(0, num_words=64, classes=16)  # 4 words a class
  classes = np.asarray(chain.classes)
  mates = np.flatnonzero(classes == 0)
  b = int(np.flatnonzero(chain.transitions[mates[0], : chain.period])[0])
  grammar.check_classmates(chain, [(int(m), b) for m in mates[:-1]])  # one classmate keeps it
  with pytest.raises(ValueError, match=r"has no classmate of '\w+' that goes to '\w+'"):
    grammar.check_classmates(chain, [(int(m), b) for m in mates])
  grammar.check_classmates(grammar.make_grammar(0), [(0, 1)])  # no classes: nothing to check


def test_a_share_the_classes_cannot_keep_is_one_error():
  # 3 words a class, each followed by 3: at most 2 of each word's and of each (class, next
  # word)'s 3 may go, 96 of 144, but a random pick gets stuck before that.
  chain = grammar.make_grammar(0, num_words=48, classes=16)
  assert len(grammar.held_out_transitions(chain, 0.6, 0)) == round(0.6 * 144)
  with pytest.raises(ValueError, match=r'asks for 95 .* only 92 can go .* keeps a classmate'):
    grammar.held_out_transitions(chain, 0.66, 0)


def _with(**data_knobs):
  config = ml_collections.ConfigDict(base.get_config().to_dict(), type_safe=False)
  config.data.update(data_knobs)
  return config


def test_bad_class_counts_are_one_error():
  with pytest.raises(ValueError, match=re.escape('grammar_classes=129 is out of range')):
    grammar.make_grammar(0, num_words=256, classes=129)
  with pytest.raises(ValueError, match='do not combine'):
    grammar.make_grammar(0, successors=4, classes=8)
  with pytest.raises(ValueError, match=r'^data.grammar_classes=8 changes the grammar task'):
    Config.from_configdict(_with(task='numbers', grammar_classes=8))
  with pytest.raises(ValueError, match=r'^data.grammar_classes=-1'):
    Config.from_configdict(_with(task='grammar', grammar_classes=-1))
