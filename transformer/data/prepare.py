"""Tokenise a corpus once into token shards (see `shards`): `prepare(data_cfg, out, workers=N)`.

As nanoGPT's prepare.py and llm.c's fineweb.py do: every document becomes [separator] + its ids,
written to uint16/uint32 shards. Pieces of the corpus go to N processes; each shard is written
whole (a temp file renamed into place), so an interrupted run resumes with the pieces not done.
`out/dataset.json` is written last: the corpus is ready when it exists.

task='corpus' streams such shards: `streams` makes `data.train_path` ready (a corpus, text,
jsonl or Parquet, prepared once under `data.prepared_dir`, default <workdir>/corpus; or llm.c
token shards, read in place) and checks it against the run's tokenizer.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Callable

import numpy as np

from transformer import util
from transformer.data import corpus, shards, sources, stream
from transformer.data.tokenizers import (
  ByteTokenizer,
  IdsTokenizer,
  Tokenizer,
  load_tokenizer,
  save_whole,
  tokenizer_from_file,
  train_sentencepiece,
)

DATASET = 'dataset.json'  # written last: the list of shards, their counts and the vocabulary
_PLAN = 'plan.json'  # written first: the inputs and knobs this directory is being prepared from
HOLD_OUT_EVERY = 200  # without eval_path, every 200th document of each piece is held out
_SAMPLE_CHARS = 4096  # characters of each document in the tokenizer's training sample
_SAMPLE_TOTAL_CHARS = 10**8  # and of the whole sample (SentencePiece holds it in memory)
_BATCH = 1024  # documents tokenised at a time


class NoRoomError(ValueError):
  """No room left for the shards. What is done stays, so the same command resumes with the rest."""


def is_prepared(out: str) -> bool:
  return os.path.exists(os.path.join(out, DATASET))


def read_dataset(out: str) -> dict:
  """The dataset.json of a prepared directory; one ValueError if it is missing or unreadable."""
  path = os.path.join(out, DATASET)
  try:
    with open(path) as f:
      meta = json.load(f)
  except FileNotFoundError:
    raise FileNotFoundError(
      f'{out!r} is not a prepared corpus (no {DATASET}); run python -m experiments.prepare_data'
    ) from None
  except (OSError, ValueError) as e:
    raise ValueError(f'{path}: unreadable ({e}); prepare the corpus again') from None
  if not isinstance(meta, dict) or 'splits' not in meta:
    raise ValueError(f'{path}: not a sparrow dataset description; prepare the corpus again')
  return meta


def _plan(cfg, train: list[str], evaluation: list[str]) -> dict:
  """What the shards depend on; a directory prepared from another plan is never mixed in."""
  files = lambda paths: [[os.path.abspath(p), os.path.getsize(p)] for p in paths]
  return {
    'train': files(train),
    'eval': files(evaluation),
    'tokenizer': cfg.tokenizer,
    'vocab_size': cfg.vocab_size,
    'tokenizer_path': os.path.abspath(cfg.tokenizer_path) if cfg.tokenizer_path else '',
    'spm_train_lines': cfg.spm_train_lines,
    'prepare_chunk_mb': cfg.prepare_chunk_mb,
    'tfds': [] if train else [cfg.tfds_name, cfg.tfds_train_split, cfg.tfds_eval_split],
  }


def _check_plan(out: str, plan: dict) -> None:
  path = os.path.join(out, _PLAN)
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    if old != plan:
      changed = sorted(k for k in plan if old.get(k) != plan[k])
      raise ValueError(
        f'{out!r} is being prepared from other inputs or knobs ({", ".join(changed)} differ); '
        'use another output directory, or delete it to start over'
      )
  else:
    util.write_atomic(path, json.dumps(plan, indent=1))


def separator_id(tokenizer: Tokenizer) -> int:
  """The token put before every document: eos, or GPT-2's <|endoftext|> for an HF tokenizer."""
  eos = getattr(tokenizer, 'eos_id', None)
  if eos is None and tokenizer.kind == 'hf':
    eos = tokenizer._tok.token_to_id('<|endoftext|>')
  if eos is None:
    raise ValueError(
      f'the {tokenizer.kind} tokenizer has no eos token to separate documents with; give it '
      'a tokenizer_config.json with eos_token, or use one that has <|endoftext|>'
    )
  return int(eos)


