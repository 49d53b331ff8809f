"""A corpus's first use, timed: sparrow's preparation against nanoGPT's `prepare.py` approach.

nanoGPT's data/openwebtext/prepare.py encodes every document with GPT-2's pretrained tokenizer
(tiktoken's `encode_ordinary`, then `<|endoftext|>`) on one process per core and writes one
uint16 file. GPT-2's own files need the network, so the stand-in is a GPT-2-shaped tokenizer: a
byte-level BPE with GPT-2's pre-tokenizer and up to 50,257 ids, trained once on the corpus with
the `tokenizers` library; tiktoken encodes with it when it is installed (the same tokens).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import time

import numpy as np

GPT2_VOCAB = 50257
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT = '<|endoftext|>'
_TRAIN_DOCUMENTS = 30_000  # documents the GPT-2-shaped tokenizer is trained on (once)
_CHUNK_BYTES = 4 * 10**6  # text sent to a worker at a time


def english_like(plays: str, out: str, size_mb: int) -> None:
  """Writes `size_mb` MB of English-like documents, one a line, from Shakespeare's plays
  (`python -m experiments.shakespeare`): runs of 3-40 consecutive lines, two words of half the
  lines swapped and the words of 30% shuffled, so that no document repeats (seeded)."""
  with open(plays, encoding='utf-8') as f:
    lines = [line.strip() for line in f if line.strip()]
  rng, written = random.Random(0), 0
  with open(out + '.tmp', 'w', encoding='utf-8') as f:
    while written < size_mb * 10**6:
      start, document = rng.randrange(len(lines) - 40), []
      for line in lines[start : start + rng.randint(3, 40)]:
        words = line.split()
        if rng.random() < 0.5:
          i, j = rng.randrange(len(words)), rng.randrange(len(words))
          words[i], words[j] = words[j], words[i]
        if rng.random() < 0.3:
          rng.shuffle(words)
        document.append(' '.join(words))
      text = ' '.join(document) + '\n'
      f.write(text)
      written += len(text.encode('utf-8'))
  os.replace(out + '.tmp', out)


def gpt2_shaped(corpus: str, directory: str) -> str:
  """directory/tokenizer.json: the GPT-2-shaped tokenizer of `corpus`, trained on first use."""
  path = os.path.join(directory, 'tokenizer.json')
  if os.path.exists(path):
    return path
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=GPT2_VOCAB,
    special_tokens=[EOT],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  with open(corpus, encoding='utf-8') as f:
    tokenizer.train_from_iterator((line for _, line in zip(range(_TRAIN_DOCUMENTS), f)), trainer)
  os.makedirs(directory, exist_ok=True)
  tokenizer.save(path)
  with open(os.path.join(directory, 'tokenizer_config.json'), 'w') as f:
    json.dump({'eos_token': EOT}, f)  # sparrow separates documents with it
  return path


def _byte_of_symbol() -> dict[str, int]:
  """GPT-2's byte-level alphabet: the printable character that stands for each byte."""
  printable = [*range(ord('!'), ord('~') + 1), *range(ord('¡'), ord('¬') + 1)]
  printable += range(ord('®'), ord('ÿ') + 1)
  others = [b for b in range(256) if b not in printable]
  symbols = {chr(b): b for b in printable}
  symbols |= {chr(256 + i): b for i, b in enumerate(others)}
  return symbols


def encoder(path: str):
  """(name, encode: list[str] -> list[list[int]], eot id) of a GPT-2-shaped tokenizer.json."""
  with open(path, encoding='utf-8') as f:
    vocab = json.load(f)['model']['vocab']
  try:
    import tiktoken
  except ImportError:
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(path)
    encode = lambda texts: [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    return 'tokenizers', encode, vocab[EOT]
  symbols = _byte_of_symbol()
  ranks = {bytes(symbols[c] for c in token): i for token, i in vocab.items() if token != EOT}
  encoding = tiktoken.Encoding(
    'gpt2_shaped', pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={EOT: vocab[EOT]}
  )
  return 'tiktoken', lambda texts: [encoding.encode_ordinary(t) for t in texts], vocab[EOT]


_WORKER: dict = {}


def _init(path: str) -> None:
  _WORKER['encode'], _WORKER['eot'] = encoder(path)[1:]


def _encode_chunk(texts: list[str]) -> np.ndarray:
  """nanoGPT's `process`: each document's ids, then <|endoftext|>, as uint16."""
  ids = _WORKER['encode'](texts)
  eot = _WORKER['eot']
  return np.fromiter((t for doc in ids for t in (*doc, eot)), np.uint16)


def _chunks(corpus: str):
  with open(corpus, encoding='utf-8') as f:
    while lines := f.readlines(_CHUNK_BYTES):
      yield [line.rstrip('\n') for line in lines if line.strip()]


def nanogpt_prepare(corpus: str, tokenizer_json: str, out: str, workers: int) -> int:
  """Encodes `corpus` as nanoGPT's prepare.py does into `out` (one uint16 file); its tokens."""
  context = multiprocessing.get_context('spawn')
  tokens = 0
  with context.Pool(workers, _init, (tokenizer_json,)) as pool, open(out, 'wb') as f:
    for ids in pool.imap(_encode_chunk, _chunks(corpus)):
      f.write(ids.tobytes())
      tokens += len(ids)
  return tokens


def sparrow_prepare(cfg, out: str) -> tuple[dict, float]:
  """`prepare.prepare` on one process per core: (dataset.json, seconds training the tokenizer)."""
  from transformer.data import prepare

  stamps = []
  meta = prepare.prepare(cfg, out, workers=0, log=lambda line: stamps.append((time.time(), line)))
  trained = [
    t for t, line in stamps if line.startswith(('prepare: training', 'prepare: tokenizer'))
  ]
  return meta, (trained[-1] - trained[0]) if len(trained) > 1 else 0.0
