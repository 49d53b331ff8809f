"""Streaming from token shards: rows against slices of the token sequence computed here, every
token kept, packing against a per-token loop, exact resumes across process counts, and the
task='corpus' errors."""

import os
import tracemalloc

import numpy as np
import pytest
from test_prepare import llmc_shard

from transformer import data
from transformer.config.experiment import DataConfig, section
from transformer.data import sources, stream
from transformer.training import checkpoint

SEP = 9  # the document separator of these hand-made streams


def _token_file(tmp_path, tokens, name='s.bin'):
  return llmc_shard(tmp_path / name, np.asarray(tokens))


def _random_stream(tmp_path, sizes=(37, 1, 250, 64), seed=0, vocab=50):
  """Shards of documents [SEP, ids...] of random lengths; returns (TokenStream, all tokens)."""
  rng = np.random.default_rng(seed)
  paths, tokens = [], []
  for index, size in enumerate(sizes):
    part = rng.integers(SEP + 1, vocab, size)
    part[rng.random(size) < 0.1] = SEP  # documents start at the separator
    part[0] = SEP
    paths.append(_token_file(tmp_path, part, f'train_{index:05d}.bin'))
    tokens.append(part)
  return stream.TokenStream(paths), np.concatenate(tokens)


def _iterator(
  s, process=0, count=1, rows=4, length=16, family='causal_lm', pack=False, seed=0,
  sampling='sequential',
):  # fmt: skip
  layout = stream.Layout(
    family, length, SEP, pack, vocab_size=50, process=process, process_count=count, mlm_prob=0.3,
    special=(0, 1, 2, 3, 4, SEP),
  )  # fmt: skip
  return stream.StreamIterator(s, layout, rows, seed, sampling)


def test_read_wraps_around_the_shards(tmp_path):
  s, tokens = _random_stream(tmp_path)
  for start, count in [(0, 5), (30, 20), (36, 2), (37, 1), (340, 30), (1000, 700)]:
    want = [tokens[(start + i) % len(tokens)] for i in range(count)]
    np.testing.assert_array_equal(s.read(start, count), want)


