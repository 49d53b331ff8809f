"""An experiment's knobs beside the model's: data, train, optim and mesh, each a frozen dataclass
that holds every default once with a one-line comment, and `Config`, the whole experiment.

`default_configdict()` renders them as the ConfigDict that `configs/base.py` returns and every
experiment file overrides; flags override it further (`--config.model.num_kv_heads=4`).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

import ml_collections

from transformer.config import ModelConfig

# The names a knob may choose, beside the dataclasses that check them.
TEXT_FORMATS = ('stream', 'lines')  # data.text_format
SAMPLINGS = ('random', 'sequential')  # data.sampling: where training rows start
BAD_LINES = ('error', 'skip')  # data.bad_lines
FUSED_LOSS = ('auto', 'on', 'off')  # train.fused_loss
NONFINITE_POLICIES = ('auto', 'skip', 'halt', 'rollback')  # train.nonfinite
SCHEDULES = ('rsqrt', 'warmup_cosine', 'cosine_restarts', 'constant', 'linear')  # optim.schedule
OPTIMIZERS = ('adam', 'adamw')  # optim.optimizer

# key -> the smallest valid value, for the integer knobs of config.data.
DATA_MIN_INT = {
  'batch_size': 1,
  'eval_batch_size': 1,
  'vocab_multiple': 1,
  'spm_train_lines': 1,
  'max_length': 2,  # room for a token and eos
  'max_source_length': 2,
  'max_target_length': 2,
  'num_train_examples': 1,
  'num_eval_examples': 1,
  'grammar_words': 1,
  'grammar_join': 1,
  'grammar_successors': 0,
  'grammar_classes': 0,
  'numbers_skip_digits': 0,
  'repeat_subset': 1,
  'grammar_seed': 0,
  'vocab_size': 7,  # more than the 5 special ids + 1
  'prepare_workers': 0,  # 0 = one per core
  'prepare_chunk_mb': 1,
  'eval_batches': -1,  # -1 = auto
}
# key -> the smallest valid value, for the integer knobs of config.train.
TRAIN_MIN_INT = {
  'steps': 1,
  'grad_accum_steps': 1,
  'log_every': 1,
  'head_entropy_every': 0,  # 0 = off
  'induction_every': 0,  # 0 = off
  'eval_every': 1,
  'checkpoint_every': 1,
  'keep_checkpoints': 1,
  'num_samples': 0,
  'eval_decode_examples': 0,
  'max_decode_length': 1,
  'loss_scale_period': 1,
}


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """What `transformer.data.build(config.data, ...)` reads: the task, tokenizer and batches."""

  task: str = (
    'numbers'  # numbers | grammar | recall (built-in) | text | tsv (files) | tfds | corpus
  )
  train_path: str = ''  # text/tsv: file path or glob; tsv = src<TAB>tgt lines
  eval_path: str = ''  # text/tsv: '' holds out the end of train_path (eval_fraction, or lines)
  # text for the LMs: stream (the file is one running text, cut into rows, as nanoGPT) | lines (a
  # document per line; '' eval_path holds out the last max(64, 1%) lines)
  text_format: str = 'stream'
  eval_fraction: float = 0.1  # text streams: the last this fraction of the tokens is the eval split
  # streams (text, corpus): training rows start at random offsets (nanoGPT) | sequential (every
  # token once an epoch, in order); both are deterministic from the seed and resume exactly
  sampling: str = 'random'
  # corpus: train_path/eval_path are globs of text, .jsonl(.gz/.zst) or Parquet files (prepared
  # once into token shards, then streamed), or of llm.c .bin shards (read in place).
  prepared_dir: str = ''  # corpus: where the token shards are prepared; '' = <workdir>/corpus
  prepare_workers: int = 0  # corpus: processes that tokenise it; 0 = one per core (>= 32 MB)
  prepare_chunk_mb: int = 16  # corpus: MB of plain text per shard (a .gz/.zst file, row group: one)
  tokenizer_path: str = ''  # corpus: an existing SentencePiece .model or HF tokenizer.json to use
  # streams: eval batches from the start of the eval split; 0 = all of it, -1 = all of it up to
  # 4M tokens, else 20
  eval_batches: int = -1
  bad_lines: str = 'error'  # text/tsv/tfds: error | skip (bad UTF-8, columns; counted); blanks skip
  tfds_name: str = 'wmt14_translate/de-en'  # tfds: dataset name, e.g. 'wmt17_translate/de-en'
  tfds_data_dir: str = (
    ''  # tfds: where datasets are stored; '' = TFDS default (~/tensorflow_datasets)
  )
  tfds_train_split: str = (
    'train'  # tfds: training split (any TFDS split string, e.g. 'train[:10%]')
  )
  tfds_eval_split: str = 'test'  # tfds: eval split (wmt14 'test' = newstest2014); slice big ones
  source_lang: str = 'en'  # tfds translation: feature used as the source
  target_lang: str = 'de'  # tfds translation: feature used as the target
  tfds_text_key: str = 'text'  # tfds LM datasets: the feature holding the text (lm1b: 'text')
  # byte (261 ids) | char (the text's characters) | sentencepiece (trained) | hf (a model's own)
  tokenizer: str = 'byte'
  vocab_size: int = 32000  # sentencepiece: target vocabulary size (tiny corpora may give fewer)
  vocab_multiple: int = (
    1  # the model's vocabulary is the tokenizer's rounded up to a multiple of this
  )
  spm_train_lines: int = 1_000_000  # sentencepiece: trains on at most this many training examples
  # LM families: tokens per row; None = model.max_length (set the context once, there); a
  # shorter one trains below the model's context. encoder_decoder ignores it
  max_length: int | None = None
  max_source_length: int = 256  # encoder_decoder: source tokens (incl. eos); LM pairs: source part
  max_target_length: int = 256  # encoder_decoder: target tokens (incl. eos)
  batch_size: int = (
    64  # GLOBAL training batch (rows); each process gets batch_size // process_count
  )
  eval_batch_size: int = 64  # GLOBAL eval batch (rows)
  pack: bool = False  # pack several examples per row (segments, positions restart per example)
  # Unpacked training batches are padded to the smallest bucket >= their longest example:
  # True = 8, 16, 32, ... (few shapes, few recompiles), False = always the max, or lengths.
  buckets: bool | tuple[int, ...] = False
  num_train_examples: int = 100_000  # numbers/grammar/recall: generated training examples
  num_eval_examples: int = 1_000  # numbers/grammar/recall: generated eval examples
  mlm_prob: float = 0.15  # bidirectional_lm: fraction of tokens masked and predicted
  numbers_max: int = 999_999  # numbers: largest number (>= 1000)
  numbers_direction: str = 'digits_to_words'  # numbers: digits_to_words | words_to_digits
  numbers_skip_digits: int = 0  # numbers: no example has this many digits (a gap); 0 = none
  grammar_seed: int = 0  # grammar: fixes the Markov chain and its documents
  grammar_words: int = 256  # grammar: number of word types
  grammar_join: int = 1  # grammar: documents joined into one example (long rows; extrapolation)
  grammar_successors: int = 0  # grammar: successors of each word (0: 2-6, the default chain)
  grammar_classes: int = 0  # grammar: word classes that share one next-word row; 0 = none
  grammar_holdout: float = 0.0  # grammar: share of word transitions kept out of training; 0 = off
  # Share of the training examples drawn, over and over, from a subset of repeat_subset examples
  # (repeated data, Hernandez et al. 2022); in [0, 1), 0 = off. Generated and text tasks only.
  repeat_fraction: float = 0.0
  repeat_subset: int = 100
  grammar_repeat: float = (
    0.0  # grammar: probability that an example is followed by a copy of itself
  )
  recall_pairs: int = 16  # recall: key-value pairs per example (distinct keys: <= recall_vocab)
  recall_gap: int = 64  # recall: filler tokens between the pairs and the queries
  recall_queries: int = 8  # recall: queried keys, each followed by its value (<= recall_pairs)
  recall_order: str = 'random'  # recall: query order, random (MQAR) | pairs (a fixed distance back)
  recall_filler: str = 'random'  # recall: filler digits random | constant (all '0')
  recall_loss: str = 'all'  # recall: tokens that carry loss, all | answers (Zoology's: the values)
  recall_seed: int | None = 0  # recall: fixes the generated examples; None: the run's seed does
  # recall: keys, and as many values; 26: a-z, A-Z; more: CJK (tokenizer char), distinct values
  recall_vocab: int = 26
  recall_disjoint: bool = False  # recall: drop the training examples that occur in the eval split

  def __post_init__(self):
    """Raises one ValueError naming the first knob no data source can work with, before any data
    is read, generated or written."""
    for key, minimum in DATA_MIN_INT.items():
      if key == 'max_length' and self.max_length is None:
        continue  # follows model.max_length (`Config.from_configdict`)
      check_int('data', self, key, minimum)
    check_fraction('data', self, 'mlm_prob', low_open=True, high_open=False)
    check_fraction('data', self, 'grammar_repeat', low_open=False, high_open=False)
    check_fraction('data', self, 'repeat_fraction', low_open=False, high_open=True)
    check_fraction('data', self, 'grammar_holdout', low_open=False, high_open=True)
    if self.grammar_holdout and self.task != 'grammar':
      raise ValueError(
        f'data.grammar_holdout={self.grammar_holdout!r} holds out transitions of the grammar '
        f"chain; data.task={self.task!r} has none: use task='grammar' or grammar_holdout=0"
      )
    for key, task in (('grammar_classes', 'grammar'), ('numbers_skip_digits', 'numbers')):
      if getattr(self, key) and self.task != task:
        raise ValueError(
          f'data.{key}={getattr(self, key)!r} changes the {task} task; data.task={self.task!r} '
          f"has no use for it: use task='{task}' or {key}=0"
        )
    if self.text_format not in TEXT_FORMATS:
      raise ValueError(
        f'data.text_format={self.text_format!r} is not valid; choose one of {TEXT_FORMATS}'
      )
    fraction = self.eval_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
      raise ValueError(f'data.eval_fraction={fraction!r} must be a number in (0, 1)')
    if self.sampling not in SAMPLINGS:
      raise ValueError(f'data.sampling={self.sampling!r} is not valid; choose one of {SAMPLINGS}')
    for key in ('train_path', 'eval_path', 'prepared_dir', 'tokenizer_path'):
      if not isinstance(getattr(self, key), str):
        raise ValueError(f'data.{key}={getattr(self, key)!r} must be a string (a path, or a glob)')
    if self.bad_lines not in BAD_LINES:
      raise ValueError(f'bad_lines={self.bad_lines!r} is not valid; choose one of {BAD_LINES}')


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The objective and the training loop: steps, evaluation, checkpoints and faults."""

  steps: int = 2000  # optimizer steps in the run
  label_smoothing: float = 0.1  # paper: 0.1; 0 = plain cross-entropy
  grad_accum_steps: int = 1  # micro-batches per step (the data batch is split into this many)
  fused_loss: str = 'auto'  # tied head + loss in vocab chunks, no [B,T,V] logits: auto (CPU)/on/off
  loss_chunk_size: int = 4096  # vocabulary rows per chunk of the fused loss
  log_every: int = 50  # steps between console/TensorBoard scalars
  head_entropy_every: int = 0  # steps between head attention-entropy scalars (TensorBoard); 0 = off
  # Steps between induction telemetry (causal_lm): each head's induction and previous-token
  # scores and the in-context loss, to metrics.jsonl and TensorBoard; 0 = off.
  induction_every: int = 0
  eval_every: int = 500  # steps between evaluations (and at the end)
  eval_train_loss: bool = True  # evaluation also scores as many training rows: train_loss beside it
  checkpoint_every: int = 500  # steps between checkpoints (and at the end)
  checkpoint_every_seconds: float = 0.0  # also checkpoint this long after the last save; 0 = off
  keep_checkpoints: int = 3  # how many recent checkpoints to keep
  num_samples: int = 4  # sample outputs printed and logged at each evaluation
  eval_decode_examples: int = 256  # held-out examples decoded for BLEU / exact match (0 = skip)
  max_decode_length: int = 64  # longest greedy decode during evaluation
  loss_scale: float = 2.0**15  # float16 only: initial dynamic loss scale
  loss_scale_period: int = 2000  # float16 only: good steps before the loss scale doubles
  # A step with a NaN/Inf loss or gradient is never applied. Then: skip (go on) | halt (error naming
  # the first non-finite tensor) | rollback (to the last checkpoint, past the batch) | auto.
  nonfinite: str = 'auto'  # auto = skip for float16 (loss scaling), halt otherwise
  spike_factor: float = 0.0  # a loss above this x the running median is a spike, logged; 0 = off
  spike_window: int = 100  # losses in that running median
  spike_rollback: bool = False  # a spike also rolls back to the last checkpoint, past its batch

  def __post_init__(self):
    """Raises one ValueError naming the first knob of the loop that cannot work (zero
    intervals, negative counts, an unknown policy), before anything is written."""
    for key, minimum in TRAIN_MIN_INT.items():
      check_int('train', self, key, minimum)
    chunk = self.loss_chunk_size
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
      raise ValueError(f'train.loss_chunk_size={chunk!r} must be a positive integer')
    check_fraction('train', self, 'label_smoothing', low_open=False, high_open=True)
    scale = self.loss_scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
      raise ValueError(f'train.loss_scale={scale!r} must be a finite number > 0')
    if scale <= 0:
      raise ValueError(f'train.loss_scale={scale!r} must be a finite number > 0')
    if self.fused_loss not in FUSED_LOSS:
      raise ValueError(f'train.fused_loss={self.fused_loss!r} is not one of {FUSED_LOSS}')
    if self.nonfinite not in NONFINITE_POLICIES:
      raise ValueError(
        f'train.nonfinite={self.nonfinite!r} is not one of {" | ".join(NONFINITE_POLICIES)}'
      )
    factor = self.spike_factor
    if not isinstance(factor, (int, float)) or not (factor == 0 or factor > 1):
      raise ValueError(f'train.spike_factor={factor!r} must be 0 (off) or a number > 1, e.g. 5')
    window = self.spike_window
    if factor and (not isinstance(window, int) or window < 3):
      raise ValueError(f'train.spike_window={window!r} must be an int >= 3 (steps in the median)')
    seconds = self.checkpoint_every_seconds
    if not isinstance(seconds, (int, float)) or seconds < 0:
      raise ValueError(f'train.checkpoint_every_seconds={seconds!r} must be >= 0 (0 = off)')


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """The optimizer and its learning-rate schedule (`transformer.training.optim`)."""

  optimizer: str = 'adam'  # adam | adamw (decay masks out norms and biases)
  learning_rate: float = 1.0  # peak LR; for 'rsqrt' a multiplier of d_model^-0.5 * min(...)
  schedule: str = 'rsqrt'  # one of SCHEDULES (training.optim.SCHEDULE_BUILDERS makes each)
  warmup_steps: int = 4000  # linear warmup steps (paper: 4000)
  end_learning_rate_factor: float = 0.0  # cosine/linear: final LR as a fraction of the peak
  restart_period: int = 1000  # cosine_restarts: steps per cycle
  b1: float = 0.9  # Adam beta1 (paper)
  b2: float = 0.98  # Adam beta2 (paper)
  eps: float = 1e-9  # Adam epsilon (paper)
  weight_decay: float = 0.0  # adamw only
  clip_norm: float = 0.0  # global gradient-norm clipping; 0 = off

  def __post_init__(self):
    """Raises one ValueError for a schedule or optimizer knob that cannot work."""
    if self.schedule not in SCHEDULES:
      raise ValueError(f'unknown schedule={self.schedule!r}; choose one of {SCHEDULES}')
    if float(self.learning_rate) < 0:
      raise ValueError(f'learning_rate={float(self.learning_rate)} must be >= 0')
    if int(self.warmup_steps) < 0:
      raise ValueError(f'warmup_steps={int(self.warmup_steps)} must be >= 0')
    if not 0.0 <= float(self.end_learning_rate_factor) <= 1.0:
      raise ValueError(
        f'end_learning_rate_factor={float(self.end_learning_rate_factor)} must be in [0, 1]'
      )
    if self.schedule == 'cosine_restarts' and int(self.restart_period) <= 0:
      raise ValueError(
        f'restart_period={int(self.restart_period)} must be > 0 for schedule=cosine_restarts'
      )
    if self.optimizer not in OPTIMIZERS:
      raise ValueError(f'unknown optimizer={self.optimizer!r}; choose one of {OPTIMIZERS}')
    weight_decay, clip_norm = float(self.weight_decay), float(self.clip_norm)
    if weight_decay < 0:
      raise ValueError(f'weight_decay={weight_decay} must be >= 0')
    if self.optimizer == 'adam' and weight_decay > 0:
      raise ValueError(f"weight_decay={weight_decay} needs optimizer='adamw' (or weight_decay=0)")
    if clip_norm < 0:
      raise ValueError(f'clip_norm={clip_norm} must be >= 0 (0 = no clipping)')


