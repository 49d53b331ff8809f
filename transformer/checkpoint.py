"""Save and resume runs with orbax: arrays and data position per step, run metadata per workdir.

A workdir holds `checkpoints/<step>/{state,data}` plus, shared by all of its checkpoints,
`config.json` and `git_revision.txt` (written here) and `tokenizer/` (written by transformer.data).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tempfile
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

# Model keys that may change between runs of one workdir: they change the compute, not the params.
RESUMABLE_MODEL_KEYS = ('attention_impl', 'remat', 'dtype')
# Data keys that fix the tokenizer, and so the meaning of every embedding row.
DATA_KEYS = ('task', 'tokenizer', 'vocab_size')
_SOURCE_DIR = os.path.dirname(os.path.abspath(__file__))


class _DropOrbaxInfo(logging.Filter):
  """Drops orbax's INFO/DEBUG records (several per save) from the absl logger; keeps warnings."""

  def filter(self, record: logging.LogRecord) -> bool:
    from_orbax = f'{os.sep}orbax{os.sep}' in record.pathname
    return record.levelno >= logging.WARNING or not from_orbax


def _quiet_orbax() -> None:
  absl_logger = logging.getLogger('absl')
  if not any(isinstance(f, _DropOrbaxInfo) for f in absl_logger.filters):
    absl_logger.addFilter(_DropOrbaxInfo())


class Checkpointer:
  """The checkpoints of one workdir: keeps the latest `keep`, each written atomically.

  orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it when complete, so a save
  cut short by preemption is never listed or restored (and is removed by the next Checkpointer).
  """

  def __init__(self, workdir: str, *, keep: int = 3, async_save: bool = False):
    if keep < 1:
      raise ValueError(f'keep={keep} must be at least 1 (the number of checkpoints kept)')
    self.directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
    try:  # fail now, with the path, rather than at the first save hours later
      os.makedirs(self.directory, exist_ok=True)
      with tempfile.TemporaryFile(dir=self.directory):
        pass
    except OSError as e:
      raise ValueError(f'workdir {workdir!r} is not writable: {e}; choose another --workdir') from e
    _quiet_orbax()
    _remove_partial_saves(self.directory)
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for item, args in [('state', ocp.args.StandardSave), ('state', ocp.args.StandardRestore)]:
      registry.add(item, args)
    for item, args in [('data', ocp.args.JsonSave), ('data', ocp.args.JsonRestore)]:
      registry.add(item, args)
    options = ocp.CheckpointManagerOptions(
      preservation_policy=ocp.checkpoint_managers.LatestN(n=keep),
      enable_async_checkpointing=async_save,
      cleanup_tmp_directories=False,  # done synchronously above: orbax's thread can outlive us
    )
    self._manager = ocp.CheckpointManager(
      self.directory, options=options, handler_registry=registry
    )

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None when there is none."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """Steps of the complete checkpoints, oldest first."""
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: Any, data_state: dict, *, force: bool = False) -> bool:
    """Writes `state` (a pytree of arrays) and `data_state` (a JSON dict) as checkpoint `step`.

    A step that is already saved is skipped, and so is one older than the latest unless `force`.
    Returns True if a checkpoint was written (or, with async_save, started).
    """
    if not isinstance(data_state, dict):
      raise ValueError(f'data_state must be a JSON dict, got {type(data_state).__name__}')
    try:
      json.dumps(data_state)
    except (TypeError, ValueError) as e:
      raise ValueError(f'data_state must be JSON-serialisable: {e}') from e
    if step in self._manager.all_steps():
      return False
    args = ocp.args.Composite(
      state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)
    )
    return self._manager.save(step, args=args, force=force)

  def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict, int]:
    """Reads checkpoint `step` (None = latest) into the structure of `abstract_state`.

    Args:
      abstract_state: the target pytree: jax.ShapeDtypeStruct leaves (with .sharding, or the
        default device without) or concrete arrays. Arrays come back on those shardings and in
        those dtypes, whatever device layout wrote the checkpoint.
      step: the step to read; None reads the latest.

    Returns:
      (state, data_state, step): state shaped like `abstract_state`, the saved JSON dict, and the
      step that was read.
    """
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f'no checkpoint in {self.directory}; train first or check --workdir')
    step = steps[-1] if step is None else step
    if step not in steps:
      raise FileNotFoundError(f'no checkpoint for step {step} in {self.directory}; have {steps}')
    saved = self._manager.item_metadata(step)['state']
    _check_structure(saved, abstract_state, f'{self.directory}/{step}')
    args = ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()
    )
    restored = self._manager.restore(step, args=args)
    return restored['state'], restored['data'], step

  def wait(self) -> None:
    """Blocks until an async save in flight is complete on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for saves and deletions, then releases orbax's threads."""
    self._manager.close()