def _tokenizer(cfg, units: list[corpus.Unit], out: str, where: str) -> Tokenizer:
  """The saved tokenizer of `out` (a resume), the one at tokenizer_path, or a newly trained one."""
  cache = os.path.join(out, 'tokenizer')
  if os.path.exists(cache):
    return load_tokenizer(cache)
  if cfg.tokenizer_path:
    tokenizer = tokenizer_from_file(cfg.tokenizer_path)
  elif cfg.tokenizer == 'byte':
    tokenizer = ByteTokenizer()
  elif cfg.tokenizer == 'sentencepiece':
    sample, chars = [], 0  # a bounded sample: the first spm_train_lines documents, cut short
    for unit in units:
      for text in corpus.documents(unit):
        sample.append(text[:_SAMPLE_CHARS])
        chars += len(sample[-1])
        if len(sample) >= cfg.spm_train_lines or chars >= _SAMPLE_TOTAL_CHARS:
          break
      if len(sample) >= cfg.spm_train_lines or chars >= _SAMPLE_TOTAL_CHARS:
        break
    if not sample:
      raise ValueError(f'{where} has no documents (blank lines are skipped); nothing to prepare')
    tokenizer = train_sentencepiece(sample, cfg.vocab_size)
  else:
    raise ValueError(
      f'tokenizer={cfg.tokenizer!r} needs data.tokenizer_path (a tokenizer.json or SentencePiece '
      "model) to prepare a corpus; or use 'sentencepiece' (trained on a sample) or 'byte'"
    )
  separator_id(tokenizer)
  save_whole(tokenizer, cache)
  return load_tokenizer(cache)


# Work done in each process -----------------------------------------------------------------------
_WORKER: dict = {}


def _init_worker(out: str, counters) -> None:
  _WORKER['tokenizer'] = load_tokenizer(os.path.join(out, 'tokenizer'))
  _WORKER['counters'] = counters


def _prepare_unit(job: tuple) -> tuple[str, int, int, int]:
  """Writes the shard(s) of one piece; returns (shard name, input bytes, documents, tokens)."""
  name, unit, out, hold_out = job
  tokenizer, counters = _WORKER['tokenizer'], _WORKER['counters']
  vocab, separator = tokenizer.vocab_size, separator_id(tokenizer)
  writers = [shards.ShardWriter(os.path.join(out, name), vocab)]
  if hold_out:
    writers.append(shards.ShardWriter(os.path.join(out, hold_out), vocab))
  total_docs = total_tokens = 0
  batch = []

  def flush():
    nonlocal total_docs, total_tokens
    ids = tokenizer.encode_batch(batch)
    kept = [[], []]
    for number, doc in enumerate(ids, start=total_docs):
      held = hold_out and number % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1
      kept[1 if held else 0].append(doc)
    for writer, docs in zip(writers, kept):
      if not docs:
        continue
      lengths = np.array([len(d) + 1 for d in docs])
      flat = np.full(int(lengths.sum()), separator, np.int64)
      starts = np.cumsum(lengths) - lengths
      for start, doc in zip(starts, docs):
        flat[start + 1 : start + 1 + len(doc)] = doc
      if flat.size and (flat.min() < 0 or flat.max() >= vocab):
        raise ValueError(f'the tokenizer gave an id outside its vocab_size={vocab}: rebuild it')
      writer.add(flat, len(docs))
    tokens = sum(len(d) + 1 for d in ids)
    counters.add(sum(len(t.encode('utf-8')) for t in batch), len(batch), tokens)
    total_docs, total_tokens = total_docs + len(batch), total_tokens + tokens
    batch.clear()

  try:
    for text in corpus.documents(unit):
      batch.append(text)
      if len(batch) == _BATCH:
        flush()
    if batch:
      flush()
    for writer in reversed(writers):  # the held-out shard first: the main one marks it done
      writer.close()
  except BaseException:
    for writer in writers:
      writer.abort()
    raise
  return name, corpus.unit_bytes(unit), total_docs, total_tokens