@dataclasses.dataclass(frozen=True)
class MeshRules:
  """Logical axis -> comma-separated mesh axes ('' = replicated). Rules earlier in this list claim
  their mesh axes first, so activations [batch, length, embed] keep embed whole."""

  batch: str = 'data,fsdp'  # batch rows: data parallel over both data and fsdp
  length: str = ''  # sequence positions
  embed: str = 'fsdp'  # d_model of weights: FSDP (ZeRO-3) shards parameters and optimizer state
  heads: str = 'tensor'  # attention heads: Megatron-style tensor parallel
  kv_heads: str = 'tensor'  # key/value heads (GQA/MQA): must divide by the tensor size
  kv: str = ''  # head_dim
  mlp: str = 'tensor'  # feed-forward hidden units: tensor parallel
  vocab: str = 'tensor'  # embedding rows and logits: tensor parallel (see data.vocab_multiple)
  layers: str = ''  # the stacked layer axis of scan_layers


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """The devices (`transformer.sharding`): the mesh shape and the logical axis rules."""

  shape: tuple[int, int, int] = (
    -1,
    1,
    1,
  )  # (data, fsdp, tensor) devices; -1 = all devices left over
  rules: MeshRules = dataclasses.field(default_factory=MeshRules)


@dataclasses.dataclass(frozen=True)
class Config:
  """One whole experiment: what an experiment file's ConfigDict describes."""

  name: str = 'base'  # run name; the default workdir is runs/<name>
  seed: int = 0  # parameter init, dropout and data order all derive from this
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)

  def __post_init__(self):
    """Raises one ValueError for knobs of two sections that cannot work together, or a bad seed
    (each section has checked its own knobs)."""
    seed = self.seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
      raise ValueError(f'seed={seed!r} must be an integer in [0, 2**32)')
    model, data = self.model, self.data
    if (
      model.family != 'encoder_decoder'
      and data.max_length is not None
      and data.max_length > model.max_length
    ):
      raise ValueError(
        f'data.max_length={data.max_length} is longer than the context model.max_length='
        f'{model.max_length}; set the context once, as model.max_length (data.max_length follows '
        'it), or train on rows no longer than it'
      )
    block = model.compress_block
    if model.attention == 'compressed' and data.max_length is not None and block:
      if data.max_length % block:
        raise ValueError(
          f'model.compress_block={block} does not divide the row length data.max_length='
          f'{data.max_length}; choose a block that divides it'
        )
    if self.train.induction_every and model.family != 'causal_lm':
      raise ValueError(
        f'train.induction_every={self.train.induction_every} probes next-token heads; it needs '
        f"model.family='causal_lm', not {model.family!r}"
      )
    if model.norm == 'batchnorm' and data.pack:  # its statistics are over whole examples
      raise ValueError(
        "data.pack=True puts several examples in one row, and model.norm='batchnorm' would then "
        'take its statistics over a mix of examples; use data.pack=False with batchnorm, or '
        "model.norm='layernorm' or 'rmsnorm' with packing"
      )

  @classmethod
  def from_configdict(cls, config: Any) -> Config:
    """The typed experiment of a ConfigDict (or mapping), every knob checked before any work: a
    missing key or section takes its default; an unknown key is one ValueError that lists the
    valid ones; the model is validated (`ModelConfig.from_config`), each section by its own
    dataclass, and the sections together by `Config`.

    The context is set once here: data.max_length (an LM's row) follows model.max_length unless
    given; a shorter one trains below it (the long-context sweeps do).
    """
    items = _typed_items(cls, config, 'config')
    data, model = items.get('data', DataConfig()), items.get('model', ModelConfig())
    if data.max_length is None:
      items['data'] = dataclasses.replace(data, max_length=model.max_length)
    return cls(**items)


