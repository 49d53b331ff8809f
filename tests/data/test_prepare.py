"""Token shards, corpus readers and prepare: checked against direct tokenisation and llm.c's own
layout written here by hand; bad inputs are one clear error."""

import gzip
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from transformer import data
from transformer.data import corpus, prepare, shards

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEPARATOR = data.EOS_ID  # what our tokenizers put before each document


def _docs(count: int, seed: int = 0) -> list[str]:
  rng = np.random.default_rng(seed)
  words = ['größe', 'alpha', 'beta', '数字', 'x', 'and', 'the']
  return [' '.join(rng.choice(words, int(rng.integers(1, 30)))) for _ in range(count)]


def llmc_shard(path, tokens, magic=20240520, version=1, count=None, dtype=np.uint16):
  """A shard as llm.c's write_datafile writes it: 256 int32s (magic, version, count), tokens."""
  header = np.zeros(256, np.int32)
  header[:3] = magic, version, len(tokens) if count is None else count
  with open(path, 'wb') as f:
    f.write(header.tobytes())
    f.write(np.asarray(tokens, dtype).tobytes())
  return str(path)


def _cfg(train, evaluation='', **overrides):
  cfg = data.default_config()
  cfg.update(dict(task='corpus', train_path=str(train), eval_path=str(evaluation)))
  cfg.update(dict(tokenizer='byte', prepare_chunk_mb=1))
  cfg.update(overrides)
  return cfg


def _expected(docs: list[str]) -> np.ndarray:
  """The reference stream: [separator] + byte ids of each document, in order."""
  tok = data.ByteTokenizer()
  return np.array([t for d in docs for t in [SEPARATOR, *tok.encode(d)]], np.int64)


def _stream(out: str, split: str) -> np.ndarray:
  meta = prepare.read_dataset(out)
  parts = [shards.open_shard(os.path.join(out, s['file'])) for s in meta['splits'][split]]
  return np.concatenate(parts).astype(np.int64)


# Shards -------------------------------------------------------------------------------------------
def test_llmc_shard_is_read_in_place(tmp_path):
  tokens = np.arange(1000, dtype=np.uint16) * 50
  path = llmc_shard(tmp_path / 'fineweb_train_000001.bin', tokens)
  mapped = shards.open_shard(path)
  assert isinstance(mapped, np.memmap) and mapped.dtype == np.uint16
  np.testing.assert_array_equal(mapped, tokens)


@pytest.mark.parametrize('vocab, dtype', [(2**16, np.uint16), (2**16 + 1, np.uint32)])
def test_writer_picks_the_dtype_and_llmc_reads_its_header(tmp_path, vocab, dtype):
  path = str(tmp_path / 's.bin')
  writer = shards.ShardWriter(path, vocab)
  writer.add(np.array([vocab - 1, 0, 7]), documents=2)
  assert not os.path.exists(path)  # only the temp file until close
  writer.close()
  header = np.fromfile(path, np.int32, count=256)
  assert header[2] == 3 and header[3] == 2  # tokens, documents
  assert shards.read_header(path) == (dtype, 3, 2)
  np.testing.assert_array_equal(shards.open_shard(path), [vocab - 1, 0, 7])


@pytest.mark.parametrize(
  'damage, message',
  [
    (dict(magic=1234), 'magic 1234 version 1; not a token shard'),
    (dict(version=2), 'magic 20240520 version 2; not a token shard'),
    (dict(count=101), 'promises 101 tokens'),
    (dict(count=-1), 'promises -1 tokens'),
  ],
)
def test_bad_llmc_headers_are_one_error(tmp_path, damage, message):
  path = llmc_shard(tmp_path / 'bad.bin', np.zeros(100), **damage)
  with pytest.raises(ValueError, match=message):
    shards.open_shard(path)


