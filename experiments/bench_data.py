"""The data pipeline at scale: prepare throughput, start-up, memory, loader speed, tokens kept.

  python -m experiments.bench_data --dir=/tmp/bench_data --size_mb=200 [--repeat=10] [--chunk_mb=16]

Generates a corpus of --size_mb MB (10^6 bytes; made-up words with Zipf frequencies, a document
per line, lognormal lengths), trains one SentencePiece tokenizer on a sample, then measures:
prepare MB/s and tokens/s with 1 and 2 workers; `experiments.train` (gpt_tiny) from its start to
its first step on the prepared shards, and its peak RSS; the same on --repeat times the shards
(dataset.json lists each shard --repeat times); loader tokens/s on one core; and the share of
corpus tokens that reach the model in one epoch (token histograms of the targets vs the shards).

  python -m experiments.bench_data --part=first_use --dir=/tmp/bench_data --size_mb=200 [--rounds=3]

times a corpus's first use instead (`bench/first_use.py`), in alternating rounds: sparrow's
preparation with SentencePiece (512 pieces) trained on a sample, sparrow's with a pretrained
GPT-2-shaped tokenizer.json (`data.tokenizer_path`), and nanoGPT's prepare.py approach with that
tokenizer (tiktoken if installed) on one process per core; medians and ratios to nanoGPT's.
--corpus=FILE uses a text file of yours (a document per line) instead of the generated one, and
--plays=input.txt (`python -m experiments.shakespeare --out=input.txt`) English-like documents
made of the plays' lines (`bench/first_use.py:english_like`).
"""

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
from absl import flags

from experiments import cli

_DIR = flags.DEFINE_string('dir', '/tmp/bench_data', 'Where the corpus and shards are written.')
_SIZE = flags.DEFINE_integer('size_mb', 200, 'Corpus size in MB.')
_REPEAT = flags.DEFINE_integer('repeat', 10, 'Start-up and RSS also on the shards this many times.')
_CHUNK = flags.DEFINE_integer('chunk_mb', 16, 'MB of text per shard (data.prepare_chunk_mb).')
_PART = flags.DEFINE_enum('part', 'scale', ['scale', 'first_use'], 'What to measure (see above).')
_CORPUS = flags.DEFINE_string('corpus', '', 'A text file to use instead of the generated corpus.')
_PLAYS = flags.DEFINE_string(
  'plays', '', "Shakespeare's plays (experiments.shakespeare): the corpus is made of their lines."
)
_ROUNDS = flags.DEFINE_integer('rounds', 3, 'first_use: rounds of each approach, alternating.')
_VOCAB = 8000  # SentencePiece vocabulary of the benchmark's tokenizer
_SAMPLE = 20_000  # documents it is trained on
_STARTS = 2  # start-up measurements of each size
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _corpus(path: str, size_mb: int) -> None:
  """Writes `size_mb` MB of documents, one per line, deterministically."""
  if os.path.exists(path) and os.path.getsize(path) >= size_mb * 10**6:
    return
  rng = np.random.default_rng(0)
  letters = np.array(list('etaoinshrdlucmfwypvbgkjqxz'))
  words = [''.join(rng.choice(letters, int(rng.integers(1, 10)))) for _ in range(20_000)]
  words = np.array(words)
  p = 1.0 / np.arange(1, len(words) + 1)
  p /= p.sum()
  with open(path + '.tmp', 'w') as f:
    written = 0
    while written < size_mb * 10**6:
      lengths = np.maximum(1, rng.lognormal(5.0, 0.8, 1000).astype(int))  # words per document
      picks = rng.choice(len(words), int(lengths.sum()), p=p)
      text = ''.join(' '.join(words[c]) + '.\n' for c in np.split(picks, np.cumsum(lengths)[:-1]))
      f.write(text)
      written += len(text.encode())
  os.replace(path + '.tmp', path)


