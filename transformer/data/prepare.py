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
from transformer.data import corpus, progress, shards, sources, stream
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
# A SentencePiece tokenizer is trained on a sample of the corpus: 2 KB of text per piece, within
# [4 MB, 100 MB] (4 MB for 512 pieces trains in a few seconds), of documents cut to 4096
# characters (SentencePiece skips longer sentences), drawn with a fixed seed.
_SAMPLE_BYTES_PER_PIECE, _SAMPLE_MIN_BYTES, _SAMPLE_MAX_BYTES = 2000, 4 * 10**6, 10**8
_SAMPLE_CHARS = 4096
_SAMPLE_SEED = 0
_TRAIN_RATE = 1e6  # bytes/s the trainer gets through on one slow core: the ETA while it trains
_BATCH = 1024  # documents tokenised at a time
_POOL_MIN_BYTES = 32 * 10**6  # workers=0 starts processes from here: each first imports JAX (~2 s)


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


def _tokenizer(cfg, units: list[corpus.Unit], out: str, where: str, shown) -> Tokenizer:
  """The saved tokenizer of `out` (a resume), the one at tokenizer_path, or a newly trained one."""
  cache = os.path.join(out, 'tokenizer')
  if os.path.exists(cache):
    tokenizer = load_tokenizer(cache)
    shown.note(f'tokenizer: {_described(tokenizer)}, saved in {cache} (a resume)')
    return tokenizer
  if cfg.tokenizer_path:
    tokenizer = tokenizer_from_file(cfg.tokenizer_path)
    shown.note(f'tokenizer: {_described(tokenizer)}, from {cfg.tokenizer_path}')
  elif cfg.tokenizer == 'byte':
    tokenizer = ByteTokenizer()
    shown.note(f'tokenizer: {_described(tokenizer)}')
  elif cfg.tokenizer == 'sentencepiece':
    tokenizer = _trained(cfg, units, where, shown)
  else:
    raise ValueError(
      f'tokenizer={cfg.tokenizer!r} needs data.tokenizer_path (a tokenizer.json or SentencePiece '
      "model) to prepare a corpus; or use 'sentencepiece' (trained on a sample) or 'byte'"
    )
  separator_id(tokenizer)
  save_whole(tokenizer, cache)
  return load_tokenizer(cache)


def _described(tokenizer: Tokenizer) -> str:
  return f'{tokenizer.kind}, {tokenizer.vocab_size:,} ids'


def _sample_bytes(vocab_size: int) -> int:
  """How much text a SentencePiece tokenizer of `vocab_size` pieces is trained on."""
  return min(max(_SAMPLE_MIN_BYTES, _SAMPLE_BYTES_PER_PIECE * vocab_size), _SAMPLE_MAX_BYTES)


def _trained(cfg, units: list[corpus.Unit], where: str, shown) -> Tokenizer:
  """SentencePiece trained on a seeded sample drawn across the corpus (`corpus.sample`)."""
  budget, start = _sample_bytes(cfg.vocab_size), time.monotonic()
  shown.phase('sampling', budget)
  texts, nbytes = corpus.sample(
    units, budget, max_documents=cfg.spm_train_lines, cut=_SAMPLE_CHARS, seed=_SAMPLE_SEED
  )
  if not texts:
    raise ValueError(f'{where} has no documents (blank lines are skipped); nothing to prepare')
  shown.note(
    f'sampled {nbytes / 1e6:.1f} MB ({len(texts):,} documents, each cut to {_SAMPLE_CHARS} '
    f'characters) from {min(len(units), corpus.SAMPLE_PIECES)} of {len(units)} pieces, seed '
    f'{_SAMPLE_SEED}, in '
    f'{progress.duration(time.monotonic() - start)}'
  )
  start, detail = time.monotonic(), f'sentencepiece, {cfg.vocab_size} pieces'
  shown.phase('training tokenizer', nbytes, detail=lambda: detail, estimate=nbytes / _TRAIN_RATE)
  tokenizer = train_sentencepiece(texts, cfg.vocab_size)
  took = progress.duration(time.monotonic() - start)
  shown.note(f'tokenizer: {_described(tokenizer)}, trained on {nbytes / 1e6:.1f} MB in {took}')
  return tokenizer


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


