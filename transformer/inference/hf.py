"""Hugging Face checkpoints (safetensors) to sparrow workdirs or in-memory models, and back.

Architectures: GPT-2; BERT (BertModel, BertForMaskedLM, BertForSequenceClassification); Llama
(2, 3, 3.1, 3.2), Qwen2, Qwen3 and Mistral causal LMs; GPT-NeoX (Pythia), GPT-Neo (TinyStories),
Gemma 2 and Gemma 3 (text). `hf_config` maps config.json, `hf_weights`
the tensors; this module reads folders and writes workdirs. Nothing is ever unpickled.

Dissecting a downloaded small model:
  1. On a machine with network access, fetch a model folder from the Hugging Face Hub (config.json,
     model.safetensors or its shards + index, tokenizer.json, tokenizer_config.json).
  2. Open it directly, `transformer.load('SmolLM2-135M')`, or convert it to a workdir to fine-tune:
       python -m experiments.convert_hf --input=SmolLM2-135M --workdir=runs/smol
     (--arch is read from config.json; --param_dtype=keep keeps bf16 weights in bf16).
  3. Dissect it: python -m experiments.inspect --workdir=SmolLM2-135M --text="The capital of"
  4. Export back (e.g. after fine-tuning):
       python -m experiments.convert_hf --direction=to_hf --input=runs/smol --workdir=smol_hf
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from transformer.config import DTYPES, ModelConfig
from transformer.inference.hf_config import (  # noqa: F401  (the public surface of inference.hf)
  ARCHS,
  check_arch,
  check_exportable,
  detect_arch,
  experiment_config,
  hf_config,
  model_fields,
)
from transformer.inference.hf_weights import (  # noqa: F401
  WEIGHTS,
  Tensors,
  open_weights,
  params_from_hf,
  params_to_hf,
)
from transformer.model import models
from transformer.training import checkpoint, optim, provenance
from transformer.training.state import TrainState, create_state, optim_config, state_from_params

DIRECTIONS = ('from_hf', 'to_hf')
PARAM_DTYPES = ('float32', 'bfloat16', 'float16', 'keep')  # 'keep' = the checkpoint's own dtype
HF_CONFIG = 'hf_config.json'  # the input's config.json, kept in the workdir for the export back
# Files of a Hugging Face tokenizer; tokenizer.json alone is enough for transformer.data.
TOKENIZER_FILES = (
  'tokenizer.json',
  'tokenizer_config.json',
  'special_tokens_map.json',
  'added_tokens.json',
  'vocab.json',
  'merges.txt',
  'vocab.txt',
)


# Reading a folder ------------------------------------------------------------------------------
def is_hf_dir(path: str) -> bool:
  """A Hugging Face model folder: config.json beside safetensors weights (or their index)."""
  return os.path.isfile(os.path.join(path, 'config.json')) and any(
    os.path.isfile(os.path.join(path, n)) for n in (WEIGHTS, WEIGHTS + '.index.json')
  )


def _read_config(path: str) -> tuple[str, dict]:
  if not path or not os.path.exists(path):
    raise FileNotFoundError(f'input {path!r} does not exist; give a Hugging Face model directory')
  directory = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
  config_path = os.path.join(directory, 'config.json')
  if not os.path.isfile(config_path):
    raise FileNotFoundError(
      f'no config.json in {directory!r}; --input must be a Hugging Face model'
    )
  try:
    with open(config_path) as f:
      hf = json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f'cannot read {config_path!r} as JSON: {e}') from e
  if not isinstance(hf, dict):
    raise ValueError(f'{config_path!r} holds no JSON object')
  return directory, hf


def _check_tokenizer(directory: str, vocab_size: int) -> None:
  """A tokenizer.json with more ids than the model's vocabulary is refused."""
  path = os.path.join(directory, 'tokenizer.json')
  if not os.path.isfile(path):
    return
  import tokenizers

  try:
    size = tokenizers.Tokenizer.from_file(path).get_vocab_size(with_added_tokens=True)
  except Exception as e:
    raise ValueError(f'cannot read {path!r} as a Hugging Face tokenizer: {e}') from e
  if size > vocab_size:
    raise ValueError(
      f'{path!r} has {size} tokens but config.json has vocab_size={vocab_size}; the tokenizer '
      'belongs to another model'
    )


def _param_dtype(param_dtype: str, tensors: Tensors) -> str:
  if param_dtype not in PARAM_DTYPES:
    raise ValueError(f'param_dtype={param_dtype!r} is not valid; choose one of {PARAM_DTYPES}')
  return tensors.float_dtype() if param_dtype == 'keep' else param_dtype