class _Counters:
  """[input bytes, documents, tokens] so far, shared with the worker processes."""

  def __init__(self, shared):
    self.shared = shared

  def add(self, nbytes: int, documents: int, tokens: int) -> None:
    with self.shared.get_lock():
      self.shared[0] += nbytes
      self.shared[1] += documents
      self.shared[2] += tokens

  def values(self) -> tuple[int, int, int]:
    return tuple(self.shared)


def _progress_line(done: int, total: int, counts, todo_bytes: int, elapsed: float) -> str:
  nbytes, docs, tokens = counts
  rate = nbytes / max(elapsed, 1e-9)
  eta = (todo_bytes - nbytes) / rate if rate > 0 else float('inf')
  eta_text = time.strftime('%H:%M:%S', time.gmtime(eta)) if eta < 86400 * 30 else '?'
  return (
    f'prepare: {done}/{total} pieces, {docs:,} documents, {tokens:,} tokens, '
    f'{rate / 1e6:.1f} MB/s, ETA {eta_text}'
  )


def prepare(cfg, out: str, *, workers: int = 1, log: Callable[[str], None] | None = None) -> dict:
  """Tokenises the corpus of `cfg` (train_path, eval_path, tokenizer knobs) into shards in `out`.

  Returns the dataset description (also written to out/dataset.json). A directory prepared
  already is returned as is; one cut short resumes. If this call made `out` and the corpus is bad
  (an empty corpus, a jsonl line without text), `out` is removed again.
  """
  if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
    raise ValueError(f'workers={workers!r} must be an integer >= 1')
  from_tfds = not cfg.train_path  # the TFDS split that the config names (tfds_name)
  train = [] if from_tfds else sources._paths(cfg.train_path, 'data.train_path')
  evaluation = sources._paths(cfg.eval_path, 'data.eval_path') if cfg.eval_path else []
  for path in train + evaluation:
    if corpus.kind(path) == 'llmc':
      raise ValueError(
        f'{path} is an llm.c token shard: it is read in place, not prepared; pass such shards '
        "as data.train_path/eval_path with data.task='corpus'"
      )
  if is_prepared(out):
    return read_dataset(out)
  created = not os.path.exists(out)
  try:
    return _prepare(cfg, out, train, evaluation, workers, log)
  except (ValueError, FileNotFoundError):
    if created:
      shutil.rmtree(out, ignore_errors=True)
    raise
  except OSError as error:  # a full disk keeps what is done: the same command resumes from it
    reason = util.no_space_reason(error)
    if reason is None:
      raise
    raise NoRoomError(_no_room(cfg, out, reason, train, evaluation)) from error


def _no_room(cfg, out: str, reason: str, train: list[str], evaluation: list[str]) -> str:
  """The one line for a full disk: what was written, what is free, about how much the pieces
  left need (at the output bytes per input byte of the shards written, or of a sample)."""
  resume = 'and rerun the same command: it resumes with the pieces left'
  if not os.path.isdir(out):  # not even the directory could be made
    return f'no room to make {out}: {reason}. Free some space (or use a bigger disk) {resume}'
  for name in os.listdir(out):  # shards cut short: their room is the resume's
    if name.endswith('.bin.tmp'):
      os.remove(os.path.join(out, name))
  chunk = cfg.prepare_chunk_mb * 2**20
  pieces = {f'train_{i:05d}.bin': u for i, u in enumerate(corpus.units(train, chunk))}
  pieces |= {f'eval_{i:05d}.bin': u for i, u in enumerate(corpus.units(evaluation, chunk))}
  done = [n for n in pieces if os.path.exists(os.path.join(out, n))]
  left = [u for n, u in pieces.items() if n not in done]
  written = sum(
    os.path.getsize(os.path.join(out, n)) for n in os.listdir(out) if n.endswith('.bin')
  )
  free = shutil.disk_usage(out).free
  head = (
    f'no room to prepare the corpus in {out}: {reason}; written: {len(done)} of {len(pieces)} '
    f'pieces ({util.byte_size(written)} of shards), {util.byte_size(free)} free'
  )
  if not train or not os.path.exists(os.path.join(out, 'tokenizer')):  # nothing to estimate from
    return f'{head}. Free some space (or use a bigger disk) {resume}'
  done_input = sum(corpus.unit_bytes(pieces[n]) for n in done)
  ratio = written / done_input if done else _sampled_ratio(out, left[0])
  need = ratio * sum(corpus.unit_bytes(u) for u in left) + shards.HEADER_BYTES * len(left)
  more = f'Free at least {util.byte_size(need - free)} more' if need > free else 'Free some space'
  return (
    f'{head}; the {len(left)} pieces left need about {util.byte_size(need)} ({ratio:.2f} bytes '
    f'of shard per byte of input). {more} (or use a bigger disk) {resume}'
  )


