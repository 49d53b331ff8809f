"""Tests of the text/TSV file tasks (and their errors) and of TFDS tasks via mock_data."""

import logging
import os
import time
import tracemalloc

import numpy as np
import pytest

from transformer import data
from transformer.config.experiment import DataConfig, section
from transformer.data import batching, sources, tasks

EOS = 2
_LM = dict(family='causal_lm', workdir=None, seed=0)


def _cfg(**overrides):
  cfg = data.default_config()
  cfg.update(dict(batch_size=4, eval_batch_size=4, max_length=64, max_source_length=32))
  cfg.update(max_target_length=32, text_format='lines')  # a document per line: these tests
  cfg.update(overrides)
  return cfg


def _write(path, lines):
  path.write_text(''.join(line + '\n' for line in lines), encoding='utf-8')
  return str(path)


def test_text_task_with_eval_file(tmp_path):
  train = _write(tmp_path / 'train.txt', [f'größe {i} ünd text' for i in range(30)] + ['', '  '])
  evaluation = _write(tmp_path / 'eval.txt', ['one two three four', 'five six'])
  task = data.build(
    section(DataConfig, _cfg(task='text', train_path=train, eval_path=evaluation)),
    family='causal_lm',
    workdir=None,
    seed=0,
  )
  assert task.info['num_train_examples'] == 30  # blank lines are skipped
  assert task.eval_examples(5) == [('one two', 'three four'), ('five', 'six')]
  batch = next(task.train_iterator())
  texts = {task.tokenizer.decode(row) for row in batch['targets']}
  assert texts <= {f'größe {i} ünd text' for i in range(30)} and len(texts) == 4
  (eval_batch,) = task.eval_batches()
  assert task.tokenizer.decode(eval_batch['targets'][1]) == 'five six'
  assert eval_batch['weights'][2:].sum() == 0


def test_text_holds_out_the_last_lines_without_eval_path(tmp_path):
  lines = [f'line {i}' for i in range(100)]
  task = data.build(
    section(DataConfig, _cfg(task='text', train_path=_write(tmp_path / 't.txt', lines))),
    family='causal_lm',
    workdir=None,
    seed=0,
  )
  assert task.info['num_train_examples'] == 36 and task.info['num_eval_examples'] == 64
  held = [src + ' ' + ref for src, ref in task.eval_examples(100)]
  assert held == lines[36:]
  with pytest.raises(ValueError, match='too few to hold out'):
    data.build(
      section(DataConfig, _cfg(task='text', train_path=_write(tmp_path / 's.txt', lines[:64]))),
      family='causal_lm',
      workdir=None,
      seed=0,
    )


def test_tsv_task_and_truncation(tmp_path):
  pairs = [(f'source {i} ' + 'x' * (i % 40), f'target {i}') for i in range(80)]
  train = _write(tmp_path / 'train.tsv', [f'{s}\t{t}' for s, t in pairs])
  evaluation = _write(tmp_path / 'eval.tsv', ['a b\tc d'])
  task = data.build(
    section(DataConfig, _cfg(task='tsv', train_path=train, eval_path=evaluation)),
    family='encoder_decoder',
    workdir=None,
    seed=0,
  )
  too_long = sum(len(s.encode()) + 1 > 32 for s, _ in pairs)  # source + eos over 32 tokens
  assert task.info['truncated_train'] == too_long > 0
  assert task.eval_examples(3) == [('a b', 'c d')]
  tok = task.tokenizer
  by_target = dict((t, s) for s, t in pairs)
  for batch in [next(task.train_iterator()) for _ in range(3)]:
    for src, tgt in zip(batch['inputs'], batch['targets']):
      source = by_target[tok.decode(tgt)]
      assert tok.decode(src) == source.encode()[:31].decode()  # cut to 31 tokens + eos
      assert src[(src > 0).sum() - 1] == EOS