def convert_in_memory(
  path: str, arch: str | None = None, param_dtype: str = 'float32', shapes: Any = None
) -> tuple[ml_collections.ConfigDict, ModelConfig, dict, str]:
  """(experiment config, model config, parameters, directory) of a Hugging Face folder.

  `arch` None reads it from config.json. Parameters are numpy arrays of `param_dtype`, read one
  tensor at a time: the peak is about the model's size in that dtype.
  """
  directory, hf = _read_config(path)
  where_config = os.path.join(directory, 'config.json')
  arch = arch or detect_arch(hf, where_config)
  check_arch(arch)
  tensors, where = open_weights(directory, path)
  dtype = _param_dtype(param_dtype, tensors)
  name = re.sub(r'[^A-Za-z0-9_.-]+', '_', os.path.basename(os.path.normpath(directory)))
  config = experiment_config(arch, hf, f'hf_{name}', dtype, where_config)
  cfg = ModelConfig.from_config(config.model)
  _check_tokenizer(directory, cfg.vocab_size)
  params = params_from_hf(arch, cfg, tensors, where, shapes, dtype=DTYPES[dtype])
  return config, cfg, params, directory


# Writing ---------------------------------------------------------------------------------------
def _check_out(out: str) -> None:
  """Refuses an output that exists and is not an empty directory."""
  if not os.path.exists(out):
    return
  if not os.path.isdir(out):
    raise ValueError(f'output {out!r} exists and is not a directory; choose a new --workdir')
  if os.listdir(out):
    what = 'checkpoints' if os.path.isdir(os.path.join(out, 'checkpoints')) else 'files'
    raise ValueError(
      f'output {out!r} already holds {what}; refusing to overwrite it: choose a new --workdir'
    )


@contextlib.contextmanager
def _staged(out: str) -> Iterator[str]:
  """A fresh directory beside `out` (same filesystem), renamed to `out` only if the body succeeds.

  An error or interruption leaves `out` as it was: nothing partial is ever visible there.
  """
  out = os.path.abspath(out)
  _check_out(out)
  parent = os.path.dirname(out)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f'.{os.path.basename(out)}.partial-', dir=parent)
  try:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; give it a normal directory's mode
    yield tmp
    _check_out(out)  # again: someone may have written there meanwhile
    if os.path.isdir(out):
      os.rmdir(out)  # empty, checked above
    os.rename(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def _copy_tokenizer(src: str, dst: str) -> bool:
  """Copies a Hugging Face tokenizer (needs tokenizer.json) from `src` into `dst`."""
  if not os.path.isfile(os.path.join(src, 'tokenizer.json')):
    return False
  os.makedirs(dst, exist_ok=True)
  for name in TOKENIZER_FILES:
    if os.path.isfile(os.path.join(src, name)):
      shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
  return True


def _optimizer(config: ml_collections.ConfigDict, cfg: ModelConfig):
  return optim.make_optimizer(optim_config(config, cfg))


def abstract_state(config: ml_collections.ConfigDict, cfg: ModelConfig) -> TrainState:
  """The ShapeDtypeStructs of the training state of `config`: what a checkpoint must match."""
  model, tx = models.build(cfg), _optimizer(config, cfg)
  make = lambda: create_state(model, cfg, tx, config.seed, config.train.loss_scale)
  return jax.eval_shape(make)


def _check_state(state: Any, abstract: Any) -> None:
  flat = lambda tree: {
    jax.tree_util.keystr(p): (x.shape, x.dtype)
    for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
  }
  got, want = flat(state), flat(abstract)
  if got != want:
    diff = sorted(set(got.items()) ^ set(want.items()), key=str)[0]
    raise AssertionError(f'converted state differs from the training state at {diff}')


# The two directions ----------------------------------------------------------------------------
def import_hf(
  arch: str | None, input_path: str, workdir: str, param_dtype: str = 'float32'
) -> dict[str, Any]:
  """Converts the Hugging Face model at `input_path` into a new sparrow workdir `workdir`.

  Writes config.json (+ git_revision.txt), hf_config.json, checkpoints/0 (a full TrainState with
  fresh optimizer moments) and tokenizer/ when the input has tokenizer.json. Everything is built
  beside `workdir` and renamed into place at the end. `arch` None reads it from config.json.
  Returns a summary.
  """
  if arch is not None:
    check_arch(arch)
  _check_out(os.path.abspath(workdir))  # fail before reading gigabytes
  directory, hf = _read_config(input_path)
  arch = arch or detect_arch(hf, os.path.join(directory, 'config.json'))
  config, cfg, params, directory = convert_in_memory(input_path, arch, param_dtype)
  abstract = abstract_state(config, cfg)
  params = jax.tree_util.tree_map(jnp.asarray, params)
  state = state_from_params(params, _optimizer(config, cfg))
  _check_state(state, abstract)
  if os.path.isfile(os.path.join(directory, 'tokenizer.json')):
    config.data.tokenizer = 'hf'  # fine-tuning reads the model's own tokenizer from tokenizer/
  with _staged(workdir) as tmp:
    provenance.write_run_metadata(tmp, config)
    with open(os.path.join(tmp, HF_CONFIG), 'w') as f:
      json.dump(hf, f, indent=2)
    ckpt = checkpoint.Checkpointer(tmp, keep=config.train.keep_checkpoints)
    try:
      ckpt.save(0, state, data_state={})
    finally:
      ckpt.close()
    tokenizer = _copy_tokenizer(directory, os.path.join(tmp, 'tokenizer'))
  return {
    'workdir': os.path.abspath(workdir),
    'arch': arch,
    'parameters': int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params))),
    'param_dtype': cfg.param_dtype,
    'tokenizer': tokenizer,
  }


