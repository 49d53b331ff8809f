"""Tests of the text/TSV file tasks (and their errors) and of TFDS tasks via mock_data."""

import numpy as np
import pytest

from transformer import data

EOS = 2


def _cfg(**overrides):
  cfg = data.default_config()
  cfg.update(dict(batch_size=4, eval_batch_size=4, max_length=64, max_source_length=32))
  cfg.update(max_target_length=32)
  cfg.update(overrides)
  return cfg


def _write(path, lines):
  path.write_text(''.join(line + '\n' for line in lines), encoding='utf-8')
  return str(path)


def test_text_task_with_eval_file(tmp_path):
  train = _write(tmp_path / 'train.txt', [f'größe {i} ünd text' for i in range(30)] + ['', '  '])
  evaluation = _write(tmp_path / 'eval.txt', ['one two three four', 'five six'])
  task = data.build(
    _cfg(task='text', train_path=train, eval_path=evaluation),
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
    _cfg(task='text', train_path=_write(tmp_path / 't.txt', lines)),
    family='causal_lm',
    workdir=None,
    seed=0,
  )
  assert task.info['num_train_examples'] == 36 and task.info['num_eval_examples'] == 64
  held = [src + ' ' + ref for src, ref in task.eval_examples(100)]
  assert held == lines[36:]
  with pytest.raises(ValueError, match='too few to hold out'):
    data.build(
      _cfg(task='text', train_path=_write(tmp_path / 's.txt', lines[:64])),
      family='causal_lm',
      workdir=None,
      seed=0,
    )


def test_tsv_task_and_truncation(tmp_path):
  pairs = [(f'source {i} ' + 'x' * (i % 40), f'target {i}') for i in range(80)]
  train = _write(tmp_path / 'train.tsv', [f'{s}\t{t}' for s, t in pairs])
  evaluation = _write(tmp_path / 'eval.tsv', ['a b\tc d'])
  task = data.build(
    _cfg(task='tsv', train_path=train, eval_path=evaluation),
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
    return data.build(_cfg(task=task, train_path=path), family=family, workdir=None, seed=0)

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
    task = data.build(cfg, family='encoder_decoder', workdir=None, seed=0)
    again = data.build(cfg, family='encoder_decoder', workdir=None, seed=0)
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
    task = data.build(cfg, family='causal_lm', workdir=str(tmp_path / 'run'), seed=0)
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
    data.build(cfg, family='causal_lm', workdir=None, seed=0)


def test_tfds_missing_feature(tfds_mock, tmp_path):
  cfg = _cfg(task='tfds', tfds_name='wmt14_translate/de-en', source_lang='fr')
  cfg.tfds_data_dir = str(tmp_path)
  with tfds_mock(num_examples=4), pytest.raises(ValueError, match=r"no feature\(s\) \['fr'\]"):
    data.build(cfg, family='encoder_decoder', workdir=None, seed=0)