def test_file_errors_name_the_file_and_line(tmp_path):
  def build(path, task='text', family='causal_lm'):
    return data.build(
      section(DataConfig, _cfg(task=task, train_path=path)), family=family, workdir=None, seed=0
    )

  missing = str(tmp_path / 'missing.txt')
  with pytest.raises(FileNotFoundError, match='missing.txt'):
    build(missing)
  with pytest.raises(FileNotFoundError, match=r'nothing\*\.txt'):
    build(str(tmp_path / 'nothing*.txt'))
  empty = _write(tmp_path / 'empty.txt', ['', '   '])
  with pytest.raises(ValueError, match='empty.txt.*no usable lines'):
    build(empty)
  bad = tmp_path / 'bad.txt'
  bad.write_bytes(b'fine line\nalso fine\nbroken \xff\xfe line\n')
  with pytest.raises(ValueError, match=r'bad.txt:3: invalid UTF-8'):
    build(str(bad))
  columns = _write(tmp_path / 'cols.tsv', ['a\tb', 'c\td\te'])
  with pytest.raises(ValueError, match=r'cols.tsv:2: expected 2 .* found 3'):
    build(columns, task='tsv', family='encoder_decoder')
  one_column = _write(tmp_path / 'one.tsv', ['a\tb', 'b\tc', 'no tab here'])
  with pytest.raises(ValueError, match=r'one.tsv:3: expected 2 .* found 1'):
    build(one_column, task='tsv', family='encoder_decoder')
  with pytest.raises(ValueError, match='train_path is empty'):
    build('')


@pytest.fixture(scope='module')
def tfds_mock():
  tfds = pytest.importorskip('tensorflow_datasets')
  return tfds.testing.mock_data


def test_tfds_translation_with_mock_data(tfds_mock, tmp_path):
  cfg = _cfg(task='tfds', tfds_name='wmt14_translate/de-en', tfds_data_dir=str(tmp_path))
  with tfds_mock(num_examples=24):
    task = data.build(section(DataConfig, cfg), family='encoder_decoder', workdir=None, seed=0)
    again = data.build(section(DataConfig, cfg), family='encoder_decoder', workdir=None, seed=0)
  assert task.name == 'wmt14_translate/de-en'
  assert task.info['num_train_examples'] == 24 and task.info['num_eval_examples'] == 24
  pairs = task.eval_examples(3)
  assert len(pairs) == 3 and all(isinstance(s, str) and isinstance(t, str) for s, t in pairs)
  batch = next(task.train_iterator())
  np.testing.assert_array_equal(batch['targets'], next(again.train_iterator())['targets'])
  assert batch['inputs'].shape[0] == 4 and batch['decoder_inputs'].shape == batch['targets'].shape
  first = task.eval_batches()[0]
  src, tgt = pairs[0]
  assert task.tokenizer.decode(first['inputs'][0]) == src[:31]  # mock text is ASCII
  assert task.tokenizer.decode(first['targets'][0]) == tgt[:31]


def test_tfds_lm1b_with_mock_data_and_sentencepiece(tfds_mock, tmp_path):
  cfg = _cfg(
    task='tfds',
    tfds_name='lm1b',
    tfds_data_dir=str(tmp_path),
    tokenizer='sentencepiece',
    vocab_size=40,
  )
  with tfds_mock(num_examples=40):
    task = data.build(
      section(DataConfig, cfg), family='causal_lm', workdir=str(tmp_path / 'run'), seed=0
    )
  assert task.tokenizer.vocab_size <= 40
  cached = data.load_tokenizer(str(tmp_path / 'run' / 'tokenizer'))
  assert cached.vocab_size == task.tokenizer.vocab_size
  batch = next(task.train_iterator())
  assert set(batch) == {'inputs', 'targets', 'weights', 'segments', 'positions'}
  prompt, rest = task.eval_examples(1)[0]
  assert isinstance(prompt, str) and isinstance(rest, str)


def test_tfds_unknown_name(tfds_mock):
  cfg = _cfg(task='tfds', tfds_name='no_such_dataset_xyz')
  with pytest.raises(ValueError, match="tfds_name='no_such_dataset_xyz'"):
    data.build(section(DataConfig, cfg), family='causal_lm', workdir=None, seed=0)


def test_tfds_missing_feature(tfds_mock, tmp_path):
  cfg = _cfg(task='tfds', tfds_name='wmt14_translate/de-en', source_lang='fr')
  cfg.tfds_data_dir = str(tmp_path)
  with tfds_mock(num_examples=4), pytest.raises(ValueError, match=r"no feature\(s\) \['fr'\]"):
    data.build(section(DataConfig, cfg), family='encoder_decoder', workdir=None, seed=0)