def _remove_partial_saves(directory: str) -> None:
  """Deletes saves that never completed (orbax's `<step>.orbax-checkpoint-tmp*` directories)."""
  if jax.process_index() != 0:
    return
  for name in os.listdir(directory):
    if '.orbax-checkpoint-tmp' in name:
      shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def _path_str(path: tuple) -> str:
  """'opt_state/1/mu/w' for a jax key path (dict keys, attributes and indices alike)."""
  names = [getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k))) for k in path]
  return '/'.join(str(n) for n in names)


def _check_structure(saved: Any, target: Any, where: str) -> None:
  """Raises one ValueError naming the first leaf the checkpoint and the target disagree on."""
  saved_leaves = {_path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(saved)[0]}
  target_leaves = {_path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(target)[0]}
  hint = 'the model or optimizer config differs from the run that wrote it'
  for name in saved_leaves:
    if name not in target_leaves:
      raise ValueError(f'checkpoint {where} has {name!r}, which the state lacks; {hint}')
  for name, leaf in target_leaves.items():
    if name not in saved_leaves:
      raise ValueError(f'checkpoint {where} has no {name!r}, which the state needs; {hint}')
    saved_shape = getattr(saved_leaves[name], 'shape', None)
    if saved_shape is not None and tuple(saved_shape) != np.shape(leaf):
      raise ValueError(
        f'checkpoint {where} has {name!r} of shape {tuple(saved_shape)}, but the state wants '
        f'{np.shape(leaf)}; {hint}'
      )


# Run metadata beside the checkpoints -----------------------------------------------------------
def _write_atomic(path: str, text: str) -> None:
  """Writes a temp file in the same directory, then renames it over `path`: never half a file."""
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f'.{os.path.basename(path)}.')
  try:
    with os.fdopen(fd, 'w') as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def _git_revision(source_dir: str = _SOURCE_DIR) -> str:
  """`git rev-parse HEAD` of the tree holding `source_dir` (+ '-dirty' if changed), or 'unknown'."""

  def git(*args: str) -> str:
    result = subprocess.run(
      ['git', *args], cwd=source_dir, capture_output=True, text=True, timeout=60, check=True
    )
    return result.stdout.strip()

  try:
    revision = git('rev-parse', 'HEAD')
    dirty = git('status', '--porcelain')
  except (OSError, subprocess.SubprocessError):
    return 'unknown'
  return revision + ('-dirty' if dirty else '')


def write_run_metadata(workdir: str, config: ml_collections.ConfigDict) -> None:
  """Writes workdir/config.json and workdir/git_revision.txt (process 0 only), each atomically.

  Call `check_resume_compatible` first: this overwrites the config.json of a previous run.
  """
  if jax.process_index() != 0:
    return
  os.makedirs(workdir, exist_ok=True)
  _write_atomic(os.path.join(workdir, 'config.json'), config.to_json_best_effort(indent=2) + '\n')
  _write_atomic(os.path.join(workdir, 'git_revision.txt'), _git_revision() + '\n')


def read_run_config(workdir: str) -> dict | None:
  """The workdir's saved config.json as a dict, or None when there is none."""
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def _has_checkpoints(workdir: str) -> bool:
  directory = os.path.join(workdir, 'checkpoints')
  if not os.path.isdir(directory):
    return False
  return any(name.isdigit() for name in os.listdir(directory))  # orbax names steps '<step>'


def check_resume_compatible(workdir: str, config: ml_collections.ConfigDict) -> None:
  """Raises one ValueError if `config` cannot resume the checkpoints in `workdir`; touches nothing.

  Every `model` key must match the saved config.json except RESUMABLE_MODEL_KEYS, and so must the
  DATA_KEYS of `data`. A workdir without checkpoints or without config.json always passes.
  """
  saved = read_run_config(workdir)
  if saved is None or not _has_checkpoints(workdir):
    return
  here = json.loads(config.to_json_best_effort())  # JSON-normalised: tuples are lists, as saved
  missing = object()
  show = lambda value: 'absent' if value is missing else json.dumps(value)
  pairs = []
  saved_model, here_model = saved.get('model', {}), here.get('model', {})
  for key in [*here_model, *(k for k in saved_model if k not in here_model)]:
    if key not in RESUMABLE_MODEL_KEYS:
      pairs.append((f'model.{key}', saved_model.get(key, missing), here_model.get(key, missing)))
  saved_data, here_data = saved.get('data', {}), here.get('data', {})
  for key in DATA_KEYS:
    pairs.append((f'data.{key}', saved_data.get(key, missing), here_data.get(key, missing)))
  for name, there_value, here_value in pairs:
    if there_value != here_value:
      raise ValueError(
        f'config does not match the checkpoint in {workdir}: {name} is {show(there_value)} there '
        f'and {show(here_value)} here; use another --workdir or the original config'
      )
