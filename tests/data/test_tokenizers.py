"""Tests of the byte and SentencePiece tokenizers: ids, round trips, saving and caching."""

import json
import os

import numpy as np
import pytest

from transformer import data
from transformer.config.experiment import DataConfig, section
from transformer.data import tasks, tokenizers


def test_special_ids_are_fixed():
  for tok in (data.ByteTokenizer(),):
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id, tok.unk_id) == (0, 1, 2, 3, 4)


def test_byte_roundtrip_including_non_ascii(tmp_path):
  tok = data.ByteTokenizer()
  text = 'Grüße, naïve café — 日本語 🙂 tab\tend'
  ids = tok.encode(text)
  assert ids == [b + 5 for b in text.encode('utf-8')]  # reference: raw UTF-8 bytes shifted by 5
  assert tok.vocab_size == 261 and min(ids) >= 5 and max(ids) < 261
  assert tok.decode(ids) == text
  # decode skips pad/bos, stops at eos, and replaces broken UTF-8.
  assert tok.decode([1] + ids + [2] + tok.encode('ignored') + [0]) == text
  assert tok.decode(tok.encode('é')[:1]) == '\ufffd'
  tok.save(str(tmp_path))
  assert isinstance(data.load_tokenizer(str(tmp_path)), data.ByteTokenizer)


def _corpus(n=400, seed=0):
  rng = np.random.default_rng(seed)
  words = 'the cat sat on a mat über straße dog ran far away 2024 and then slept'.split()
  return [' '.join(rng.choice(words, size=rng.integers(3, 12))) for _ in range(n)]


def test_sentencepiece_special_ids_and_roundtrip(tmp_path):
  tok = data.train_sentencepiece(_corpus(), vocab_size=60)
  assert tok.vocab_size <= 60
  pieces = [tok._sp.id_to_piece(i) for i in range(5)]
  assert pieces == ['<pad>', '<s>', '</s>', '<mask>', '<unk>']
  for line in _corpus(20, seed=1):
    ids = tok.encode(line)
    assert not set(ids) & {0, 1, 2, 3}
    assert tok.decode(ids) == line
    assert tok.decode([1, *ids, 2, 7, 8]) == line  # stops at eos
  assert 3 in tok.encode('a <mask> b')
  digit_pieces = [tok._sp.id_to_piece(i) for i in tok.encode('2024')]
  assert all(sum(c.isdigit() for c in piece) <= 1 for piece in digit_pieces)  # split_digits
  tok.save(str(tmp_path))
  meta = json.load(open(tmp_path / 'tokenizer.json'))
  assert meta['kind'] == 'sentencepiece' and os.path.exists(tmp_path / meta['model_file'])
  loaded = data.load_tokenizer(str(tmp_path))
  line = _corpus(1, seed=2)[0]
  assert loaded.encode(line) == tok.encode(line) and loaded.vocab_size == tok.vocab_size


def test_sentencepiece_is_cached_in_workdir_and_reused(tmp_path, monkeypatch):
  path = tmp_path / 'train.txt'
  path.write_text('\n'.join(_corpus(300)) + '\n')
  cfg = data.default_config()
  cfg.update(dict(task='text', train_path=str(path), tokenizer='sentencepiece', vocab_size=50))
  cfg.text_format = 'lines'
  workdir = str(tmp_path / 'run')
  first = data.build(section(DataConfig, cfg), family='causal_lm', workdir=workdir, seed=0)
  assert os.path.exists(os.path.join(workdir, 'tokenizer', 'spm.model'))

  def fail(*args, **kwargs):
    raise AssertionError('retrained although a cached tokenizer exists')

  monkeypatch.setattr(tasks, 'train_sentencepiece', fail)
  second = data.build(section(DataConfig, cfg), family='causal_lm', workdir=workdir, seed=0)
  assert second.tokenizer.model_proto == first.tokenizer.model_proto
  batch_a, batch_b = next(first.train_iterator()), next(second.train_iterator())
  np.testing.assert_array_equal(batch_a['inputs'], batch_b['inputs'])
  cfg.vocab_size = 80  # a different request must not silently reuse the old model
  with pytest.raises(ValueError, match='vocab_size=80'):
    data.build(section(DataConfig, cfg), family='causal_lm', workdir=workdir, seed=0)


def test_load_tokenizer_missing_directory(tmp_path):
  with pytest.raises(FileNotFoundError, match='no tokenizer'):
    data.load_tokenizer(str(tmp_path / 'nothing'))


def test_a_token_piece_names_the_specials_as_transformer_lens_shows_them(tmp_path):
  """`Model.to_str_tokens` shows a special token by its name, not as '' (what decode gives)."""
  import tokenizers as hf_tokenizers

  byte = tokenizers.ByteTokenizer()
  assert [byte.piece(i) for i in (tokenizers.BOS_ID, tokenizers.EOS_ID, 5 + ord('a'))] == [
    '<bos>',
    '<eos>',
    'a',
  ]
  assert byte.decode([tokenizers.BOS_ID]) == ''  # decoding text still drops it
  vocab = {'<|endoftext|>': 0, 'When': 1, 'Mary': 2}
  model = hf_tokenizers.models.WordLevel(vocab, unk_token='<|endoftext|>')
  tok = hf_tokenizers.Tokenizer(model)
  tok.pre_tokenizer = hf_tokenizers.pre_tokenizers.Whitespace()
  tok.add_special_tokens(['<|endoftext|>'])  # as GPT-2's tokenizer.json marks it
  (tmp_path / 'hf').mkdir()
  tok.save(str(tmp_path / 'hf' / 'tokenizer.json'))
  hf = tokenizers.HFTokenizer(str(tmp_path / 'hf'))
  assert hf.decode([0, 1]) == 'When' and [hf.piece(i) for i in (0, 2)] == ['<|endoftext|>', 'Mary']