def test_causal_rows_keep_every_token(tmp_path):
  s, tokens = _random_stream(tmp_path)
  it, length, n = _iterator(s, rows=3, length=16), 16, len(tokens)
  batches = [next(it) for _ in range(-(-n // (3 * length)) + 1)]  # a bit over one epoch
  targets = np.concatenate([b['targets'] for b in batches]).reshape(-1)
  inputs = np.concatenate([b['inputs'] for b in batches]).reshape(-1)
  np.testing.assert_array_equal(inputs, np.take(tokens, np.arange(len(inputs)), mode='wrap'))
  np.testing.assert_array_equal(targets, np.take(tokens, np.arange(len(targets)) + 1, mode='wrap'))
  assert all(b['weights'].min() == 1 for b in batches)  # nothing is padding
  counts = np.bincount(np.arange(n) % n)  # (a check of the check: each position once per epoch)
  assert counts.min() == counts.max() == 1


def _reference_segments(row):
  segments, positions, segment, position = [], [], 0, 0
  for column, token in enumerate(row):
    if column == 0 or token == SEP:
      segment, position = segment + 1, 0
    segments.append(segment)
    positions.append(position)
    position += 1
  return segments, positions


@pytest.mark.parametrize('family', ['causal_lm', 'bidirectional_lm'])
def test_packed_rows_give_each_document_a_segment(tmp_path, family):
  s, _ = _random_stream(tmp_path, seed=3)
  it = _iterator(s, rows=5, length=24, family=family, pack=True)
  for _ in range(4):
    batch = next(it)
    for row in range(5):
      tokens = batch['targets'][row] if family == 'bidirectional_lm' else batch['inputs'][row]
      segments, positions = _reference_segments(tokens)
      np.testing.assert_array_equal(batch['segments'][row], segments)
      np.testing.assert_array_equal(batch['positions'][row], positions)
  unpacked = next(_iterator(s, rows=5, length=24, family=family, pack=False))
  assert (unpacked['segments'] == 1).all()


@pytest.mark.parametrize('family', ['causal_lm', 'bidirectional_lm'])
def test_processes_read_their_own_rows_of_the_same_global_batch(tmp_path, family):
  s, _ = _random_stream(tmp_path, seed=1)
  whole = _iterator(s, rows=6, family=family, pack=True)
  parts = [_iterator(s, p, 3, rows=6, family=family, pack=True) for p in range(3)]
  for _ in range(5):
    batch, pieces = next(whole), [next(p) for p in parts]
    for key in batch:
      np.testing.assert_array_equal(np.concatenate([p[key] for p in pieces]), batch[key], key)


@pytest.mark.parametrize('sampling', ['sequential', 'random'])
@pytest.mark.parametrize('family', ['causal_lm', 'bidirectional_lm'])
@pytest.mark.parametrize('before, after', [(1, 1), (1, 2), (2, 1), (3, 2)])
def test_resume_sees_the_same_next_tokens_under_another_process_count(
  tmp_path, family, before, after, sampling
):
  s, _ = _random_stream(tmp_path, seed=2)
  make = lambda p=0, n=1: _iterator(s, p, n, rows=6, family=family, sampling=sampling, seed=3)
  uninterrupted = make()
  for _ in range(7):
    next(uninterrupted)
  want = [next(uninterrupted) for _ in range(3)]
  first = [make(p, before) for p in range(before)]
  for _ in range(7):
    for it in first:
      next(it)
  # Saved as the checkpoint gathers it (one entry per process), restored with `after` processes.
  saved = {'processes': [it.get_state() for it in first]}
  state = checkpoint._this_process_state(saved, 'test')
  assert state == first[0].get_state()
  resumed = [make(p, after) for p in range(after)]
  for it in resumed:
    it.set_state(state)
  for batch in want:
    pieces = [next(it) for it in resumed]
    for key in batch:
      np.testing.assert_array_equal(np.concatenate([p[key] for p in pieces]), batch[key], key)


def test_resume_on_other_shards_is_refused(tmp_path):
  s, _ = _random_stream(tmp_path)
  (tmp_path / 'other').mkdir()
  other, _ = _random_stream(tmp_path / 'other', sizes=(5,))
  with pytest.raises(ValueError, match='resume with the same corpus'):
    _iterator(other).set_state(_iterator(s).get_state())


def test_mlm_masks_only_real_tokens_and_not_the_separator(tmp_path):
  s, _ = _random_stream(tmp_path, seed=4)
  batch = next(_iterator(s, rows=8, length=32, family='bidirectional_lm', pack=True))
  masked = batch['weights'] > 0
  assert 0.15 < masked.mean() < 0.45  # mlm_prob=0.3
  assert not (masked & (batch['targets'] == SEP)).any()
  assert ((batch['inputs'] != batch['targets']) <= masked).all()


def test_eval_batches_cover_the_split_once_then_pad(tmp_path):
  s, tokens = _random_stream(tmp_path, sizes=(100, 31))
  layouts = [
    stream.Layout('causal_lm', 8, SEP, False, 50, process=p, process_count=2) for p in [0, 1]
  ]
  batches = [stream.eval_batches(s, layout, global_rows=4, num_batches=0) for layout in layouts]
  rows_fit = (len(tokens) - 9) // 8 + 1
  assert len(batches[0]) == len(batches[1]) == -(-rows_fit // 4)
  merged = [np.concatenate([a[k], b[k]]) for a, b in zip(*batches) for k in ['targets', 'weights']]
  targets = np.concatenate(merged[0::2]).reshape(-1)
  weights = np.concatenate(merged[1::2]).reshape(-1)
  assert weights.sum() == rows_fit * 8
  np.testing.assert_array_equal(targets[weights > 0], tokens[1 : rows_fit * 8 + 1])


def test_opening_a_huge_shard_reads_nothing(tmp_path):
  path = _token_file(tmp_path, np.full(10, SEP))
  count = 2**30  # 2 GB of (sparse) tokens
  header = np.fromfile(path, np.int32, count=256)
  header[2] = count
  with open(path, 'r+b') as f:
    f.write(header.tobytes())
  os.truncate(path, 1024 + 2 * count)
  tracemalloc.start()
  s = stream.TokenStream([path])
  batch = next(_iterator(s, rows=8, length=64))
  peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  assert len(s) == count and batch['inputs'].shape == (8, 64)
  assert peak < 2**20, f'{peak} bytes for one batch of a 2 GB shard'


# task='corpus' through data.build -----------------------------------------------------------------
def _llmc_cfg(tmp_path, **overrides):
  rng = np.random.default_rng(0)
  for split, n in (('train', 3), ('val', 1)):
    for i in range(n):
      tokens = rng.integers(0, 50257, 5000)
      tokens[::97] = 50256  # GPT-2's <|endoftext|> before each document
      llmc_shard(tmp_path / f'fineweb_{split}_{i:06d}.bin', tokens)
  cfg = data.default_config()
  cfg.update(dict(task='corpus', train_path=str(tmp_path / 'fineweb_train_*.bin')))
  cfg.update(dict(eval_path=str(tmp_path / 'fineweb_val_*.bin'), vocab_size=50257))
  cfg.update(dict(max_length=64, batch_size=4, eval_batch_size=4, pack=True, eval_batches=3))
  cfg.update(overrides)
  return cfg


def test_llmc_shards_build_a_task(tmp_path):
  task = data.build(
    section(DataConfig, _llmc_cfg(tmp_path)), family='causal_lm', workdir=None, seed=0
  )
  assert task.tokenizer.vocab_size == 50257 and task.info['train_tokens'] == 15000
  batch = next(task.train_iterator())
  assert batch['inputs'].shape == (4, 64) and batch['segments'].max() > 1  # 50256 separates
  assert len(task.eval_batches()) == 3 and task.eval_examples(4) == []


@pytest.mark.parametrize(
  'change, message',
  [
    (dict(vocab_size=32000), 'vocabulary mismatch: the shards hold token id'),
    (dict(eval_path=''), 'llm.c shards need data.eval_path'),
    (dict(train_path='/nowhere/*.bin'), "train_path='/nowhere/\\*.bin': no such file"),
  ],
)
def test_llmc_task_errors(tmp_path, change, message):
  with pytest.raises((ValueError, FileNotFoundError), match=message):
    data.build(
      section(DataConfig, _llmc_cfg(tmp_path, **change)), family='causal_lm', workdir=None, seed=0
    )


def test_llmc_bad_shard_is_one_error(tmp_path):
  cfg = _llmc_cfg(tmp_path)
  llmc_shard(tmp_path / 'fineweb_train_000009.bin', np.zeros(10), magic=20240521)
  with pytest.raises(ValueError, match='magic 20240521 version 1; not a token shard'):
    data.build(section(DataConfig, cfg), family='causal_lm', workdir=None, seed=0)


def test_corpus_is_prepared_on_first_use_into_the_workdir(tmp_path):
  docs = [f'document {i} ' + 'word ' * (i % 50) for i in range(600)]
  (tmp_path / 'c.txt').write_text(''.join(d + '\n' for d in docs))
  cfg = data.default_config()
  cfg.update(dict(task='corpus', train_path=str(tmp_path / 'c.txt'), max_length=32))
  cfg.update(dict(batch_size=4, eval_batch_size=4))
  workdir = str(tmp_path / 'run')
  task = data.build(section(DataConfig, cfg), family='causal_lm', workdir=workdir, seed=0)
  assert os.path.exists(os.path.join(workdir, 'corpus', 'dataset.json'))
  assert data.load_tokenizer(os.path.join(workdir, 'tokenizer')).kind == 'byte'
  assert task.info['num_train_documents'] == 600 - 3  # every 200th is held out
  prompt, rest = task.eval_examples(1)[0]
  assert f'{prompt} {rest}' == docs[199]
  with pytest.raises(ValueError, match='vocabulary mismatch'):  # workdir/tokenizer is another
    cfg.update(dict(prepared_dir=str(tmp_path / 'other'), tokenizer='sentencepiece'))
    cfg.update(dict(vocab_size=40))
    data.build(section(DataConfig, cfg), family='causal_lm', workdir=workdir, seed=0)
  with pytest.raises(ValueError, match="family='encoder_decoder' needs pairs"):
    data.build(section(DataConfig, cfg), family='encoder_decoder', workdir=workdir, seed=0)


def test_tfds_split_is_prepared_and_streamed(tmp_path):
  tfds = pytest.importorskip('tensorflow_datasets')
  cfg = data.default_config()
  cfg.update(dict(task='corpus', tfds_name='lm1b', tfds_data_dir=str(tmp_path / 'tfds')))
  cfg.update(dict(prepared_dir=str(tmp_path / 'out'), max_length=16, batch_size=2))
  cfg.update(dict(eval_batch_size=2))
  with tfds.testing.mock_data(num_examples=30):
    task = data.build(section(DataConfig, cfg), family='causal_lm', workdir=None, seed=0)
    texts = list(sources.tfds_examples('lm1b', 'train', str(tmp_path / 'tfds'), ('text',)))
  tok = data.ByteTokenizer()
  want = [t for text in texts if text.strip() for t in [data.EOS_ID, *tok.encode(text)]]
  assert task.info['train_tokens'] == len(want)
  np.testing.assert_array_equal(task.source.train.read(0, len(want)), want)


def test_mlm_task_masks_with_the_tokenizers_mask_id(tmp_path):
  docs = [f'word{i} ' * (1 + i % 30) for i in range(400)]
  (tmp_path / 'c.txt').write_text(''.join(d + '\n' for d in docs))
  cfg = data.default_config()
  cfg.update(dict(task='corpus', train_path=str(tmp_path / 'c.txt'), max_length=64, pack=True))
  cfg.update(dict(batch_size=8, eval_batch_size=8, prepared_dir=str(tmp_path / 'out')))
  task = data.build(section(DataConfig, cfg), family='bidirectional_lm', workdir=None, seed=0)
  batch = next(task.train_iterator())
  masked = batch['weights'] > 0
  assert 0.05 < masked.mean() < 0.3  # mlm_prob=0.15
  assert (batch['inputs'][masked] == data.MASK_ID).mean() > 0.6  # 80% become the mask token
  assert not (masked & (batch['targets'] == data.EOS_ID)).any()  # the separator is never masked
  assert ((batch['inputs'] != batch['targets']) <= masked).all()