def _train_command(corpus: str, prepared: str, tokenizer: str, workdir: str) -> list[str]:
  return [
    sys.executable, '-m', 'experiments.train', '--config=configs/gpt_tiny.py',
    '--config.data.task=corpus', f'--config.data.train_path={corpus}',
    f'--config.data.prepared_dir={prepared}', f'--config.data.tokenizer_path={tokenizer}',
    '--config.data.eval_batches=1', '--config.train.steps=3', '--config.train.log_every=1',
    f'--workdir={workdir}',
  ]  # fmt: skip


def _start_and_rss(command: list[str]) -> tuple[float, float]:
  """(seconds from the command's start to its first step's line, its peak RSS in GB)."""
  start = time.time()
  proc = subprocess.Popen(command, cwd=_ROOT, stdout=subprocess.PIPE, text=True)
  first = None
  for line in proc.stdout:
    if first is None and 'step 1/' in line:
      first = time.time() - start
  _, status, usage = os.wait4(proc.pid, 0)
  if status:
    raise ValueError(f'{" ".join(command)} failed with status {status}')
  return first, usage.ru_maxrss / 2**20  # KB -> GB


def _repeated(prepared: str, out: str, times: int) -> str:
  """A dataset.json that lists every shard of `prepared` `times` times (no copies)."""
  os.makedirs(out, exist_ok=True)
  meta = json.load(open(os.path.join(prepared, 'dataset.json')))
  for split in meta['splits'].values():
    split[:] = [dict(s, file=os.path.join(prepared, s['file'])) for s in split] * times
  meta['tokens'] *= times
  if not os.path.exists(os.path.join(out, 'tokenizer')):
    shutil.copytree(os.path.join(prepared, 'tokenizer'), os.path.join(out, 'tokenizer'))
  json.dump(meta, open(os.path.join(out, 'dataset.json'), 'w'))
  return out


def _loader_speed(paths: list[str], rows: int, length: int, seconds: float = 5.0) -> float:
  """Training batches of a causal LM (packed) on one core: tokens/s."""
  from transformer.data import stream

  s = stream.TokenStream(paths)
  layout = stream.Layout('causal_lm', length, separator=2, pack=True, vocab_size=_VOCAB + 16)
  it = stream.StreamIterator(s, layout, global_rows=rows, seed=0)
  next(it)
  start, batches = time.perf_counter(), 0
  while time.perf_counter() - start < seconds:
    next(it)
    batches += 1
  return batches * rows * length / (time.perf_counter() - start)