# Hostile files: bad lines, huge lines, token ids outside the vocabulary -------------------------
def test_bad_lines_error_names_the_file_line_and_the_knob(tmp_path):
  bad = tmp_path / 'bad.txt'
  bad.write_bytes(b'fine\n\xc3\x28 broken\n')
  with pytest.raises(ValueError, match=r"bad.txt:2: invalid UTF-8 at byte 0.*bad_lines='skip'"):
    sources.read_lines(str(bad), 'train_path')
  with pytest.raises(ValueError, match="bad_lines='sometimes' is not valid"):
    sources.read_lines(str(bad), 'train_path', bad_lines='sometimes')
  with pytest.raises(ValueError, match="bad_lines='sometimes' is not valid"):
    data.build(
      section(DataConfig, _cfg(task='text', train_path=str(bad), bad_lines='sometimes')), **_LM
    )


def test_bad_lines_skip_leaves_them_out_and_counts_them_per_file(tmp_path, caplog):
  (tmp_path / 'a.tsv').write_bytes(b'a\tb\n\xff\xfe\tx\n\nc\td\none column\ne\t \nf\tg\n')
  (tmp_path / 'b.tsv').write_bytes(b'h\ti\n')
  with caplog.at_level(logging.WARNING):
    pairs = sources.read_lines(str(tmp_path / '*.tsv'), 'train_path', 2, bad_lines='skip')
  assert pairs == [('a', 'b'), ('c', 'd'), ('f', 'g'), ('h', 'i')]
  (message,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert 'a.tsv: skipped 3 bad line(s)' in message and 'first: line 2: invalid UTF-8' in message
  only_bad = tmp_path / 'only_bad.txt'
  only_bad.write_bytes(b'\xff\n\n\xfe\n')
  with pytest.raises(ValueError, match='only_bad.txt.*no usable lines'):
    sources.read_lines(str(only_bad), 'train_path', bad_lines='skip')


def test_over_long_lines_are_bad_lines_and_never_read_whole(tmp_path):
  path = tmp_path / 'long.tsv'
  path.write_bytes(b'a\tb\n' + b'x' * 5000 + b'\tz\nc\td\n' + b'y' * 3000)  # the last: no newline
  with pytest.raises(ValueError, match=r'long.tsv:2: line is longer than 1000 bytes'):
    sources.read_lines(str(path), 'train_path', 2, max_line_bytes=1000)
  pairs = sources.read_lines(str(path), 'train_path', 2, bad_lines='skip', max_line_bytes=1000)
  assert pairs == [('a', 'b'), ('c', 'd')]


def test_a_50_mb_line_is_cut_before_tokenizing(tmp_path):
  train = tmp_path / 'train.txt'
  with open(train, 'w') as f:
    f.write(''.join(f'line {i}\n' for i in range(40)))
    f.write('word ' * (10 * 2**20) + '\n')  # 50 MiB, one line
  evaluation = _write(tmp_path / 'eval.txt', ['a b c d', 'z ' * (2**20)])
  tracemalloc.start()
  try:
    start = time.perf_counter()
    task = data.build(
      section(DataConfig, _cfg(task='text', train_path=str(train), eval_path=evaluation)), **_LM
    )
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  # A 50 MiB line costs its bytes and its text, not a list of 50 M token ids (650 MiB).
  assert peak < 300 * 2**20, f'{peak / 2**20:.0f} MiB'
  assert seconds < 20
  assert task.info['num_train_examples'] == 41 and task.info['truncated_train'] == 1
  assert task.info['train_tokens_max'] <= tasks.max_chars((64, 32))
  assert max(len(s) + len(r) for s, r in task.eval_examples(2)) <= 2 * tasks.max_chars((64, 32))
  batches = [next(task.train_iterator()) for _ in range(3)]
  assert all(b['inputs'].shape == (4, 64) for b in batches)


class _BrokenTokenizer(data.ByteTokenizer):
  """Gives the letter z an id past the vocabulary, as an inconsistent tokenizer file would."""

  def encode(self, text):
    z = ord('z') + 5
    return [i + 1000 if i == z else i for i in super().encode(text)]


def test_out_of_range_token_ids_are_one_clear_error(tmp_path, monkeypatch):
  monkeypatch.setattr(tasks, 'ByteTokenizer', _BrokenTokenizer)
  lines = [f'line {i}' for i in range(70)]
  lines[5] = 'has a z here'
  train = _write(tmp_path / 'train.txt', lines)
  message = (
    r'the byte tokenizer gave token id 1127, outside its vocab_size=261 \(valid ids 0\.\.260\), '
    r"for data\.train_path='.*train\.txt' example 5 \('has a z here'\)"
  )
  with pytest.raises(ValueError, match=message):
    data.build(section(DataConfig, _cfg(task='text', train_path=train, eval_path=train)), **_LM)
  lines[5] = 'line 5' + ' pad' * 40 + ' z'  # past max_length: cut away, so harmless
  ok = _write(tmp_path / 'ok.txt', lines)
  data.build(
    section(DataConfig, _cfg(task='text', train_path=ok, eval_path=ok, max_length=16)), **_LM
  )


def test_batches_are_checked_for_token_ids_too():
  batch = {'inputs': np.array([[1, 5, 7], [1, 300, 0]]), 'targets': np.zeros((2, 3), np.int32)}
  with pytest.raises(ValueError, match=r'batch 3: inputs\[1, 1\] = 300 .*valid: 0\.\.260'):
    batching.check_token_ids(batch, 261, 'batch 3')
  batch['inputs'][1, 1] = -1
  with pytest.raises(ValueError, match=r'inputs\[1, 1\] = -1'):
    batching.check_token_ids(batch, 261, 'batch 3')
  batch['inputs'][1, 1] = 260
  batching.check_token_ids(batch, 261, 'batch 3')


# The workdir's tokenizer: written whole, never replaced ------------------------------------------
def _text_cfg(tmp_path, **overrides):
  train = _write(tmp_path / 'train.txt', [f'the line number {i}' for i in range(80)])
  return _cfg(task='text', train_path=train, eval_path=train, **overrides)


def test_the_tokenizer_is_written_whole(tmp_path, monkeypatch):
  workdir = tmp_path / 'run'
  (workdir / '.tokenizer.tmp-left-by-a-crash').mkdir(parents=True)

  def save_then_fail(self, directory):
    with open(os.path.join(directory, 'tokenizer.json'), 'w') as f:
      f.write('{"kind": "by')
    raise OSError(28, 'No space left on device')

  with monkeypatch.context() as patch:
    patch.setattr(data.ByteTokenizer, 'save', save_then_fail)
    with pytest.raises(OSError, match='No space left'):
      data.build(
        section(DataConfig, _text_cfg(tmp_path)), family='causal_lm', seed=0, workdir=str(workdir)
      )
  assert os.listdir(workdir) == []  # neither half a tokenizer nor temp directories
  data.build(
    section(DataConfig, _text_cfg(tmp_path)), family='causal_lm', seed=0, workdir=str(workdir)
  )
  assert os.listdir(workdir) == ['tokenizer']
  assert data.load_tokenizer(str(workdir / 'tokenizer')).kind == 'byte'


def test_a_tokenizer_is_never_replaced(tmp_path):
  cache = tmp_path / 'tokenizer'
  cache.mkdir()
  (cache / 'tokenizer.json').write_text('{"kind": "byte", "vocab_size": 261}')
  before = (cache / 'tokenizer.json').read_bytes()
  assert not tasks._save_whole(data.ByteTokenizer(), str(cache))  # e.g. a concurrent run's
  assert (cache / 'tokenizer.json').read_bytes() == before and os.listdir(tmp_path) == ['tokenizer']
  (cache / 'tokenizer.json').write_text('{"kind": "byt')
  with pytest.raises(ValueError, match=r"tokenizer' holds no readable tokenizer"):
    data.build(
      section(DataConfig, _text_cfg(tmp_path)), family='causal_lm', seed=0, workdir=str(tmp_path)
    )


def test_sentencepiece_is_not_retrained_under_existing_checkpoints(tmp_path):
  (tmp_path / 'run' / 'checkpoints' / '100').mkdir(parents=True)
  cfg = _text_cfg(tmp_path, tokenizer='sentencepiece', vocab_size=40)
  with pytest.raises(ValueError, match='has checkpoints but no tokenizer/'):
    data.build(section(DataConfig, cfg), family='causal_lm', seed=0, workdir=str(tmp_path / 'run'))
  assert sorted(os.listdir(tmp_path / 'run')) == ['checkpoints']
