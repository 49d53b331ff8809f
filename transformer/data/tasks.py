"""`build(cfg, ...)` -> a Task: a tokenizer and one token source, which gives resumable training
batches and fixed eval batches.

The source is examples tokenised into memory once (generated tasks, 'text' lines, 'tsv', TFDS; a
process keeps only its shard), shuffled, packed or bucketed by `batching`; or a token stream cut
into rows by `stream`: a corpus's prepared shards (`prepare`) or a running text
(`text_stream`). Both are deterministic and resume exactly.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections.abc import Iterable
from typing import Protocol

import ml_collections
import numpy as np

from transformer import util
from transformer.config import experiment
from transformer.config.experiment import DataConfig
from transformer.data import (
  batching,
  grammar,
  number_words,
  prepare,
  recall,
  sources,
  stream,
  text_stream,
)
from transformer.data.tokenizers import (
  BOS_ID,
  ByteTokenizer,
  CharTokenizer,
  Tokenizer,
  load_tokenizer,
  train_sentencepiece,
)
from transformer.data.tokenizers import save_whole as _save_whole

TASKS = ('numbers', 'grammar', 'recall', 'text', 'tsv', 'tfds', 'corpus')  # corpus: streamed shards
# char: the characters of the training text; hf: an imported model's own, in workdir/tokenizer
TOKENIZERS = ('byte', 'char', 'sentencepiece', 'hf')
_CHUNK = 4096  # examples tokenised at a time
_CHARS_PER_TOKEN = 64  # texts are cut to this many characters per allowed token (see max_chars)


def default_config() -> ml_collections.ConfigDict:
  """The data knobs and defaults: `config.data` of the default experiment (`DataConfig` in
  transformer/config/experiment.py explains each), to override and then type for `build` with
  `experiment.section(DataConfig, cfg)`."""
  config = experiment.default_configdict()
  config.data.max_length = config.model.max_length  # as a run resolves it (follows the model)
  return config.data


class Source(Protocol):
  """Where a task's tokens come from: examples held in memory (`batching.ExampleSource`) or a
  token stream, shards or a running text (`stream.StreamSource`)."""

  def train_iterator(self) -> batching.Resumable: ...

  def eval_batches(self) -> list[dict[str, np.ndarray]]: ...

  def train_eval_batches(self, count: int) -> list[dict[str, np.ndarray]]: ...

  def eval_documents(self, n: int, tokenizer: Tokenizer) -> list[str | tuple[str, str]]: ...


@dataclasses.dataclass(eq=False)
class Task:
  """A built data task: its tokenizer and info, and the batches of its token `source`."""

  name: str
  family: str
  tokenizer: Tokenizer
  info: dict
  source: Source = dataclasses.field(repr=False)
  prompt_prefix: list = dataclasses.field(default_factory=list)  # ids before a prompt
  _cache: dict = dataclasses.field(default_factory=dict, repr=False)

  def train_iterator(self) -> batching.Resumable:
    """A fresh infinite iterator over this process's training batches, from the start."""
    return self.source.train_iterator()

  def eval_batches(self) -> list[dict[str, np.ndarray]]:
    """This process's eval batches, fixed for every seed: padded rows weigh 0, and every process
    gets the same number."""
    if 'eval' not in self._cache:
      self._cache['eval'] = self.source.eval_batches()
    return self._cache['eval']

  def train_eval_batches(self) -> list[dict[str, np.ndarray]]:
    """Training rows formatted as eval batches, as many as `eval_batches` (fewer for a smaller
    training set): the training loss measured as the eval loss is, beside it."""
    if 'train' not in self._cache:
      self._cache['train'] = self.source.train_eval_batches(len(self.eval_batches()))
    return self._cache['train']

  def eval_examples(self, n: int) -> list[tuple[str, str]]:
    """The first n eval examples of this process as (source, reference) strings.

    Translation pairs stay (source, target); a document is split in half at its middle word:
    (prompt, continuation).
    """
    return [_halves(x) for x in self.source.eval_documents(n, self.tokenizer)]