def _share_reaching_model(paths: list[str], rows: int, length: int) -> float:
  """One epoch of training rows: the share of the shards' tokens found among the targets."""
  from transformer.data import stream

  s = stream.TokenStream(paths)
  layout = stream.Layout('causal_lm', length, separator=2, pack=True, vocab_size=_VOCAB + 16)
  it = stream.StreamIterator(s, layout, global_rows=rows, seed=0)
  vocab = int(max(np.max(p) for p in s._maps)) + 1
  wanted = np.zeros(vocab, np.int64)
  for m in s._maps:
    wanted += np.bincount(m, minlength=vocab)
  seen = np.zeros(vocab, np.int64)
  for _ in range(-(-len(s) // (rows * length))):  # the epoch, rounded up to whole batches
    batch = next(it)
    seen += np.bincount(batch['targets'][batch['weights'] > 0], minlength=vocab)
  return float(np.minimum(seen, wanted).sum() / wanted.sum())


def _share_of_text_task(corpus: str, tokenizer: str, root: str, length: int) -> float:
  """The same for task='text' (documents cut at max_length) on the first _SAMPLE documents."""
  from transformer import data
  from transformer.config.experiment import DataConfig, section

  sample = os.path.join(root, 'sample.txt')
  with open(corpus) as f, open(sample, 'w') as out:
    out.writelines(line for _, line in zip(range(_SAMPLE), f))
  workdir = os.path.join(root, 'text_task')
  shutil.rmtree(workdir, ignore_errors=True)
  shutil.copytree(tokenizer, os.path.join(workdir, 'tokenizer'))  # the same SentencePiece model
  cfg = data.default_config()
  cfg.update(dict(task='text', text_format='lines', train_path=sample, eval_path=sample))
  cfg.tokenizer = 'sentencepiece'
  cfg.update(dict(vocab_size=_VOCAB, max_length=length, batch_size=32, eval_batch_size=32))
  task = data.build(section(DataConfig, cfg), family='causal_lm', workdir=workdir, seed=0)
  kept = task.source.train.parts[0].lengths() + 1  # targets: the document as cut, then eos
  docs = [line.rstrip('\n') for line in open(sample)]
  total = sum(len(ids) + 1 for ids in task.tokenizer.encode_batch(docs))
  return float(kept.sum() / total)


def main():
  from transformer import data
  from transformer.config.experiment import DataConfig, section
  from transformer.data import prepare

  root = _DIR.value
  os.makedirs(root, exist_ok=True)
  corpus = _CORPUS.value or os.path.join(root, f'corpus_{_SIZE.value}mb.txt')
  if _PLAYS.value:
    from bench import first_use

    corpus = os.path.join(root, f'english_{_SIZE.value}mb.txt')
    if not os.path.exists(corpus):
      first_use.english_like(_PLAYS.value, corpus, _SIZE.value)
  elif not _CORPUS.value:
    _corpus(corpus, _SIZE.value)
  size = os.path.getsize(corpus)
  rows = [('corpus', f'{size / 1e6:.0f} MB', corpus)]
  if _PART.value == 'first_use':
    return _print(rows + _first_use(root, corpus, size))
  tokenizer = os.path.join(root, 'tokenizer')
  if not os.path.exists(tokenizer):
    start = time.time()
    sample = [line for _, line in zip(range(_SAMPLE), open(corpus))]
    data.train_sentencepiece(sample, _VOCAB).save(tokenizer)
    rows.append((f'SentencePiece on {_SAMPLE:,} documents', f'{time.time() - start:.1f} s', ''))
  cfg = data.default_config()
  cfg.update(dict(task='corpus', train_path=corpus, tokenizer_path=tokenizer))
  cfg.update(dict(prepare_chunk_mb=_CHUNK.value, max_length=128, batch_size=32))
  for workers in (1, 2):
    out = os.path.join(root, f'prepared_w{workers}_{_SIZE.value}mb')
    shutil.rmtree(out, ignore_errors=True)
    start = time.time()
    meta = prepare.prepare(cfg, out, workers=workers, log=lambda line: None)
    took = time.time() - start
    rate = f'{size / took / 1e6:.2f} MB/s, {meta["tokens"] / took / 1e6:.2f}M tokens/s'
    note = f'--workers={workers}, {len(meta["splits"]["train"])} pieces'
    rows.append((f'prepare, {workers} worker(s)', f'{took:.1f} s: {rate}', note))
  shards = [os.path.join(out, s['file']) for s in meta['splits']['train']]
  rows.append(('train tokens', f'{meta["tokens"]:,} in {len(shards)} shards', out))
  big = _repeated(out, os.path.join(root, f'x{_REPEAT.value}'), _REPEAT.value)
  tokens = {out: meta['tokens'], big: meta['tokens'] * _REPEAT.value}
  for round_ in range(_STARTS):  # alternating, so that both sizes meet the same machine load
    for prepared in (out, big):
      workdir = os.path.join(root, 'run')
      shutil.rmtree(workdir, ignore_errors=True)
      first, rss = _start_and_rss(_train_command(corpus, prepared, tokenizer, workdir))
      name = f'train start -> step 1, {tokens[prepared] / 1e6:.0f}M tokens, round {round_ + 1}'
      rows.append((name, f'{first:.1f} s, peak RSS {rss:.2f} GB', ''))
  for prepared in (out, big):
    cfg.prepared_dir = prepared
    start = time.time()
    data.build(section(DataConfig, cfg), family='causal_lm', workdir=None, seed=0)
    rows.append(
      (f'data.build, {tokens[prepared] / 1e6:.0f}M tokens', f'{time.time() - start:.2f} s', '')
    )
  os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
  for batch, length in ((32, 128), (64, 1024)):
    speed = _loader_speed(shards, batch, length)
    rows.append((f'loader, 1 core, {batch}x{length}', f'{speed / 1e6:.1f}M tokens/s', ''))
  share = _share_reaching_model(shards, 32, 128)
  rows.append(('corpus tokens reaching the model', f'{100 * share:.2f}%', 'one epoch'))
  share = _share_of_text_task(corpus, tokenizer, root, 128)
  note = f"task='text', first {_SAMPLE:,} documents"
  rows.append(('the same with documents cut at 128', f'{100 * share:.2f}%', note))
  _print(rows)


def _print(rows: list[tuple[str, str, str]]) -> None:
  width = max(len(r[0]) for r in rows)
  for name, value, note in rows:
    print(f'{name:<{width}}  {value}  {note}'.rstrip())


def _first_use(root: str, corpus: str, size: int) -> list[tuple[str, str, str]]:
  """Each approach's seconds from the text to the tokens on disk, and `experiments.train`'s from
  its launch to its first step on a corpus it has not seen: medians of alternating rounds."""
  from bench import first_use
  from transformer import data

  gpt2 = first_use.gpt2_shaped(corpus, os.path.join(root, 'gpt2_shaped'))
  encoder, cores = first_use.encoder(gpt2)[0], len(os.sched_getaffinity(0))

  def sparrow(tokenizer_path: str) -> tuple[float, int, float]:
    cfg = data.default_config()
    cfg.update(dict(task='corpus', train_path=corpus, tokenizer='sentencepiece', vocab_size=512))
    cfg.tokenizer_path = tokenizer_path
    out = os.path.join(root, 'first_use')
    shutil.rmtree(out, ignore_errors=True)
    start = time.time()
    meta, trained = first_use.sparrow_prepare(cfg, out)
    return time.time() - start, meta['tokens'], trained

  def nanogpt() -> tuple[float, int, float]:
    start = time.time()
    tokens = first_use.nanogpt_prepare(corpus, gpt2, os.path.join(root, 'nanogpt.bin'), cores)
    return time.time() - start, tokens, 0.0

  def train() -> tuple[float, int, float]:
    workdir = os.path.join(root, 'first_use_run')
    shutil.rmtree(workdir, ignore_errors=True)
    command = [
      sys.executable, '-m', 'experiments.train', '--config=configs/gpt_tiny.py',
      '--config.data.task=corpus', f'--config.data.train_path={corpus}',
      '--config.data.eval_batches=1', '--config.train.eval_decode_examples=0',
      '--config.train.steps=1', '--config.train.log_every=1', f'--workdir={workdir}',
    ]  # fmt: skip
    return _start_and_rss(command)[0], 0, 0.0

  nanogpt_name = f"nanoGPT's approach ({encoder}, {cores} processes)"
  approaches = {
    'sparrow, SentencePiece 512 trained on a sample': lambda: sparrow(''),
    'sparrow, GPT-2-shaped tokenizer.json (tokenizer_path)': lambda: sparrow(gpt2),
    nanogpt_name: nanogpt,
    'experiments.train gpt_tiny, launch to step 1': train,
  }
  runs = {name: [] for name in approaches}
  for _ in range(_ROUNDS.value):  # alternating, so that every approach meets the same load
    for name, run in approaches.items():
      runs[name].append(run())
  medians = {name: float(np.median([r[0] for r in got])) for name, got in runs.items()}
  rows = []
  for name, got in runs.items():
    took, tokens = medians[name], got[0][1]
    note = f'rounds {", ".join(f"{r[0]:.1f}" for r in got)} s'
    if tokens:
      note = f'{size / took / 1e6:.1f} MB/s, {tokens / 1e6:.1f}M tokens, {note}'
      took_text = f'{took:.1f} s, x{took / medians[nanogpt_name]:.2f}'
    else:
      took_text = f'{took:.1f} s'
    if any(r[2] for r in got):
      note += f'; training the tokenizer {np.median([r[2] for r in got]):.1f} s'
    rows.append((name, took_text, note))
  return rows


if __name__ == '__main__':
  cli.run(main)