def export_hf(arch: str | None, workdir: str, out: str, step: int | None = None) -> dict[str, Any]:
  """Writes the sparrow workdir's checkpoint (latest, or `step`) as a Hugging Face directory.

  `out` gets config.json, model.safetensors (in the parameters' dtype) and the tokenizer files
  when the workdir holds a Hugging Face tokenizer; it is built beside `out` and renamed into place
  at the end. `arch` None: the arch the workdir was imported from.
  """
  if arch is not None:
    check_arch(arch)
  _check_out(os.path.abspath(out))
  saved = checkpoint.read_run_config(workdir) if os.path.isdir(workdir) else None
  if saved is None:
    raise FileNotFoundError(f'no config.json in {workdir!r}; --input must be a sparrow workdir')
  config = ml_collections.ConfigDict(saved)
  original = None
  if os.path.isfile(os.path.join(workdir, HF_CONFIG)):
    with open(os.path.join(workdir, HF_CONFIG)) as f:
      original = json.load(f)
  if arch is None:  # the arch it was imported from
    if original is None:
      raise ValueError(
        f'{workdir!r} was not imported from Hugging Face (no {HF_CONFIG}); give --arch, one of '
        f'{", ".join(ARCHS)}'
      )
    arch = detect_arch(original, os.path.join(workdir, HF_CONFIG))
  cfg = ModelConfig.from_config(config.model)
  check_exportable(arch, cfg)
  if not os.path.isdir(os.path.join(workdir, 'checkpoints')):
    raise FileNotFoundError(f'no checkpoint in {workdir!r}; train or import first')
  ckpt = checkpoint.Checkpointer(workdir)
  try:
    state, _, step = ckpt.restore(abstract_state(config, cfg), step)
  finally:
    ckpt.close()
  tensors = params_to_hf(arch, cfg, jax.device_get(state.params))
  if original is not None and detect_arch(original) != arch:
    original = None  # exported as another arch: start from a blank config.json
  from safetensors.numpy import save_file

  with _staged(out) as tmp:
    with open(os.path.join(tmp, 'config.json'), 'w') as f:
      json.dump(hf_config(arch, cfg, original), f, indent=2)
    save_file(tensors, os.path.join(tmp, WEIGHTS), metadata={'format': 'pt'})
    tokenizer = _copy_tokenizer(os.path.join(workdir, 'tokenizer'), tmp)
  return {
    'output': os.path.abspath(out),
    'arch': arch,
    'step': step,
    'tensors': len(tensors),
    'tokenizer': tokenizer,
  }


def convert(
  arch: str | None,
  input_path: str,
  output: str,
  direction: str = 'from_hf',
  param_dtype: str = 'float32',
) -> dict:
  """`import_hf` ('from_hf') or `export_hf` ('to_hf'): what experiments.convert_hf runs."""
  if direction not in DIRECTIONS:
    raise ValueError(f'direction={direction!r} is not valid; choose one of {", ".join(DIRECTIONS)}')
  if arch is not None:
    check_arch(arch)
  if param_dtype not in PARAM_DTYPES:
    raise ValueError(f'param_dtype={param_dtype!r} is not valid; choose one of {PARAM_DTYPES}')
  if direction == 'from_hf':
    return import_hf(arch, input_path, output, param_dtype)
  return export_hf(arch, input_path, output)