def _halves(example: str | tuple[str, str]) -> tuple[str, str]:
  if isinstance(example, tuple):
    return example
  words = example.split(' ')
  half = max(1, len(words) // 2)
  return ' '.join(words[:half]), ' '.join(words[half:])


def running_text(cfg: DataConfig, family: str) -> bool:
  """Whether a model of `family` trained on `cfg` read one running text (task='text' as a
  stream): no bos, no document ends."""
  return cfg.task == 'text' and family != 'encoder_decoder' and cfg.text_format == 'stream'


def prompt_prefix(cfg: DataConfig, family: str, tokenizer: Tokenizer) -> list[int] | None:
  """The ids a prompt starts with, as the training rows did: [] after a running text, the
  document separator (eos) after a corpus; None (the caller's bos) for everything else."""
  if running_text(cfg, family):
    return []
  if cfg.task == 'corpus' and getattr(tokenizer, 'eos_id', None) is not None:
    return [int(tokenizer.eos_id)]
  return None


def repeat_subset(train: list, fraction: float, subset: int, seed: int = 0) -> tuple[list, dict]:
  """The training examples with `fraction` of them drawn from a small repeated subset (Hernandez
  et al. 2022): the last `subset` examples are set aside, round(fraction * n) slots cycle through
  them, and the other slots keep distinct fresh examples; the order is shuffled by `seed`. Same
  number of examples n as before. Returns (examples, info) with `repeat_epochs`, how many times
  each repeated example is seen per pass."""
  n = len(train)
  if not 1 <= subset < n:
    raise ValueError(
      f'data.repeat_subset={subset} must be at least 1 and fewer than the {n} training examples'
    )
  repeated = round(fraction * n)
  pool, fresh = train[n - subset :], train[: min(n - repeated, n - subset)]
  examples = fresh + [pool[i % subset] for i in range(n - len(fresh))]
  order = np.random.default_rng([seed, 7]).permutation(len(examples))
  info = {'repeat_fraction': (n - len(fresh)) / n, 'repeat_epochs': (n - len(fresh)) / subset}
  return [examples[i] for i in order], info


def _raw_data(cfg, family: str, seed: int) -> tuple[str, Iterable, list, dict]:
  """(kind, train examples, eval examples, info); kind 'pairs' or 'text'. `seed` is the run's:
  recall's data follow it when data.recall_seed is None."""
  task = cfg.task
  if task == 'numbers':
    train, evaluation, info = number_words.generate(cfg)
    return 'pairs', train, evaluation, info
  if task == 'grammar':
    train, evaluation, info = grammar.generate(cfg)
    return 'text', train, evaluation, info
  if task == 'recall':
    train, evaluation, info = recall.generate(cfg, seed)
    return 'text', train, evaluation, info
  if task in ('text', 'tsv'):
    columns = 1 if task == 'text' else 2
    bad_lines = cfg.bad_lines
    train = sources.read_lines(cfg.train_path, 'train_path', columns, bad_lines=bad_lines)
    if cfg.eval_path:
      evaluation = sources.read_lines(cfg.eval_path, 'eval_path', columns, bad_lines=bad_lines)
    else:
      held = max(64, len(train) // 100)
      if len(train) <= held:
        raise ValueError(
          f'train_path={cfg.train_path!r} has {len(train)} usable lines, too few to hold out '
          f'{held} for evaluation; add lines or set eval_path'
        )
      train, evaluation = train[:-held], train[-held:]
    return ('text' if task == 'text' else 'pairs'), train, evaluation, {}
  if task == 'tfds':
    name, data_dir = cfg.tfds_name, cfg.tfds_data_dir
    features = sources.tfds_features(name, data_dir)
    if family != 'encoder_decoder' and cfg.tfds_text_key in features:
      kind, keys = 'text', (cfg.tfds_text_key,)
    else:
      kind, keys = 'pairs', (cfg.source_lang, cfg.target_lang)

    bad_lines = cfg.bad_lines

    class _Train:  # re-iterable: SentencePiece training and tokenisation each read the split
      def __iter__(self):
        return sources.tfds_examples(name, cfg.tfds_train_split, data_dir, keys, bad_lines)

    evaluation = list(sources.tfds_examples(name, cfg.tfds_eval_split, data_dir, keys, bad_lines))
    return kind, _Train(), evaluation, {}
  raise ValueError(f'unknown task={task!r}; choose one of {TASKS}')


def _tokenizer(
  cfg, train: Iterable, workdir: str | None, process_index: int, evaluation: Iterable = ()
) -> Tokenizer:
  """The byte tokenizer, or a char or SentencePiece one loaded from workdir/tokenizer or built
  (chars: of `train` and `evaluation`) or trained (SentencePiece: on `train`), and cached.

  workdir/tokenizer is written whole (a temp directory renamed into place) and never replaced:
  a later build loads it, and fails if the config asks for a different tokenizer.
  """
  if cfg.tokenizer not in TOKENIZERS:
    raise ValueError(f'unknown tokenizer={cfg.tokenizer!r}; choose one of {TOKENIZERS}')
  cache = os.path.join(workdir, 'tokenizer') if workdir else None
  if cache and os.path.exists(cache):
    return _cached_tokenizer(cache, cfg)
  if cache and cfg.tokenizer != 'byte' and util.has_checkpoints(workdir):
    raise ValueError(
      f'{workdir!r} has checkpoints but no tokenizer/ directory, and a newly trained '
      f'{cfg.tokenizer} tokenizer may number its pieces differently from the one their '
      'embeddings were trained with; restore that tokenizer/ or use a new workdir'
    )
  if cfg.tokenizer == 'hf':
    raise ValueError(
      f"tokenizer='hf' is an imported model's own tokenizer, and {cache!r} holds none; "
      'import the model with its tokenizer.json (experiments.convert_hf)'
    )
  if cfg.tokenizer == 'byte':
    tokenizer = ByteTokenizer()
  elif cfg.tokenizer == 'char':
    texts = itertools.chain(train, evaluation)
    tokenizer = CharTokenizer.from_texts(x for ex in texts for x in _texts(ex))
  else:
    lines = []  # every process trains on the same lines (single-threaded, so identical models)
    for example in itertools.islice(train, cfg.spm_train_lines):
      lines += [example] if isinstance(example, str) else list(example)
    tokenizer = train_sentencepiece(lines, cfg.vocab_size)
  if cache and process_index == 0 and not _save_whole(tokenizer, cache):
    return _cached_tokenizer(cache, cfg)  # another process saved one first: use (and check) it
  return tokenizer


def _texts(example: str | tuple) -> tuple:
  return (example,) if isinstance(example, str) else tuple(example)


def _cached_tokenizer(cache: str, cfg) -> Tokenizer:
  """The tokenizer saved in `cache`, if it is the one `cfg` asks for; else one ValueError."""
  try:
    tokenizer = load_tokenizer(cache)
  except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
    raise ValueError(
      f'{cache!r} holds no readable tokenizer ({type(e).__name__}: {e}); sparrow writes it whole, '
      'so it was changed by hand: restore it, or delete it if the workdir has no checkpoints'
    ) from None
  requested = getattr(tokenizer, 'requested_vocab_size', None)
  if tokenizer.kind != cfg.tokenizer or (requested and requested != cfg.vocab_size):
    raise ValueError(
      f'{cache!r} holds a {tokenizer.kind} tokenizer (vocab_size={requested}) but the config '
      f'asks for {cfg.tokenizer} (vocab_size={cfg.vocab_size}); use a new workdir or delete it'
    )
  return tokenizer


def max_chars(lengths) -> int:
  """Characters of one text kept before tokenising: far more than `max(lengths)` tokens need.

  A SentencePiece piece spans at most 16 characters (BPE pieces rarely over 64), so a cut text
  still gives far more tokens than are kept, and a 50 MB line costs no more than a long one.
  """
  return _CHARS_PER_TOKEN * max(lengths) + 1024


def _check_ids(part: batching.Ragged, tokenizer, where: str, indices: list, texts: list) -> None:
  """Raises one ValueError naming the first token id outside [0, tokenizer.vocab_size)."""
  flat, vocab_size = part.flat, tokenizer.vocab_size
  if not flat.size or (flat.min() >= 0 and flat.max() < vocab_size):
    return
  position = int(np.flatnonzero((flat < 0) | (flat >= vocab_size))[0])
  row = int(np.searchsorted(part.offsets, position, side='right')) - 1
  raise ValueError(
    f'the {tokenizer.kind} tokenizer gave token id {int(flat[position])}, outside its '
    f'vocab_size={vocab_size} (valid ids 0..{vocab_size - 1}), for {where} example '
    f'{indices[row]} ({texts[row][:60]!r}); the tokenizer files are inconsistent: rebuild them'
  )


def _tokenize(examples: Iterable, num_parts: int, tokenizer, family: str, lengths, shard, where):
  """Tokenises and truncates this process's examples (index % count == process).

  Texts are first cut to `max_chars(lengths)` characters; every kept token id is checked to lie
  in [0, tokenizer.vocab_size). `where` names the split in errors (e.g. "data.train_path='a.txt'").

  Returns:
    (Examples, number of examples in the whole split, this shard's stats dict). The token
    counts in the stats are of the cut texts.
  """
  process, count = shard
  dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.int32
  chunks, buffer, indices, total, kept_count, truncated = [], [], [], 0, 0, 0
  token_sums, token_max = None, None
  cap = max_chars(lengths)

  def flush():
    nonlocal truncated, token_sums, token_max
    columns = list(zip(*[(x,) if isinstance(x, str) else x for x in buffer]))
    columns = [[text[:cap] for text in col] for col in columns]
    encoded = [tokenizer.encode_batch(col) for col in columns]  # [parts][examples][tokens]
    per_example = list(zip(*encoded))
    sizes = np.array([[len(p) for p in ex] for ex in per_example])  # [examples, parts]
    token_sums = sizes.sum(0) + (0 if token_sums is None else token_sums)
    token_max = sizes.max(0) if token_max is None else np.maximum(token_max, sizes.max(0))
    kept = []
    for ex in per_example:
      parts, cut = batching.truncate(family, ex, *lengths)
      kept.append(parts)
      truncated += cut
    ragged = [batching.Ragged.from_lists(p, np.int64) for p in zip(*kept)]
    for part, texts in zip(ragged, columns):
      _check_ids(part, tokenizer, where, indices, texts)
    chunks.append([batching.Ragged(p.flat.astype(dtype), p.offsets) for p in ragged])
    buffer.clear()
    indices.clear()

  for index, example in enumerate(examples):
    total += 1
    if index % count == process:
      buffer.append(example)
      indices.append(index)
      kept_count += 1
      if len(buffer) == _CHUNK:
        flush()
  if buffer:
    flush()
  parts = tuple(batching.Ragged.concatenate(p, dtype) for p in zip(*chunks, strict=True))
  parts = parts or tuple(batching.Ragged.concatenate([], dtype) for _ in range(num_parts))
  names = ['tokens'] if num_parts == 1 else ['source_tokens', 'target_tokens']
  stats = {'truncated': truncated}
  for name, s, m in zip(names, token_sums if kept_count else [], token_max if kept_count else []):
    stats |= {f'{name}_mean': float(s) / kept_count, f'{name}_max': int(m)}
  return batching.Examples(parts), total, stats


def _cut(example: str | tuple, limit: int) -> str | tuple:
  return example[:limit] if isinstance(example, str) else tuple(x[:limit] for x in example)


def _origins(cfg) -> tuple[str, str]:
  """How errors name the train and eval splits of `cfg`."""
  if cfg.task in ('text', 'tsv'):
    train = f'data.train_path={cfg.train_path!r}'
    return train, (f'data.eval_path={cfg.eval_path!r}' if cfg.eval_path else f'held-out {train}')
  if cfg.task == 'tfds':
    return f'{cfg.tfds_name} {cfg.tfds_train_split}', f'{cfg.tfds_name} {cfg.tfds_eval_split}'
  return f'{cfg.task} train', f'{cfg.task} eval'


def build(
  cfg: DataConfig,
  *,
  family: str,
  workdir: str | None,
  seed: int,
  process_index: int = 0,
  process_count: int = 1,
) -> Task:
  """Builds the data task described by `cfg` (see `default_config`) for one model family.

  Args:
    cfg: the typed data knobs: `Config.from_configdict(config).data` of an experiment.
    family: 'encoder_decoder', 'causal_lm' or 'bidirectional_lm' (decides the batch format).
    workdir: where the trained SentencePiece model is cached (workdir/tokenizer); None = no cache.
    seed: drives the training order and MLM masking (the generated data depend only on the task
      knobs, and eval batches are the same for every seed).
    process_index, process_count: this process keeps the examples whose index in the split is
      process_index modulo process_count.

  Returns:
    A Task whose batches are per-process: batch_size // process_count rows each.
  """
  _check_build_arguments(cfg, family, seed, process_index, process_count)
  shard = dict(process_index=process_index, process_count=process_count)
  task = _streamed_task(cfg, family=family, workdir=workdir, seed=seed, **shard)
  if task is not None:
    return task
  return _in_memory_task(cfg, family=family, workdir=workdir, seed=seed, **shard)


def _check_build_arguments(
  cfg: DataConfig, family: str, seed: int, process_index: int, process_count: int
) -> None:
  """Refuses a config, family, process shard, batch size or seed that `build` cannot serve."""
  if not isinstance(cfg, DataConfig):
    raise TypeError(
      f'data.build takes the typed DataConfig, not a {type(cfg).__name__}; pass '
      'Config.from_configdict(config).data or experiment.section(DataConfig, config.data)'
    )
  if family not in batching.FAMILIES:
    raise ValueError(f'unknown family={family!r}; choose one of {batching.FAMILIES}')
  if not 0 <= process_index < process_count:
    raise ValueError(f'process_index={process_index} must be in [0, process_count={process_count})')
  for key in ('batch_size', 'eval_batch_size'):
    rows = getattr(cfg, key)
    if rows < process_count or rows % process_count:
      raise ValueError(f'{key}={rows} is not a positive multiple of process_count={process_count}')
  if seed < 0:
    raise ValueError(f'seed={seed} must be >= 0')


def _streamed_task(
  cfg: DataConfig,
  *,
  family: str,
  workdir: str | None,
  seed: int,
  process_index: int,
  process_count: int,
) -> Task | None:
  """The task of a corpus or of running text, streamed; None for a task held in memory."""
  streamed = cfg.task in ('corpus', 'tfds') or running_text(cfg, family)
  if cfg.repeat_fraction and streamed:
    raise ValueError(
      f'data.repeat_fraction={cfg.repeat_fraction} repeats examples of a training set held in '
      f"memory; task={cfg.task!r} streams it. Use a built-in task, 'text' (lines) or 'tsv'"
    )
  if cfg.task == 'corpus':
    if cfg.tokenizer == 'char':
      raise ValueError(
        "tokenizer='char' reads its vocabulary from the whole text, which task='text' holds in "
        "memory; a corpus (task='corpus') uses 'byte', 'sentencepiece' or data.tokenizer_path"
      )
    found = prepare.streams(cfg, family=family, workdir=workdir, process_index=process_index)
  elif running_text(cfg, family):

    def tokenizer_for(texts: list[str]) -> Tokenizer:
      if cfg.tokenizer == 'sentencepiece':  # trained on lines: it skips very long sentences
        texts = [line for text in texts for line in text.splitlines()]
      return _tokenizer(cfg, texts, workdir, process_index)

    found = text_stream.build(cfg, family=family, tokenizer_for=tokenizer_for)
  else:
    return None
  tokenizer, info, train, evaluation, separator = found
  if family == 'bidirectional_lm' and getattr(tokenizer, 'mask_id', None) is None:
    raise ValueError(f'MLM needs a tokenizer with a mask token; the {tokenizer.kind} one has none')
  info = {
    'tokenizer': tokenizer.kind,
    'vocab_size': tokenizer.vocab_size,
    'train_tokens': len(train),
    'eval_tokens': len(evaluation),
    'train_rows_per_epoch': len(train) / cfg.max_length,
    'sampling': cfg.sampling,
    **info,
  }
  layout = stream.Layout(
    family=family,
    length=cfg.max_length,
    separator=separator,
    pack=bool(cfg.pack),
    vocab_size=tokenizer.vocab_size,
    process=process_index,
    process_count=process_count,
    mlm_prob=cfg.mlm_prob,
    mask_id=getattr(tokenizer, 'mask_id', None),
    special=_special_ids(tokenizer, separator),
  )
  corpus = cfg.task == 'corpus'  # else a running text: its eval examples are rows
  source = stream.StreamSource(
    train, evaluation, layout, cfg.batch_size, cfg.eval_batch_size, cfg.eval_batches, seed,
    cfg.sampling, documents=corpus,
  )  # fmt: skip
  prefix = [separator] if corpus else []  # as the training rows start
  return Task(cfg.task, family, tokenizer, info, source, prompt_prefix=prefix)


def _special_ids(tokenizer: Tokenizer, separator: int) -> tuple[int, ...]:
  """Ids that MLM never masks: the tokenizer's specials and the document separator."""
  names = ('pad_id', 'bos_id', 'eos_id', 'mask_id', 'unk_id')
  found = {getattr(tokenizer, n, None) for n in names} | {separator}
  return tuple(sorted(i for i in found if i is not None))


def _in_memory_task(
  cfg: DataConfig,
  *,
  family: str,
  workdir: str | None,
  seed: int,
  process_index: int,
  process_count: int,
) -> Task:
  """The task of examples held in memory: generated, TFDS, 'text' lines or 'tsv' pairs."""
  target_length = cfg.max_target_length if family == 'encoder_decoder' else cfg.max_length

  kind, train_raw, eval_raw, task_info = _raw_data(cfg, family, seed)
  if cfg.repeat_fraction:
    train_raw, repeated = repeat_subset(train_raw, cfg.repeat_fraction, int(cfg.repeat_subset))
    task_info = {**task_info, **repeated}
  if kind == 'text' and family == 'encoder_decoder':
    raise ValueError(
      f"family='encoder_decoder' needs (source, target) pairs but task={cfg.task!r} gives single "
      "documents; use task='numbers', 'tsv' or a TFDS translation dataset"
    )
  tokenizer = _tokenizer(cfg, train_raw, workdir, process_index, eval_raw)
  lengths = (target_length, cfg.max_source_length)
  shard = (process_index, process_count)
  num_parts = 1 if kind == 'text' else 2
  train_origin, eval_origin = _origins(cfg)
  train, num_train, train_stats = _tokenize(
    train_raw, num_parts, tokenizer, family, lengths, shard, train_origin
  )
  if not len(train):
    raise ValueError(
      f'process {process_index} of {process_count} got no training examples out of {num_train}'
    )
  evaluation, num_eval, eval_stats = _tokenize(
    eval_raw, num_parts, tokenizer, family, lengths, shard, eval_origin
  )

  eval_rows = cfg.eval_batch_size // process_count
  info = {
    **task_info,
    'tokenizer': tokenizer.kind,
    'vocab_size': tokenizer.vocab_size,
    'num_train_examples': num_train,
    'num_eval_examples': num_eval,
    'truncated_train': train_stats.pop('truncated'),  # counts over this process's shard
    'truncated_eval': eval_stats.pop('truncated'),
    **{f'train_{k}': v for k, v in train_stats.items()},
  }
  if cfg.task == 'grammar':
    info |= _grammar_token_info(task_info, train_raw, tokenizer)
  source = batching.ExampleSource(
    train=train,
    evaluation=evaluation,
    documents=[_cut(x, max_chars(lengths)) for x in eval_raw[process_index::process_count]],
    batcher=_batcher(cfg, family, tokenizer),
    rows=cfg.batch_size // process_count,
    eval_rows=eval_rows,
    num_eval_batches=math.ceil(math.ceil(num_eval / process_count) / eval_rows),
    seed=seed,
    pack=bool(cfg.pack),
    process=process_index,
  )
  name = cfg.tfds_name if cfg.task == 'tfds' else cfg.task
  return Task(name, family, tokenizer, info, source, prompt_prefix=[BOS_ID])


def _batcher(cfg: DataConfig, family: str, tokenizer: Tokenizer) -> batching.Batcher:
  """The Batcher that pads, buckets and masks this task's examples into batches."""
  if family == 'encoder_decoder':
    max_lengths = {'inputs': cfg.max_source_length, 'targets': cfg.max_target_length}
  else:
    max_lengths = {'': cfg.max_length}
  return batching.Batcher(
    family=family,
    max_lengths=max_lengths,
    buckets={s: batching.bucket_lengths(n, cfg.buckets) for s, n in max_lengths.items()},
    vocab_size=tokenizer.vocab_size,
    mlm_prob=cfg.mlm_prob,
    scored=_scored(cfg, family),
  )


def _scored(cfg, family: str) -> tuple[int, ...] | None:
  """The target positions that carry loss (Batcher.scored): recall's answers, or None = all."""
  if cfg.task != 'recall' or cfg.recall_loss == 'all':
    return None
  if family != 'causal_lm':
    raise ValueError(
      f'recall_loss={cfg.recall_loss!r} scores answers of a causal LM; family={family!r} is not '
      "one; use recall_loss='all'"
    )
  if cfg.tokenizer not in ('byte', 'char'):
    raise ValueError(
      f'recall_loss={cfg.recall_loss!r} finds the answers by character offset and needs one '
      f"token per character: data.tokenizer='byte' or 'char', not {cfg.tokenizer!r}"
    )
  knobs = int(cfg.recall_pairs), int(cfg.recall_gap), int(cfg.recall_queries)
  return recall.scored_positions(*knobs)


def _grammar_token_info(task_info: dict, documents: list[str], tokenizer) -> dict:
  """Converts the grammar's per-word entropies to per-token floors with this tokenizer.

  A word ('.' and the document end included) costs tokens_per_word tokens on average, measured on
  up to 2000 training documents with eos counted, so the loss per target token of a causal LM
  cannot go below entropy_per_word / tokens_per_word (for documents that are not truncated).
  """
  sample = documents[:2000]
  tokens = sum(len(tokenizer.encode(d)) + 1 for d in sample)  # + eos
  words = sum(len(d.split()) + d.count('.') + 1 for d in sample)  # + END
  per_word = tokens / words
  return {
    'tokens_per_word': per_word,
    'entropy_per_token': task_info['entropy_per_word'] / per_word,
    'unigram_entropy_per_token': task_info['unigram_entropy_per_word'] / per_word,
  }