def _sampled_ratio(out: str, unit: corpus.Unit) -> float:
  """Shard bytes per input byte of the first MiB of documents of `unit`."""
  tokenizer = load_tokenizer(os.path.join(out, 'tokenizer'))
  texts, nbytes = [], 0
  for text in corpus.documents(unit):
    texts.append(text)
    nbytes += len(text.encode('utf-8')) + 1  # and the line's end
    if nbytes >= 2**20:
      break
  tokens = sum(len(ids) + 1 for ids in tokenizer.encode_batch(texts))
  itemsize = np.dtype(shards.token_dtype(tokenizer.vocab_size)).itemsize
  return tokens * itemsize / max(nbytes, 1)


def _prepare(cfg, out, train, evaluation, workers, log) -> dict:
  os.makedirs(out, exist_ok=True)
  _check_plan(out, _plan(cfg, train, evaluation))
  chunk = cfg.prepare_chunk_mb * 2**20
  train_units, eval_units = corpus.units(train, chunk), corpus.units(evaluation, chunk)
  where = f'data.train_path={cfg.train_path!r}'
  if not train:  # one piece per split: TFDS reads it with its own threads
    split = lambda name: corpus.tfds_unit(cfg.tfds_name, name, cfg.tfds_data_dir, cfg.tfds_text_key)
    train_units, eval_units = [split(cfg.tfds_train_split)], [split(cfg.tfds_eval_split)]
    evaluation, where = [cfg.tfds_eval_split], f'TFDS {cfg.tfds_name} {cfg.tfds_train_split}'
    workers = 1  # in this process: TFDS's test mocks and its download live here
  tokenizer = _tokenizer(cfg, train_units, out, where)
  jobs = [
    (f'train_{i:05d}.bin', u, out, '' if evaluation else f'eval_{i:05d}.bin')
    for i, u in enumerate(train_units)
  ]
  jobs += [(f'eval_{i:05d}.bin', u, out, '') for i, u in enumerate(eval_units)]
  for name in os.listdir(out):  # a shard cut short by an interruption
    if name.endswith('.bin.tmp'):
      os.remove(os.path.join(out, name))
  todo = [j for j in jobs if not os.path.exists(os.path.join(out, j[0]))]
  todo_bytes = sum(corpus.unit_bytes(j[1]) for j in todo)
  log = log or (lambda line: print(line, file=sys.stderr, flush=True))
  context = multiprocessing.get_context('spawn')  # never fork a process that may run JAX
  counters = _Counters(context.Array('q', 3))
  start, last = time.time(), 0.0
  done = len(jobs) - len(todo)

  shown = None

  def report(final=False):
    nonlocal last, shown
    if (final and shown != counters.values()) or time.time() - last >= 5:
      last, shown = time.time(), counters.values()
      log(_progress_line(done, len(jobs), shown, todo_bytes, last - start))

  if workers == 1 or len(todo) <= 1:
    _init_worker(out, counters)
    for job in todo:
      _prepare_unit(job)
      done += 1
      report()
  elif todo:
    with context.Pool(workers, _init_worker, (out, counters)) as pool:
      results = pool.imap_unordered(_prepare_unit, todo)
      while True:
        try:
          results.next(timeout=5)
        except multiprocessing.TimeoutError:
          report()
          continue
        except StopIteration:
          break
        done += 1
        report()
  report(final=True)
  return _write_dataset(out, jobs, tokenizer, cfg, evaluation)


