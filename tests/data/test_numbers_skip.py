"""data.numbers_skip_digits: a digit count that no example of the numbers task has."""

import collections
import hashlib

import ml_collections
import numpy as np
import pytest

from configs import base
from transformer import data
from transformer.config.experiment import Config
from transformer.data import number_words as numbers


def _cfg(**overrides):
  cfg = data.default_config()
  cfg.update(numbers_max=999_999, num_train_examples=5000, num_eval_examples=500)
  cfg.update(overrides)
  return cfg


def _digits(pairs) -> collections.Counter:
  return collections.Counter(len(source) for source, _ in pairs)


def test_skipping_5_digits_removes_every_5_digit_number_and_keeps_the_rest():
  train, evaluation, info = numbers.generate(_cfg(numbers_skip_digits=5))
  assert info['numbers_skip_digits'] == 5
  # Evaluation numbers are held out, which only numbers of 3 digits or more can be.
  for split, kept in ((train, (1, 2, 3, 4, 6)), (evaluation, (3, 4, 6))):
    found = _digits(split)
    assert sorted(found) == list(kept)
    for d in kept:  # each kept digit count equally common
      assert abs(found[d] / len(split) - 1 / len(kept)) < 0.04, (d, found)
  # The words and numbers are still a correct, disjoint translation task.
  assert all(numbers.words_to_numbers(words) == int(digits) for digits, words in train)
  assert not {d for d, _ in train} & {d for d, _ in evaluation}
  assert numbers.is_held_out(np.array([int(d) for d, _ in evaluation])).all()
  # Every 5-digit spelling's parts occur: 'N thousand' with a two-digit N, inside 6-digit ones.
  words = ' '.join(w for _, w in train)
  assert ' seventy seven thousand ' in words and ' thirty thousand ' in words


def test_without_a_skip_the_numbers_are_unchanged():
  # Pinned digests: the recorded numbers runs were trained on exactly these.
  drawn = numbers.sample_numbers(np.random.default_rng(5), 1000, 999_999, False)
  assert hashlib.sha256(drawn.tobytes()).hexdigest()[:16] == '0957d20df360ecc8'
  cfg = _cfg(num_train_examples=500, num_eval_examples=50)
  assert cfg.numbers_skip_digits == 0
  pairs = numbers.generate(cfg)
  assert hashlib.sha256(repr(pairs[:2]).encode()).hexdigest()[:16] == 'ec0c6739ea8e59d2'
  assert 'numbers_skip_digits' not in pairs[2]
  assert sorted(_digits(pairs[0])) == [1, 2, 3, 4, 5, 6]


def _with(**data_knobs):
  config = ml_collections.ConfigDict(base.get_config().to_dict(), type_safe=False)
  config.data.update(data_knobs)
  return config


@pytest.mark.parametrize('skip', [6, 7, -1])
def test_a_skip_outside_the_range_is_one_error(skip):
  with pytest.raises(ValueError, match=f'numbers_skip_digits={skip} is out of range; use 0'):
    numbers.generate(_cfg(numbers_skip_digits=skip))


def test_a_skip_on_another_task_is_one_error():
  Config.from_configdict(_with(task='numbers', numbers_skip_digits=5))
  with pytest.raises(ValueError, match=r'^data.numbers_skip_digits=5 changes the numbers task'):
    Config.from_configdict(_with(task='grammar', numbers_skip_digits=5))