def test_truncated_shard_is_one_error(tmp_path):
  path = llmc_shard(tmp_path / 'cut.bin', np.zeros(100))
  os.truncate(path, 500)
  with pytest.raises(
    ValueError, match='shorter than the 1024-byte llm.c header; the shard is trunc'
  ):
    shards.open_shard(path)
  path = llmc_shard(tmp_path / 'cut2.bin', np.zeros(100))
  os.truncate(path, 1024 + 150)
  with pytest.raises(ValueError, match='truncated or corrupt'):
    shards.open_shard(path)


# Corpus readers -----------------------------------------------------------------------------------
def _write_all_formats(tmp_path, docs):
  import pyarrow as pa
  import pyarrow.parquet as pq
  import zstandard

  lines = ''.join(json.dumps({'text': d, 'id': i}) + '\n' for i, d in enumerate(docs))
  (tmp_path / 'c.txt').write_text(''.join(d + '\n' for d in docs), encoding='utf-8')
  (tmp_path / 'c.jsonl').write_text(lines, encoding='utf-8')
  with gzip.open(tmp_path / 'c.jsonl.gz', 'wt', encoding='utf-8') as f:
    f.write(lines)
  (tmp_path / 'c.jsonl.zst').write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
  pq.write_table(pa.table({'text': docs}), tmp_path / 'c.parquet', row_group_size=7)
  return ['c.txt', 'c.jsonl', 'c.jsonl.gz', 'c.jsonl.zst', 'c.parquet']