def _write_dataset(out, jobs, tokenizer, cfg, evaluation) -> dict:
  splits = {'train': [], 'eval': []}
  names = sorted({j[0] for j in jobs} | {j[3] for j in jobs if j[3]})
  total_bytes = sum(corpus.unit_bytes(j[1]) for j in jobs)
  for name in names:
    _, tokens, documents = shards.read_header(os.path.join(out, name))
    split = 'train' if name.startswith('train_') else 'eval'
    splits[split].append({'file': name, 'tokens': tokens, 'documents': documents})
  for split, what in (('train', 'data.train_path'), ('eval', 'data.eval_path')):
    if not sum(s['documents'] for s in splits[split]):
      path = cfg.eval_path if split == 'eval' and evaluation else cfg.train_path
      if not cfg.train_path:
        chosen = cfg.tfds_train_split if split == 'train' else cfg.tfds_eval_split
        what, path = 'TFDS split', f'{cfg.tfds_name} {chosen}'
      shortly = '' if split == 'train' or evaluation else ' to hold out every 200th'
      raise ValueError(
        f'{what}={path!r} has no documents{shortly} (blank lines are skipped); give it text'
      )
  meta = {
    'format': 1,
    'tokenizer': tokenizer.kind,
    'vocab_size': tokenizer.vocab_size,
    'separator': separator_id(tokenizer),
    'input_bytes': total_bytes,
    'documents': sum(s['documents'] for s in splits['train']),
    'tokens': sum(s['tokens'] for s in splits['train']),
    'splits': splits,
  }
  util.write_atomic(os.path.join(out, DATASET), json.dumps(meta, indent=1))
  return meta


# Reading a corpus ready to stream (task='corpus') -------------------------------------------------
_WAIT_SECONDS = 2.0  # how often a process polls for the corpus that process 0 prepares
_VOCAB_PROBE = 2**20  # tokens of the first shard checked against the vocabulary at start


def prepared_dir(cfg, workdir: str | None) -> str:
  """Where the shards of task='corpus' go: data.prepared_dir, or <workdir>/corpus."""
  if cfg.prepared_dir:
    return cfg.prepared_dir
  if not workdir:
    raise ValueError("task='corpus' needs data.prepared_dir (where its shards go) or a workdir")
  return os.path.join(workdir, 'corpus')


def _llmc(cfg) -> tuple[list[str], list[str]] | None:
  """(train shards, eval shards) when data.train_path names llm.c shards, else None."""
  if not cfg.train_path:
    return None  # the TFDS dataset of data.tfds_name
  train = sources._paths(cfg.train_path, 'data.train_path')
  kinds = {corpus.kind(p) == 'llmc' for p in train}
  if kinds == {False}:
    return None
  if len(kinds) > 1:
    raise ValueError(
      f'data.train_path={cfg.train_path!r} mixes llm.c .bin shards with other files; use one kind'
    )
  if not cfg.eval_path:
    raise ValueError(
      'llm.c shards need data.eval_path: a glob of the validation shards (e.g. fineweb_val_*.bin)'
    )
  evaluation = sources._paths(cfg.eval_path, 'data.eval_path')
  if any(corpus.kind(p) != 'llmc' for p in evaluation):
    raise ValueError(f'data.eval_path={cfg.eval_path!r} must be llm.c .bin shards like train_path')
  return train, evaluation


