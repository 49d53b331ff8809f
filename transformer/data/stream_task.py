"""task='corpus': the token streams of a language-model task, read from shards (see `stream`).

`data.train_path` is either a corpus (text, jsonl, Parquet), prepared once into shards under
`data.prepared_dir` (default <workdir>/corpus), or llm.c token shards, read in place.
"""

from __future__ import annotations

import os
import time

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


def build(cfg, *, family: str, workdir: str | None, process_index: int) -> tuple:
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
