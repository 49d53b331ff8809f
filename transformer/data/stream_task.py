"""task='corpus': a language-model Task streamed from token shards (see `stream`).

`data.train_path` is either a corpus (text, jsonl, Parquet), prepared once into shards under
`data.prepared_dir` (default <workdir>/corpus), or llm.c token shards, read in place.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from transformer.data import corpus, prepare, shards, sources, stream
from transformer.data.tokenizers import (
  IdsTokenizer,
  Tokenizer,
  load_tokenizer,
  save_whole,
  tokenizer_from_file,
)

_WAIT_SECONDS = 2.0  # how often a process polls for the corpus that process 0 prepares
_VOCAB_PROBE = 2**20  # tokens of the first shard checked against the vocabulary at start
_EXAMPLE_CHUNK = 2**16  # eval tokens read at a time for the decoded examples


def prepared_dir(cfg, workdir: str | None) -> str:
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
    prepare.prepare(cfg, out, workers=cfg.prepare_workers)
  while not prepare.is_prepared(out):
    time.sleep(_WAIT_SECONDS)
  meta = prepare.read_dataset(out)
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


@dataclasses.dataclass(eq=False)
class StreamTask:
  """The Task of task='corpus': the same three methods as `tasks.Task`."""

  name: str
  family: str
  tokenizer: Tokenizer
  info: dict
  _train: stream.TokenStream = dataclasses.field(repr=False)
  _eval: stream.TokenStream = dataclasses.field(repr=False)
  _options: dict = dataclasses.field(repr=False)
  _eval_options: dict = dataclasses.field(repr=False)
  _seed: int = 0
  prompt_prefix: list = dataclasses.field(default_factory=list)  # ids before a prompt
  _eval_cache: list | None = dataclasses.field(default=None, repr=False)
  _train_eval_cache: list | None = dataclasses.field(default=None, repr=False)

  def train_iterator(self) -> stream.StreamIterator:
    return stream.StreamIterator(self._train, seed=self._seed, **self._options)

  def eval_batches(self) -> list[dict[str, np.ndarray]]:
    if self._eval_cache is None:
      self._eval_cache = stream.eval_batches(self._eval, **self._eval_options)
    return self._eval_cache

  def train_eval_batches(self) -> list[dict[str, np.ndarray]]:
    """As many rows of the training split as `eval_batches` holds, at evenly spaced windows: the
    training loss measured as the eval loss is, beside it."""
    if self._train_eval_cache is None:
      options = dict(self._eval_options, num_batches=len(self.eval_batches()), spread=True)
      self._train_eval_cache = stream.eval_batches(self._train, **options)
    return self._train_eval_cache

  def eval_examples(self, n: int) -> list[tuple[str, str]]:
    """The first n eval documents of this process as (first half, second half) of their words;
    none for token-id shards read without their tokenizer. A running text (task='text') gives n
    eval rows instead, each as (its first half, its second half)."""
    if self.tokenizer.kind == 'ids' or not n:
      return []
    if self.name == 'text':
      return self._text_examples(n)
    process, count = self._options['process'], self._options['process_count']
    separator, tokens, start = self._options['separator'], [], 0
    while start < len(self._eval):  # read on until n documents of this process are whole
      tokens.append(self._eval.read(start, min(_EXAMPLE_CHUNK, len(self._eval) - start)))
      start += len(tokens[-1])
      if np.count_nonzero(np.concatenate(tokens) == separator) > (n + 1) * count:
        break
    tokens = np.concatenate(tokens)
    docs = np.split(tokens, np.flatnonzero(tokens == separator))
    docs = [d[1:] for d in docs if len(d) > 1][process::count][:n]
    out = []
    for doc in docs:
      words = self.tokenizer.decode(doc.tolist()).split(' ')
      half = max(1, len(words) // 2)
      out.append((' '.join(words[:half]), ' '.join(words[half:])))
    return out

  def _text_examples(self, n: int) -> list[tuple[str, str]]:
    length, process = self._options['length'], self._options['process']
    half, available = length // 2, stream.eval_rows(len(self._eval), length, self.family)
    rows = min(n, available)
    out = []
    for r in range(process * rows, (process + 1) * rows):
      tokens = self._eval.read(r % available * length, length).tolist()
      out.append((self.tokenizer.decode(tokens[:half]), self.tokenizer.decode(tokens[half:])))
    return out


def stream_task(
  name, cfg, family, tokenizer, info, train, evaluation, separator, seed, process_index,
  process_count, prompt_prefix,
) -> StreamTask:  # fmt: skip
  """A StreamTask over two token streams, with the batching knobs of `cfg` (config.data)."""
  options = dict(
    family=family,
    length=cfg.max_length,
    global_rows=cfg.batch_size,
    process=process_index,
    process_count=process_count,
    separator=separator,
    pack=bool(cfg.pack),
    vocab_size=tokenizer.vocab_size,
    mlm_prob=cfg.mlm_prob,
    mask_id=getattr(tokenizer, 'mask_id', None),
    special=_special_ids(tokenizer, separator),
  )
  eval_options = dict(options, global_rows=cfg.eval_batch_size, num_batches=cfg.eval_batches)
  options['sampling'] = cfg.sampling
  return StreamTask(
    name, family, tokenizer, info, train, evaluation, options, eval_options, seed,
    list(prompt_prefix),
  )  # fmt: skip


def build(cfg, *, family: str, workdir, seed: int, process_index: int, process_count: int):
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
  if family == 'bidirectional_lm' and getattr(tokenizer, 'mask_id', None) is None:
    raise ValueError(f'MLM needs a tokenizer with a mask token; the {tokenizer.kind} one has none')
  info = {
    'tokenizer': tokenizer.kind,
    'vocab_size': tokenizer.vocab_size,
    'train_shards': len(found['train']),
    'train_tokens': len(train),
    'eval_tokens': len(evaluation),
    'train_rows_per_epoch': len(train) / cfg.max_length,
    'tokens_kept': 1.0,  # every token is read: nothing is cut
    'sampling': cfg.sampling,
  }
  if 'meta' in found:
    info['num_train_documents'] = found['meta']['documents']
  return stream_task(
    'corpus', cfg, family, tokenizer, info, train, evaluation, separator, seed, process_index,
    process_count, prompt_prefix=[separator],
  )  # fmt: skip


def _special_ids(tokenizer: Tokenizer, separator: int) -> tuple[int, ...]:
  """Ids that MLM never masks: the tokenizer's specials and the document separator."""
  names = ('pad_id', 'bos_id', 'eos_id', 'mask_id', 'unk_id')
  found = {getattr(tokenizer, n, None) for n in names} | {separator}
  return tuple(sorted(i for i in found if i is not None))


def _cache_tokenizer(tokenizer: Tokenizer, workdir: str, process_index: int) -> None:
  """workdir/tokenizer holds the corpus's tokenizer (for transformer.load and resumes); a
  different one there means the run's checkpoints were trained on another vocabulary."""
  cache = os.path.join(workdir, 'tokenizer')
  if os.path.exists(cache):
    _same_tokenizer(tokenizer, load_tokenizer(cache), 'the corpus', f'{cache!r}')
  elif process_index == 0:
    save_whole(tokenizer, cache)
