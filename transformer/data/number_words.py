"""The built-in `numbers` translation task: cardinal numbers in digits <-> English words.

Canonical spelling: lower case, single spaces, no 'and', no hyphens, scale words up to 'billion':
0 -> 'zero', 21 -> 'twenty one', 105 -> 'one hundred five',
1_234_000 -> 'one million two hundred thirty four thousand'.
"""

from __future__ import annotations

import ml_collections
import numpy as np

ONES = (
  'zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen '
  'sixteen seventeen eighteen nineteen'
).split()
TENS = 'zero ten twenty thirty forty fifty sixty seventy eighty ninety'.split()
SCALES = ((10**9, 'billion'), (10**6, 'million'), (10**3, 'thousand'))
LARGEST = 10**12 - 1  # 'nine hundred ninety nine billion ... nine'
DIRECTIONS = ('digits_to_words', 'words_to_digits')
_HELD_OUT_FROM = 100  # numbers below this are always training data: they are the vocabulary
_DATA_SEED = 1729  # the generated examples depend only on the task knobs, not on the run seed


def _below_thousand(n: int) -> list[str]:
  """Words of 1 <= n <= 999."""
  words = []
  if n >= 100:
    words += [ONES[n // 100], 'hundred']
    n %= 100
  if n >= 20:
    words.append(TENS[n // 10])
    n %= 10
  if n > 0:
    words.append(ONES[n])
  return words


def numbers_to_words(n: int) -> str:
  """English words for 0 <= n <= 999_999_999_999, in the canonical spelling."""
  if not 0 <= n <= LARGEST:
    raise ValueError(f'n={n} is out of range; numbers_to_words takes 0 <= n <= {LARGEST}')
  if n == 0:
    return 'zero'
  words = []
  for scale, name in SCALES:
    if n >= scale:
      words += _below_thousand(n // scale) + [name]
      n %= scale
  if n:
    words += _below_thousand(n)
  return ' '.join(words)


_VALUES = {w: i for i, w in enumerate(ONES)} | {w: 10 * i for i, w in enumerate(TENS) if i >= 2}
_SCALE_VALUES = {name: scale for scale, name in SCALES}


def words_to_numbers(text: str) -> int:
  """Inverse of `numbers_to_words`: 'two hundred five' -> 205."""
  total, current = 0, 0
  for word in text.split():
    if word in _VALUES:
      current += _VALUES[word]
    elif word == 'hundred':
      current *= 100
    elif word in _SCALE_VALUES:
      total += current * _SCALE_VALUES[word]
      current = 0
    else:
      raise ValueError(f'unknown number word {word!r} in {text!r}')
  return total + current


def is_held_out(n: np.ndarray) -> np.ndarray:
  """True for the ~10% of numbers >= 100 reserved for evaluation (a fixed multiplicative hash)."""
  n = np.asarray(n, np.uint64)
  hashed = (n * np.uint64(2654435761)) % np.uint64(2**32) >> np.uint64(13)
  return (n >= _HELD_OUT_FROM) & (hashed % np.uint64(10) == 0)


def sample_numbers(
  rng: np.random.Generator, count: int, max_value: int, held_out: bool, skip_digits: int = 0
) -> np.ndarray:
  """Draws `count` numbers: a digit count uniformly from 1..digits(max_value), then the number.

  Every magnitude is equally common. Only numbers with is_held_out(n) == held_out are kept.
  skip_digits=d > 0 leaves out the numbers of d digits: the digit count is drawn uniformly
  from the others.
  """
  max_digits = len(str(max_value))
  check_skip_digits(skip_digits, max_value)
  allowed = np.array([d for d in range(1, max_digits + 1) if d != skip_digits])
  out = np.zeros([0], np.int64)
  while len(out) < count:
    if skip_digits:
      digits = rng.choice(allowed, size=2 * count + 16)
    else:
      digits = rng.integers(1, max_digits + 1, size=2 * count + 16)
    low = np.where(digits == 1, 0, 10 ** (digits - 1))
    high = np.minimum(10**digits - 1, max_value)
    numbers = rng.integers(low, high + 1)
    out = np.concatenate([out, numbers[is_held_out(numbers) == held_out]])
  return out[:count]


def check_skip_digits(skip_digits: int, max_value: int) -> None:
  """One ValueError unless skip_digits is 0 (none) or a digit count below that of max_value (a
  gap inside the range the task draws from)."""
  max_digits = len(str(max_value))
  if isinstance(skip_digits, bool) or not isinstance(skip_digits, int | np.integer):
    raise ValueError(f'numbers_skip_digits={skip_digits!r} must be an integer')
  if not 0 <= skip_digits < max_digits:
    raise ValueError(
      f'numbers_skip_digits={skip_digits} is out of range; use 0 (none) or a digit count in '
      f'1..{max_digits - 1}, below the {max_digits} digits of numbers_max={max_value}'
    )


def generate(
  cfg: ml_collections.ConfigDict,
) -> tuple[list[tuple[str, str]], list[tuple[str, str]], dict]:
  """Train pairs, eval pairs and info for the `numbers` task.

  Args:
    cfg: the data ConfigDict (numbers_max, numbers_direction, numbers_skip_digits,
      num_train_examples, num_eval_examples).

  Returns:
    (train, eval, info) where train/eval are lists of (source, target) strings. The two splits
    never share a number: eval numbers are the held-out ones (>= 100, see `is_held_out`). With
    numbers_skip_digits=d > 0 neither split has a number of d digits.
  """
  max_value, direction = int(cfg.numbers_max), cfg.numbers_direction
  skip = int(getattr(cfg, 'numbers_skip_digits', 0))
  if not 1000 <= max_value <= LARGEST:
    raise ValueError(
      f'numbers_max={max_value} is out of range; use 1000 <= numbers_max <= {LARGEST} so '
      'that held-out evaluation numbers exist'
    )
  if direction not in DIRECTIONS:
    raise ValueError(f'numbers_direction={direction!r} is not one of {DIRECTIONS}')
  splits = []
  for split_id, count, held_out in (
    (0, cfg.num_train_examples, False),
    (1, cfg.num_eval_examples, True),
  ):
    rng = np.random.default_rng([_DATA_SEED, split_id])
    pairs = [
      (str(n), numbers_to_words(int(n)))
      for n in sample_numbers(rng, count, max_value, held_out, skip)
    ]
    if direction == 'words_to_digits':
      pairs = [(words, digits) for digits, words in pairs]
    splits.append(pairs)
  train, evaluation = splits
  words_side = 1 if direction == 'digits_to_words' else 0
  word_types = {w for pair in train for w in pair[words_side].split()}
  info = {'numbers_max': max_value, 'direction': direction, 'word_types': len(word_types)}
  if skip:
    info['numbers_skip_digits'] = skip
  return train, evaluation, info