def ready(cfg, workdir: str | None, process_index: int) -> dict:
  """Makes the corpus of `cfg` ready to stream: checks llm.c shards' headers, or prepares the
  corpus on first use (process 0; the others wait for it). Returns {'train', 'eval': shard paths,
  'tokenizer', 'separator'} (and 'meta', dataset.json, for a prepared corpus)."""
  found = _llmc(cfg)
  if found is not None:
    train, evaluation = found
    dtypes = {shards.read_header(p)[0] for p in train + evaluation}
    if len(dtypes) > 1:
      raise ValueError('the shards mix uint16 and uint32 tokens; they come from two tokenizers')
    (dtype,) = dtypes
    separator = shards.LLMC_SEPARATOR[dtype]
    if cfg.tokenizer_path:
      tokenizer = tokenizer_from_file(cfg.tokenizer_path)
    else:
      tokenizer = IdsTokenizer(cfg.vocab_size, separator)
    return {'train': train, 'eval': evaluation, 'tokenizer': tokenizer, 'separator': separator}
  out = prepared_dir(cfg, workdir)
  if process_index == 0:
    prepare(cfg, out, workers=cfg.prepare_workers)
  while not is_prepared(out):
    time.sleep(_WAIT_SECONDS)
  meta = read_dataset(out)
  tokenizer = load_tokenizer(os.path.join(out, 'tokenizer'))
  if cfg.tokenizer_path:
    _same_tokenizer(tokenizer, tokenizer_from_file(cfg.tokenizer_path), out, 'data.tokenizer_path')
  if meta['vocab_size'] != tokenizer.vocab_size:
    raise ValueError(
      f'{out}: dataset.json says vocab_size={meta["vocab_size"]} but its tokenizer has '
      f'{tokenizer.vocab_size}; the directory was changed by hand: prepare it again'
    )
  paths = {s: [os.path.join(out, x['file']) for x in meta['splits'][s]] for s in ('train', 'eval')}
  for split, names in paths.items():
    for path, entry in zip(names, meta['splits'][split]):
      _, tokens, _ = shards.read_header(path)
      if tokens != entry['tokens']:
        raise ValueError(f'{path}: holds {tokens} tokens, dataset.json {entry["tokens"]}: corrupt')
  return {**paths, 'tokenizer': tokenizer, 'separator': meta['separator'], 'meta': meta}


def _same_tokenizer(mine: Tokenizer, theirs: Tokenizer, where: str, what: str) -> None:
  probe = 'The quick brown fox, 12 jumps; naïve café.'
  same = mine.kind == theirs.kind and mine.vocab_size == theirs.vocab_size
  if same and mine.kind != 'ids':
    same = mine.encode(probe) == theirs.encode(probe)
  if not same:
    raise ValueError(
      f'vocabulary mismatch: {where} holds shards of a {mine.kind} tokenizer with vocab_size='
      f'{mine.vocab_size}, but {what} is a {theirs.kind} one with vocab_size={theirs.vocab_size}; '
      "prepare the corpus with the run's tokenizer, or use a new workdir"
    )


def streams(cfg, *, family: str, workdir: str | None, process_index: int) -> tuple:
  """(tokenizer, info, train stream, eval stream, separator) of the corpus of `cfg`, made ready
  (`ready`) and checked against the run's tokenizer."""
  if family == 'encoder_decoder':
    raise ValueError(
      "task='corpus' streams documents for language models (causal_lm, bidirectional_lm); "
      "family='encoder_decoder' needs pairs: use task='tsv' or a TFDS translation dataset"
    )
  found = ready(cfg, workdir, process_index)
  tokenizer, separator = found['tokenizer'], found['separator']
  if workdir:
    _cache_tokenizer(tokenizer, workdir, process_index)
  train, evaluation = stream.TokenStream(found['train']), stream.TokenStream(found['eval'])
  if not len(train) or not len(evaluation):
    raise ValueError(f'data.train_path={cfg.train_path!r}: a split holds no tokens')
  probe = train.read(0, min(len(train), _VOCAB_PROBE))
  if probe.max() >= tokenizer.vocab_size:
    raise ValueError(
      f"vocabulary mismatch: the shards hold token id {int(probe.max())} but the run's "
      f'{tokenizer.kind} tokenizer has vocab_size={tokenizer.vocab_size} (valid ids 0..'
      f"{tokenizer.vocab_size - 1}); set data.vocab_size or data.tokenizer_path to the shards' "
      'tokenizer'
    )
  info = {'train_shards': len(found['train']), 'tokens_kept': 1.0}  # every token is read
  if 'meta' in found:
    info['num_train_documents'] = found['meta']['documents']
  return tokenizer, info, train, evaluation, separator


def _cache_tokenizer(tokenizer: Tokenizer, workdir: str, process_index: int) -> None:
  """workdir/tokenizer holds the corpus's tokenizer (for transformer.load and resumes); a
  different one there means the run's checkpoints were trained on another vocabulary."""
  cache = os.path.join(workdir, 'tokenizer')
  if os.path.exists(cache):
    _same_tokenizer(tokenizer, load_tokenizer(cache), 'the corpus', f'{cache!r}')
  elif process_index == 0:
    save_whole(tokenizer, cache)