def test_every_input_format_gives_the_documents(tmp_path):
  docs = _docs(50)
  for name in _write_all_formats(tmp_path, docs):
    units = corpus.units([str(tmp_path / name)], chunk_bytes=300)  # many small pieces
    assert [d for u in units for d in corpus.documents(u)] == docs, name
  assert len(corpus.units([str(tmp_path / 'c.parquet')], 300)) == -(-len(docs) // 7)


def test_byte_ranges_cut_at_line_starts(tmp_path):
  docs = _docs(200, seed=1)
  path = tmp_path / 'c.txt'
  path.write_text(''.join(d + '\n' for d in docs), encoding='utf-8')
  for chunk in (1, 17, 64, 10**6):
    units = corpus.units([str(path)], chunk)
    assert [d for u in units for d in corpus.documents(u)] == docs, chunk


def test_sample_is_bounded_seeded_and_spans_the_corpus(tmp_path):
  docs = [f'doc{i:04d} ' + 'x' * 91 for i in range(2000)]  # 100 bytes a line, numbered
  path = tmp_path / 'c.txt'
  path.write_text(''.join(d + '\n' for d in docs))
  pieces = corpus.units([str(path)], 10_000)  # 20 pieces
  texts, nbytes = corpus.sample(pieces, 20_000, max_documents=10**6, cut=50)
  assert nbytes == sum(len(t) for t in texts) and 20_000 <= nbytes < 20_000 + 50 * len(pieces)
  assert all(t == docs[int(t.split()[0][3:])][:50] for t in texts)  # whole documents, cut
  numbers = [int(t.split()[0][3:]) for t in texts]
  assert len({n // 100 for n in numbers}) == len(pieces)  # some of every piece
  assert corpus.sample(pieces, 20_000, max_documents=10**6, cut=50) == (texts, nbytes)
  few, _ = corpus.sample(pieces, 20_000, max_documents=7, cut=50)
  assert len(few) == 7
  many = corpus.units([str(path)], 1000)  # 200 pieces: 64 of them drawn, by the seed
  drawn = lambda seed: {
    int(t.split()[0][3:]) // 10
    for t in corpus.sample(many, 6400, max_documents=10**6, cut=50, seed=seed)[0]
  }
  assert len(drawn(0)) == 64 and drawn(0) == drawn(0) != drawn(1)


@pytest.mark.parametrize(
  'line, message',
  [
    ('{"body": "no text"}', r"c.jsonl:2: no string 'text' field \(found \['body'\]\)"),
    ('{"text": 5}', "c.jsonl:2: no string 'text' field"),
    ('not json', r'c.jsonl:2: not a JSON object'),
  ],
)
def test_jsonl_line_without_text_is_one_error(tmp_path, line, message):
  (tmp_path / 'c.jsonl').write_text('{"text": "fine"}\n' + line + '\n')
  with pytest.raises(ValueError, match=message):
    prepare.prepare(_cfg(tmp_path / 'c.jsonl'), str(tmp_path / 'out'))
  assert not (tmp_path / 'out').exists()


# Prepare ------------------------------------------------------------------------------------------
def test_prepare_keeps_every_token_and_document(tmp_path):
  train, held = _docs(300), _docs(20, seed=5)
  (tmp_path / 'train.txt').write_text(''.join(d + '\n' for d in train), encoding='utf-8')
  (tmp_path / 'eval.txt').write_text(''.join(d + '\n\n' for d in held), encoding='utf-8')
  cfg = _cfg(tmp_path / 'train.txt', tmp_path / 'eval.txt', prepare_chunk_mb=1)
  meta = prepare.prepare(cfg, str(tmp_path / 'out'))
  np.testing.assert_array_equal(_stream(str(tmp_path / 'out'), 'train'), _expected(train))
  np.testing.assert_array_equal(_stream(str(tmp_path / 'out'), 'eval'), _expected(held))
  assert meta['documents'] == len(train) and meta['tokens'] == len(_expected(train))
  assert meta['vocab_size'] == data.ByteTokenizer.vocab_size and meta['separator'] == SEPARATOR


def test_prepare_holds_out_every_200th_document(tmp_path):
  docs = _docs(450)
  (tmp_path / 't.txt').write_text(''.join(d + '\n' for d in docs), encoding='utf-8')
  out = str(tmp_path / 'out')
  prepare.prepare(_cfg(tmp_path / 't.txt'), out)
  held = [d for i, d in enumerate(docs) if i % 200 == 199]
  kept = [d for i, d in enumerate(docs) if i % 200 != 199]
  np.testing.assert_array_equal(_stream(out, 'eval'), _expected(held))
  np.testing.assert_array_equal(_stream(out, 'train'), _expected(kept))


def test_two_workers_and_a_resume_give_the_same_shards(tmp_path):
  docs = _docs(3000, seed=2)
  for part in range(3):  # three files: three pieces for the workers
    lines = docs[part * 1000 : (part + 1) * 1000]
    (tmp_path / f't{part}.txt').write_text(''.join(d + '\n' for d in lines), encoding='utf-8')
  cfg = _cfg(tmp_path / 't*.txt', tokenizer='sentencepiece', vocab_size=40, spm_train_lines=500)
  one, two = str(tmp_path / 'one'), str(tmp_path / 'two')
  prepare.prepare(cfg, one, workers=1)
  prepare.prepare(cfg, two, workers=2)
  names = sorted(os.listdir(one))
  assert names == sorted(os.listdir(two)) and 'train_00002.bin' in names
  for name in names:
    if name.endswith('.bin'):
      assert (
        open(os.path.join(one, name), 'rb').read() == open(os.path.join(two, name), 'rb').read()
      )
  # The stream of a serial encode, one document at a time (every 200th of each piece held out).
  tokenizer = data.load_tokenizer(os.path.join(two, 'tokenizer'))
  kept = [d for part in range(3) for i, d in enumerate(docs[part * 1000 : (part + 1) * 1000])
          if i % 200 != 199]  # fmt: skip
  want = [t for d in kept for t in [SEPARATOR, *tokenizer.encode(d)]]
  np.testing.assert_array_equal(_stream(two, 'train'), want)
  # An interruption: dataset.json never written, one shard gone, one left half-written.
  before = _stream(one, 'train')
  os.remove(os.path.join(one, prepare.DATASET))
  os.remove(os.path.join(one, 'train_00000.bin'))
  open(os.path.join(one, 'train_00000.bin.tmp'), 'wb').write(b'half')
  prepare.prepare(cfg, one, workers=1)
  np.testing.assert_array_equal(_stream(one, 'train'), before)
  assert not [n for n in os.listdir(one) if n.endswith('.tmp')]


def test_prepare_with_another_plan_is_refused(tmp_path):
  (tmp_path / 't.txt').write_text(''.join(d + '\n' for d in _docs(400)), encoding='utf-8')
  out = str(tmp_path / 'out')
  prepare.prepare(_cfg(tmp_path / 't.txt'), out)
  os.remove(os.path.join(out, prepare.DATASET))  # cut short, then resumed with another knob
  with pytest.raises(ValueError, match='being prepared from other inputs or knobs'):
    prepare.prepare(_cfg(tmp_path / 't.txt', spm_train_lines=5), out)


def test_empty_corpus_is_one_error_and_leaves_nothing(tmp_path):
  (tmp_path / 'empty.txt').write_text('\n   \n\n')
  for tokenizer in ('byte', 'sentencepiece'):
    with pytest.raises(ValueError, match='has no documents'):
      prepare.prepare(_cfg(tmp_path / 'empty.txt', tokenizer=tokenizer), str(tmp_path / 'out'))
    assert not (tmp_path / 'out').exists()


def test_an_existing_tokenizer_is_used(tmp_path):
  docs = _docs(400)
  (tmp_path / 't.txt').write_text(''.join(d + '\n' for d in docs), encoding='utf-8')
  sp = data.train_sentencepiece(docs, 40)
  sp.save(str(tmp_path / 'tok'))
  out = str(tmp_path / 'out')
  prepare.prepare(_cfg(tmp_path / 't.txt', tokenizer_path=str(tmp_path / 'tok' / 'spm.model')), out)
  kept = [d for i, d in enumerate(docs) if i % 200 != 199]
  want = [t for d in kept for t in [SEPARATOR, *sp.encode(d)]]
  np.testing.assert_array_equal(_stream(out, 'train'), want)


def test_hf_tokenizer_json_separates_with_endoftext(tmp_path):
  tokenizers = pytest.importorskip('tokenizers')
  docs = _docs(400)
  (tmp_path / 't.txt').write_text(''.join(d + '\n' for d in docs), encoding='utf-8')
  bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
  bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=['<|endoftext|>'])
  bpe.train_from_iterator(docs, trainer)
  os.makedirs(tmp_path / 'gpt')
  bpe.save(str(tmp_path / 'gpt' / 'tokenizer.json'))
  out = str(tmp_path / 'out')
  cfg = _cfg(
    tmp_path / 't.txt', tokenizer='hf', tokenizer_path=str(tmp_path / 'gpt/tokenizer.json')
  )
  meta = prepare.prepare(cfg, out)
  eot = bpe.token_to_id('<|endoftext|>')
  assert meta['separator'] == eot
  kept = [d for i, d in enumerate(docs) if i % 200 != 199]
  want = [t for d in kept for t in [eot, *bpe.encode(d).ids]]
  np.testing.assert_array_equal(_stream(out, 'train'), want)


def test_prepare_data_command(tmp_path):
  (tmp_path / 't.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n' for d in _docs(400)))
  command = [
    sys.executable,
    '-m',
    'experiments.prepare_data',
    '--config=configs/gpt_tiny.py',
    f'--config.data.train_path={tmp_path / "t.jsonl"}',
    '--config.data.tokenizer=byte',
    f'--out={tmp_path / "out"}',
    '--workers=2',
  ]
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  done = subprocess.run(command, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.startswith('prepare: starting')  # before JAX loads
  lines = done.stderr.splitlines()
  assert any(
    re.match(r'prepare: encoding, [\d.]+/[\d.]+ MB, [\d.]+ MB/s, ETA ', line) for line in lines
  )
  assert any('(1/1 pieces, 400 documents' in line for line in lines)
  assert prepare.is_prepared(str(tmp_path / 'out'))
  bad = command[:3] + ['--config.data.prepare_workers=-1', f'--out={tmp_path / "o2"}']
  done = subprocess.run(bad, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
    'error: data.prepare_workers=-1 must be an integer >= 0'
  )