def section(cls: type, config: Any) -> Any:
  """One section of an experiment typed and checked: `cls` (DataConfig, TrainConfig, OptimConfig
  or MeshConfig) as it is, or built from a ConfigDict or mapping of its keys."""
  if isinstance(config, cls):
    return config
  return _from_items(cls, config, _SECTIONS[cls])


def _from_items(cls: type, config: Any, where: str) -> Any:
  """`cls` built from the items of `config`; nested dataclasses from nested mappings, and lists
  (JSON's form of a tuple) as tuples."""
  if cls is ModelConfig:
    return ModelConfig.from_config(config)
  return cls(**_typed_items(cls, config, where))


def _typed_items(cls: type, config: Any, where: str) -> dict[str, Any]:
  """The fields of `cls` from the items of `config`, nested sections built (and checked)."""
  items = {} if config is None else dict(config.items())
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(items) - names)
  if unknown:
    # a rule's name is a logical axis, as transformer.sharding.parse_rules says it
    axis = f' (unknown logical axis {unknown[0]!r})' if cls is MeshRules else ''
    raise ValueError(
      f'unknown {where} key {unknown[0]!r}{axis}; valid keys are: {", ".join(sorted(names))}'
    )
  hints = typing.get_type_hints(cls)
  for name, value in items.items():
    if dataclasses.is_dataclass(hints[name]):
      items[name] = _from_items(hints[name], value, f'{where}.{name}')
    elif isinstance(value, list):
      items[name] = tuple(value)
  return items