def prepare(cfg, out: str, *, workers: int = 0, log: Callable[[str], None] | None = None) -> dict:
  """Tokenises the corpus of `cfg` (train_path, eval_path, tokenizer knobs) into shards in `out`.

  Returns the dataset description (also written to out/dataset.json). A directory prepared
  already is returned as is; one cut short resumes. If this call made `out` and the corpus is bad
  (an empty corpus, a jsonl line without text), `out` is removed again.
  """
  if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
    raise ValueError(f'workers={workers!r} must be an integer >= 0 (0: one per core)')
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
  jobs = [
    (f'train_{i:05d}.bin', u, out, '' if evaluation else f'eval_{i:05d}.bin')
    for i, u in enumerate(train_units)
  ]
  jobs += [(f'eval_{i:05d}.bin', u, out, '') for i, u in enumerate(eval_units)]
  for name in os.listdir(out):  # a shard cut short by an interruption
    if name.endswith('.bin.tmp'):
      os.remove(os.path.join(out, name))
  todo = [j for j in jobs if not os.path.exists(os.path.join(out, j[0]))]
  log = log or (lambda line: print(line, file=sys.stderr, flush=True))
  with progress.Progress(log) as shown:
    start, total = time.monotonic(), sum(corpus.unit_bytes(j[1]) for j in jobs)
    shown.note(f'{where}: {total / 1e6:.1f} MB in {len(jobs)} pieces, into {out}')
    tokenizer = _tokenizer(cfg, train_units, out, where, shown)
    _encode(todo, out, workers, shown, done=len(jobs) - len(todo), pieces=len(jobs))
    meta = _write_dataset(out, jobs, tokenizer, cfg, evaluation)
    took = time.monotonic() - start
    shown.note(
      f'done in {progress.duration(took)}: {meta["input_bytes"] / 1e6:.1f} MB, '
      f'{meta["documents"]:,} documents, {meta["tokens"]:,} train tokens in {out}'
    )
  return meta


def _encode(todo: list[tuple], out: str, workers: int, shown, *, done: int, pieces: int) -> None:
  """Writes the shards of the pieces in `todo` on `workers` processes (this one if 1; 0: one per
  core for a corpus of 32 MB or more), with a progress line at least every interval."""
  todo_bytes, start = sum(corpus.unit_bytes(j[1]) for j in todo), time.monotonic()
  if not workers:  # one per core, where the corpus repays starting them
    workers = len(os.sched_getaffinity(0)) if todo_bytes >= _POOL_MIN_BYTES else 1
  workers = min(workers, len(todo))
  context = multiprocessing.get_context('spawn')  # never fork a process that may run JAX
  counters, finished = _Counters(context.Array('q', 3)), [done]

  def detail() -> str:
    _, documents, tokens = counters.values()
    return f'{finished[0]}/{pieces} pieces, {documents:,} documents, {tokens:,} tokens'

  done_bytes = lambda: counters.values()[0]
  shown.phase('encoding', todo_bytes or None, done=done_bytes, detail=detail)  # TFDS: unknown
  if workers <= 1:
    _init_worker(out, counters)
    for job in todo:
      _prepare_unit(job)
      finished[0] += 1
  else:
    with context.Pool(workers, _init_worker, (out, counters)) as pool:
      for _ in pool.imap_unordered(_prepare_unit, todo):
        finished[0] += 1
  rate = counters.values()[0] / max(time.monotonic() - start, 1e-9)
  shown.note(
    f'encoded {todo_bytes / 1e6:.1f} MB at {rate / 1e6:.1f} MB/s on {max(workers, 1)} '
    f'process(es) ({detail()})'
  )


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
    try:
      prepare(cfg, out, workers=cfg.prepare_workers)
    except BaseException as error:  # the others stop waiting, and say why
      _tell_the_others(f'{type(error).__name__}: {util.first_line(error)}')
      raise
  else:
    _wait_for_process_0(out)
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


_FAILED_KEY = 'sparrow_prepare_failed'  # in jax.distributed's key-value store: process 0's error
_REPORT_SECONDS = 10.0  # how often a waiting process says that it still waits


def _tell_the_others(error: str) -> None:
  """Publishes process 0's preparation error, so the waiting processes end with it."""
  client = util.coordination_client()
  if client is None:
    return
  try:
    client.key_value_set(_FAILED_KEY, error)
  except Exception:  # noqa: S110 (the service is gone: the others see that too)
    pass


def _wait_for_process_0(out: str) -> None:
  """Waits for process 0 to prepare `out`, with a line every _REPORT_SECONDS. Ends with one error
  when process 0 reports its preparation failed, or when its coordination service is gone."""
  client, start, said = util.coordination_client(), time.time(), time.time()
  while not is_prepared(out):
    if client is not None:
      try:
        failed = client.key_value_try_get(_FAILED_KEY)
      except Exception as e:  # NOT_FOUND: no error yet; anything else: process 0 is gone
        if 'NOT_FOUND' not in str(e):
          raise ConnectionError(
            f'process 0 (the coordinator) was lost while it prepared the corpus in {out} '
            f'({util.first_line(e, 160)}); rerun the same command on every host'
          ) from None
      else:
        raise ValueError(
          f'process 0 could not prepare the corpus in {out}: {failed}; fix that and rerun the '
          'same command on every host'
        )
    if time.time() - said >= _REPORT_SECONDS:
      said = time.time()
      print(
        f'prepare: waiting {said - start:.0f} s for process 0 to prepare the corpus in {out}',
        file=sys.stderr,
        flush=True,
      )
    time.sleep(_WAIT_SECONDS)


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