def check_int(section: str, cfg: Any, key: str, minimum: int) -> None:
  """Raises one ValueError unless `cfg.key` is an int >= `minimum`."""
  value = getattr(cfg, key)
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f'{section}.{key}={value!r} must be an integer >= {minimum}')


def check_fraction(section: str, cfg: Any, key: str, *, low_open: bool, high_open: bool) -> None:
  """Raises one ValueError unless `cfg.key` is a number in the given interval."""
  value = getattr(cfg, key)
  number = isinstance(value, (int, float)) and not isinstance(value, bool)
  ok = number and math.isfinite(value)
  ok = ok and (value > 0 if low_open else value >= 0) and (value < 1 if high_open else value <= 1)
  if not ok:
    interval = ('(' if low_open else '[') + '0, 1' + (')' if high_open else ']')
    raise ValueError(f'{section}.{key}={value!r} must be a number in {interval}')


_SECTIONS = {DataConfig: 'data', TrainConfig: 'train', OptimConfig: 'optim', MeshConfig: 'mesh'}


def default_configdict() -> ml_collections.ConfigDict:
  """Every default above as the ConfigDict that `configs/base.py` returns."""
  return to_configdict(Config())


def to_configdict(config: Any) -> ml_collections.ConfigDict:
  """A config dataclass as a (type-safe) ConfigDict, nested dataclasses as nested ConfigDicts.

  A field that is None holds a FieldReference typed by its annotation (`int | None` -> int), so
  that a flag such as `--config.model.num_kv_heads=4` parses; a field that admits several types
  (`bool | tuple[int, ...]`) holds a FieldReference of type object. Other fields are plain values.
  """
  out = ml_collections.ConfigDict()
  hints = typing.get_type_hints(type(config))
  for field in dataclasses.fields(config):
    if not field.init:  # a derived size (ModelConfig.head_size, ...): not a knob
      continue
    value = getattr(config, field.name)
    if dataclasses.is_dataclass(value):
      out[field.name] = to_configdict(value)
    else:
      out[field.name] = _config_value(value, hints[field.name])
  return out


def _config_value(value: Any, hint: Any) -> Any:
  """`value` as a ConfigDict holds it: plain, or a FieldReference where the type needs one."""
  if not isinstance(hint, types.UnionType) and typing.get_origin(hint) is not typing.Union:
    return value
  kinds = [t for t in typing.get_args(hint) if t is not type(None)]
  if len(kinds) > 1:
    return ml_collections.FieldReference(value, field_type=object)
  if value is None:
    kind = kinds[0]
    return ml_collections.FieldReference(None, field_type=typing.get_origin(kind) or kind)
  return value


def apply_overrides(config: ml_collections.ConfigDict, overrides: Mapping[str, Any], where: str):
  """Sets each dotted key of `overrides` in `config`; a key the config lacks is one ValueError."""
  for key, value in overrides.items():
    node, parts = config, key.split('.')
    for i, part in enumerate(parts):
      has = isinstance(node, ml_collections.ConfigDict) and part in node
      if not has:
        parent = '.'.join(parts[:i]) or 'the config'
        valid = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
        raise ValueError(
          f'{where} overrides {key!r}, which is not a key of the base config: {parent} has no '
          f'{part!r}' + (f'; valid keys there: {", ".join(valid)}' if valid else '')
        )
      if i < len(parts) - 1:
        node = node[part]
    try:
      node[parts[-1]] = tuple(value) if isinstance(value, list) else value
    except (TypeError, ValueError) as e:
      raise ValueError(f'{where} sets {key}={value!r}, which the config rejects: {e}') from None
