"""Save and resume runs with orbax: arrays and data position per step, run metadata per workdir.

A workdir holds `checkpoints/<step>/{state,data,integrity}` plus, shared by all of its checkpoints,
`config.json`, `git_revision.txt` and `revisions.jsonl` (every revision that trained it, with its
steps; written by provenance.py) and `tokenizer/` (written by transformer.data).
Every checkpoint carries checksums of its arrays and data state (`integrity`), checked on restore:
a latest checkpoint proven damaged is moved aside and the previous good one is restored instead;
one that fails to read for any other reason (permissions, I/O, versions, topology: see
`unreadable.py`) stays where it is and the restore fails with one line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from transformer import util
from transformer.config import ModelConfig
from transformer.training import unreadable

# Model keys that may change between runs of one workdir: they change the compute, not the params.
RESUMABLE_MODEL_KEYS = ('attention_impl', 'remat', 'dtype')
# Data keys that fix the tokenizer, and so the meaning of every embedding row.
DATA_KEYS = ('task', 'tokenizer', 'vocab_size')
_INTEGRITY_FORMAT = 1  # version of the `integrity` record written with every checkpoint


class CheckpointError(ValueError):
  """A checkpoint could not be written or read; the message names the directory and step."""


class CorruptCheckpointError(CheckpointError):
  """A checkpoint's files are damaged: it does not restore to what was saved."""


class UnreadableCheckpointError(CheckpointError):
  """A checkpoint failed to read for a reason that is not damage (permissions, I/O, versions,
  topology); it was left in place, and the message says what to do."""


class _Unreadable(Exception):
  """Internal: one checkpoint is proven damaged (the message says how)."""


class _DropOrbaxInfo(logging.Filter):
  """Drops orbax's INFO/DEBUG records (several per save) from the absl logger; keeps warnings.

  Also drops orbax's error traceback for a full disk: `Checkpointer.save` raises one clear
  CheckpointError for it instead.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    from_orbax = f'{os.sep}orbax{os.sep}' in record.pathname
    if not from_orbax:
      return True
    if record.levelno < logging.WARNING:
      return False
    error = record.exc_info[1] if record.exc_info else None
    return util.no_space_reason(record.getMessage()) is None and util.no_space_reason(error) is None


class _DropOrbaxLeftovers:
  """A sys.unraisablehook that drops the echoes of a failed orbax read or full-disk save.

  The error was already raised (as CorruptCheckpointError or CheckpointError). Without this,
  the garbage collector prints "Exception ignored in: <coroutine ...>" tracebacks for its
  coroutines later in the run, and tensorstore reads and writes that finish after orbax closed
  its event loop print "Event loop is closed" (through this hook, or through sys.excepthook from
  tensorstore's own thread: `_DropLateEcho`).
  """

  failures = 0  # counted by Checkpointer._read and Checkpointer._raise_save_error
  reading = 0  # orbax restores under way: a read that fails echoes before it raises

  def __init__(self, previous):
    self.previous = previous

  @classmethod
  def late(cls, error: BaseException | None) -> bool:
    """A tensorstore callback that found orbax's event loop closed: in a read or after a failure."""
    closed = isinstance(error, RuntimeError) and str(error) == 'Event loop is closed'
    return bool(closed and (cls.failures or cls.reading))

  def __call__(self, unraisable) -> None:
    code = getattr(unraisable.object, 'cr_code', None)
    if code is not None and f'{os.sep}orbax{os.sep}' in code.co_filename:
      return
    if unraisable.object is None and self.late(unraisable.exc_value):
      return
    self.previous(unraisable)


class _DropLateEcho:
  """A sys.excepthook that drops `_DropOrbaxLeftovers.late` echoes printed off the main thread."""

  def __init__(self, previous):
    self.previous = previous

  def __call__(self, kind, error, traceback) -> None:
    main = threading.current_thread() is threading.main_thread()
    if not main and _DropOrbaxLeftovers.late(error):
      return
    self.previous(kind, error, traceback)


class _DropUnretrievedReads(logging.Filter):
  """Drops asyncio's "Task exception was never retrieved" for orbax's own tasks once a read has
  failed or while one runs: a restore reads many arrays at once, the first failure is raised (as
  one error), and the other tasks' failures are the same cause, logged when they are collected."""

  def filter(self, record: logging.LogRecord) -> bool:
    text = record.getMessage()
    echo = text.startswith('Task exception was never retrieved')
    echo = echo and f'{os.sep}orbax{os.sep}' in text
    return not (echo and (_DropOrbaxLeftovers.failures or _DropOrbaxLeftovers.reading))


def _quiet_orbax() -> None:
  absl_logger = logging.getLogger('absl')
  if not any(isinstance(f, _DropOrbaxInfo) for f in absl_logger.filters):
    absl_logger.addFilter(_DropOrbaxInfo())
  asyncio_logger = logging.getLogger('asyncio')
  if not any(isinstance(f, _DropUnretrievedReads) for f in asyncio_logger.filters):
    asyncio_logger.addFilter(_DropUnretrievedReads())
  if not isinstance(sys.unraisablehook, _DropOrbaxLeftovers):
    sys.unraisablehook = _DropOrbaxLeftovers(sys.unraisablehook)
  if not isinstance(sys.excepthook, _DropLateEcho):
    sys.excepthook = _DropLateEcho(sys.excepthook)


class Checkpointer:
  """The checkpoints of one workdir: keeps the latest `keep`, each written atomically and checked.

  orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it when complete, so a save
  cut short by preemption is never listed or restored (and is removed by the next Checkpointer).
  Each checkpoint also holds an `integrity` record (checksums of every array and of the data
  state), so damage on disk is found on restore instead of resuming from wrong numbers.
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
    for item in ('data', 'integrity'):
      registry.add(item, ocp.args.JsonSave)
      registry.add(item, ocp.args.JsonRestore)
    options = ocp.CheckpointManagerOptions(
      preservation_policy=ocp.checkpoint_managers.LatestN(n=keep),
      enable_async_checkpointing=async_save,
      cleanup_tmp_directories=False,  # done synchronously above: orbax's thread can outlive us
    )
    self._manager = ocp.CheckpointManager(
      self.directory, options=options, handler_registry=registry
    )
    self._async = async_save
    self._pending_step: int | None = None  # an async save that may still fail

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

    Raises:
      CheckpointError: the file system is full; the message names the directory, the step and
        the free space. The partial save is removed and earlier checkpoints stay restorable.
    """
    if not isinstance(data_state, dict):
      raise ValueError(f'data_state must be a JSON dict, got {type(data_state).__name__}')
    try:
      data_state = json.loads(json.dumps(data_state))  # as it will read back: tuples are lists
    except (TypeError, ValueError) as e:
      raise ValueError(f'data_state must be JSON-serialisable: {e}') from e
    data_state = _gather_process_states(data_state)  # every process's own data position
    if step in self._manager.all_steps():
      return False
    self._check_pending()  # an earlier async save that failed is reported first
    args = ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      data=ocp.args.JsonSave(data_state),
      integrity=ocp.args.JsonSave(_integrity_record(state, data_state)),
    )
    try:
      started = self._manager.save(step, args=args, force=force)
    except Exception as e:
      self._raise_save_error(step, e)
    if started and self._async:
      self._pending_step = step
    return started

  def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict, int]:
    """Reads checkpoint `step` (None = latest good one) into the structure of `abstract_state`.

    Every array and the data state are checked against the checksums saved with them. With
    step=None a checkpoint proven damaged (a checksum, a missing or malformed integrity record, a
    stored file truncated, absent or not decoding) is moved aside to `checkpoints/<step>.corrupt`
    (kept for inspection, never listed again) once the newest good one older than it has
    restored, with a warning naming both; the returned step says which one was read. Any other
    failure to read (a permission, an I/O error after its retries, a newer orbax's layout,
    another topology) moves nothing and raises UnreadableCheckpointError.

    Args:
      abstract_state: the target pytree: jax.ShapeDtypeStruct leaves (with .sharding, or the
        default device without) or concrete arrays. Arrays come back on those shardings and in
        those dtypes, whatever device layout wrote the checkpoint.
      step: the step to read; None reads the latest good one.

    Returns:
      (state, data_state, step): state shaped like `abstract_state`, the saved JSON dict, and the
      step that was read.

    Raises:
      FileNotFoundError: no checkpoint at all, or none for `step`.
      ValueError: the checkpoint's arrays do not fit `abstract_state` (another model config).
      CorruptCheckpointError: `step` is damaged, or (step=None) every checkpoint is.
      UnreadableCheckpointError: a checkpoint failed to read through no proven damage.
    """
    self._check_pending()
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f'no checkpoint in {self.directory}; train first or check --workdir')
    if step is not None:
      if step not in steps:
        raise FileNotFoundError(f'no checkpoint for step {step} in {self.directory}; have {steps}')
      try:
        state, data_state = self._read(step, abstract_state)
        return state, _this_process_state(data_state, self._path(step)), step
      except _Unreadable as e:
        others = [s for s in steps if s != step]
        raise CorruptCheckpointError(
          f'checkpoint {self._path(step)} is corrupt: {e}; restore another step ({others}) or '
          'step=None for the newest good one'
        ) from None
    bad = []
    for candidate in reversed(steps):
      try:
        state, data_state = self._read(candidate, abstract_state)
      except _Unreadable as e:
        bad.append((candidate, str(e)))
        continue
      if bad:
        moved = self._quarantine([s for s, _ in bad])
        for (bad_step, reason), target in zip(bad, moved):
          logging.getLogger(__name__).warning(
            'checkpoint %s is corrupt (%s); restored checkpoint %s (step %d) instead and moved '
            'the corrupt one to %s',
            self._path(bad_step),
            reason,
            self._path(candidate),
            candidate,
            target,
          )
      return state, _this_process_state(data_state, self._path(candidate)), candidate
    listing = '; '.join(f'step {s}: {reason}' for s, reason in bad)
    raise CorruptCheckpointError(
      f'no checkpoint in {self.directory} can be restored: {listing}; move them aside to start '
      'over, or use another --workdir'
    )

  def wait(self) -> None:
    """Blocks until an async save in flight is complete on disk (CheckpointError: disk full)."""
    try:
      self._manager.wait_until_finished()
    except Exception as e:
      step, self._pending_step = self._pending_step, None
      self._raise_save_error(step, e)
    self._check_pending()

  def close(self) -> None:
    """Waits for saves and deletions, then releases orbax's threads."""
    try:
      self._manager.close()
    except Exception as e:
      step, self._pending_step = self._pending_step, None
      self._raise_save_error(step, e)
    self._check_pending()

  # Internals ---------------------------------------------------------------------------------
  def _path(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def _check_pending(self) -> None:
    """Raises the error of a finished async save, as `save` would have for a sync one."""
    if self._pending_step is None:
      return
    step = self._pending_step
    try:
      self._manager.check_for_errors()
    except Exception as e:
      self._pending_step = None
      self._raise_save_error(step, e)
    if self._manager.is_saving_in_progress():
      return
    self._pending_step = None

  def _raise_save_error(self, step: int | None, error: Exception) -> NoReturn:
    """Raises CheckpointError for a full file system (after removing the partial save), or `error`.

    Call it from the `except` block that caught `error`.
    """
    reason = util.no_space_reason(error)
    if reason is None:
      raise error
    _DropOrbaxLeftovers.failures += 1  # its late writes may echo 'Event loop is closed'
    _remove_partial_saves(self.directory)
    usage = shutil.disk_usage(self.directory)
    previous = [s for s in self.all_steps() if step is None or s < step]
    kept = f'checkpoint {previous[-1]} is intact' if previous else 'no earlier checkpoint exists'
    free, total = util.byte_size(usage.free), util.byte_size(usage.total)
    raise CheckpointError(
      f'could not save checkpoint {step} in {self.directory}: {reason} ({free} free of {total}); '
      f'{kept}. Free some space (or move the workdir to a bigger disk) and rerun to resume'
    ) from error

  def _read(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
    """Restores one checkpoint and checks it against its integrity record.

    Raises ValueError when the arrays do not fit `abstract_state`, and _Unreadable when the
    checkpoint is damaged.
    """
    where = self._path(step)
    record = self._read_record(step)
    saved = record['leaves']
    _check_structure(
      {name: tuple(leaf['shape']) for name, leaf in saved.items()}, abstract_state, where
    )

    here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def as_saved(path, leaf):  # read in the saved dtype (what the checksum covers), cast below
      dtype = saved[util.key_name(path)]['dtype']
      sharding = getattr(leaf, 'sharding', None)
      if getattr(leaf, 'dtype', None) is None or (str(leaf.dtype) == dtype and sharding):
        return leaf
      # No sharding: the default device, never the layout that wrote it (another device count).
      return jax.ShapeDtypeStruct(np.shape(leaf), jnp.dtype(dtype), sharding=sharding or here)

    target = jax.tree_util.tree_map_with_path(as_saved, abstract_state)
    args = ocp.args.Composite(state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore())
    restored = self._orbax_restore(step, args, record.get('written_by'))
    state, data_state = restored['state'], restored['data']
    sums = _checksums(state)
    for name, leaf in saved.items():
      if sums.get(name) != leaf['checksum']:
        raise _Unreadable(f'array {name!r} does not match its saved checksum')
    if _json_sha256(data_state) != record['data_sha256']:
      raise _Unreadable('the data state does not match its saved checksum')

    def cast(restored_leaf, leaf):
      dtype = getattr(leaf, 'dtype', None)
      if dtype is None or getattr(restored_leaf, 'dtype', dtype) == dtype:
        return restored_leaf
      return restored_leaf.astype(dtype)

    return jax.tree.map(cast, state, abstract_state), data_state

  def _orbax_restore(self, step: int, args: Any, written_by: dict | None) -> dict:
    """orbax's restore of `step`, with a transient I/O error retried (a warning line each time).

    Raises _Unreadable when what failed proves the files damaged, UnreadableCheckpointError for
    any other failure, and MemoryError or RESOURCE_EXHAUSTED (not the files' fault) as they are.
    """
    waits = list(unreadable.RETRY_SECONDS)
    while True:
      _DropOrbaxLeftovers.reading += 1
      try:
        return self._manager.restore(step, args=args)
      except MemoryError:
        raise
      except Exception as e:
        if 'RESOURCE_EXHAUSTED' in str(e):  # out of device or host memory
          raise
        io = unreadable.transient(e)
        if io and waits:
          wait = waits.pop(0)
          tries = len(unreadable.RETRY_SECONDS) - len(waits)
          logging.getLogger(__name__).warning(
            'checkpoint %s: %s while reading it (%s); retry %d of %d in %.0f s',
            self._path(step), io, util.first_line(e, 160), tries,
            len(unreadable.RETRY_SECONDS), wait,
          )  # fmt: skip
          time.sleep(wait)
          continue
        _DropOrbaxLeftovers.failures += 1
        damaged, text = unreadable.diagnose(e, self._path(step), written_by, _installed())
        if damaged:
          raise _Unreadable(f'orbax cannot read it ({text})') from e
        raise UnreadableCheckpointError(text) from None
      finally:
        _DropOrbaxLeftovers.reading -= 1

  def _read_record(self, step: int) -> dict:
    """The checkpoint's integrity record, checked against its own checksum; else _Unreadable."""
    if not os.path.isdir(os.path.join(self._path(step), 'integrity')):
      problem = unreadable.access_problem(self._path(step))
      if problem:  # a directory this user cannot list looks absent
        raise UnreadableCheckpointError(
          unreadable.diagnose(PermissionError(problem), self._path(step), None, _installed())[1]
        )
      raise _Unreadable('it has no integrity record (integrity/ is missing)')
    args = ocp.args.Composite(integrity=ocp.args.JsonRestore())
    try:
      record = self._orbax_restore(step, args, None)['integrity']
    except _Unreadable as e:
      raise _Unreadable(f'its integrity record is unreadable ({e})') from e
    if not isinstance(record, dict) or record.get('format') != _INTEGRITY_FORMAT:
      raise _Unreadable(f'its integrity record is not format {_INTEGRITY_FORMAT}')
    body = {k: v for k, v in record.items() if k != 'sha256'}
    if record.get('sha256') != _json_sha256(body):
      raise _Unreadable('its integrity record does not match its own checksum')
    leaves = record.get('leaves')
    if not isinstance(leaves, dict) or not isinstance(record.get('data_sha256'), str):
      raise _Unreadable('its integrity record lacks leaves or data_sha256')
    for name, leaf in leaves.items():
      if not _well_formed(leaf):
        raise _Unreadable(f'its integrity record has a malformed entry for {name!r}')
    return record

  def _quarantine(self, steps: list[int]) -> list[str]:
    """Renames damaged checkpoints to `<step>.corrupt[.n]`, out of orbax's listing."""
    targets = []
    for step in steps:
      target, n = f'{self._path(step)}.corrupt', 1
      while os.path.exists(target):
        target, n = f'{self._path(step)}.corrupt.{n}', n + 1
      if jax.process_index() == 0:
        try:
          os.rename(self._path(step), target)
        except OSError as e:  # e.g. a read-only workdir: still restorable, but listed
          target = f'nowhere ({e}); it stays listed'
      targets.append(target)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils

      multihost_utils.sync_global_devices(f'sparrow_quarantine_{"_".join(map(str, steps))}')
    self._manager.reload()
    return targets


def _gather_process_states(data_state: dict) -> dict:
  """{'processes': [state of process 0, 1, ...]}: each process reads its own shard of the data."""
  if jax.process_count() == 1:
    return {'processes': [data_state]}
  from jax.experimental import multihost_utils

  encoded = np.frombuffer(json.dumps(data_state).encode(), np.uint8)
  lengths = multihost_utils.process_allgather(np.int32(encoded.size))
  padded = np.zeros(int(np.max(lengths)), np.uint8)
  padded[: encoded.size] = encoded
  rows = np.asarray(multihost_utils.process_allgather(padded))  # [processes, max length]
  return {'processes': [json.loads(bytes(r[:n]).decode()) for r, n in zip(rows, lengths)]}


def _this_process_state(saved: dict, where: str) -> dict:
  """This process's entry of a gathered data state; {} (start the data afresh) if none fits."""
  if 'processes' not in saved:  # written without per-process entries (e.g. a weight import)
    return saved
  states = saved['processes']
  if states and states[0].get('global') and all(s == states[0] for s in states):
    return states[0]  # one global position (a streamed corpus): any number of processes resumes it
  if len(states) != jax.process_count():
    logging.getLogger(__name__).warning(
      'checkpoint %s holds the data positions of %d processes, but this run has %d: the data '
      'order starts afresh (the model and optimizer state are restored)',
      where,
      len(states),
      jax.process_count(),
    )
    return {}
  return states[jax.process_index()]


def _remove_partial_saves(directory: str) -> None:
  """Deletes saves that never completed (orbax's `<step>.orbax-checkpoint-tmp*` directories)."""
  if jax.process_index() != 0:
    return
  for name in os.listdir(directory):
    if '.orbax-checkpoint-tmp' in name:
      shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def _well_formed(leaf: Any) -> bool:
  """Whether an integrity record's leaf entry has a shape, a known dtype and a checksum."""
  if not isinstance(leaf, dict) or not isinstance(leaf.get('checksum'), str):
    return False
  shape = leaf.get('shape')
  if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
    return False
  try:
    jnp.dtype(leaf.get('dtype'))
  except TypeError:
    return False
  return True


def _check_structure(saved: dict[str, tuple], target: Any, where: str) -> None:
  """Raises one ValueError naming the first leaf the checkpoint and the target disagree on.

  Args:
    saved: leaf name ('params/dense/kernel') -> shape, as the checkpoint holds them.
    target: the pytree the caller wants.
    where: the checkpoint's path, for the message.
  """
  target_leaves = {util.key_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(target)[0]}
  hint = 'the model or optimizer config differs from the run that wrote it'
  for name in saved:
    if name not in target_leaves:
      raise ValueError(f'checkpoint {where} has {name!r}, which the state lacks; {hint}')
  for name, leaf in target_leaves.items():
    if name not in saved:
      raise ValueError(f'checkpoint {where} has no {name!r}, which the state needs; {hint}')
    if tuple(saved[name]) != np.shape(leaf):
      raise ValueError(
        f'checkpoint {where} has {name!r} of shape {tuple(saved[name])}, but the state wants '
        f'{np.shape(leaf)}; {hint}'
      )


# Integrity records -----------------------------------------------------------------------------
def _json_sha256(value: Any) -> str:
  """sha256 of the canonical JSON of `value` (sorted keys, no spaces)."""
  text = json.dumps(value, sort_keys=True, separators=(',', ':'))
  return hashlib.sha256(text.encode()).hexdigest()


def _words(x: jax.Array) -> jax.Array:
  """The bits of `x` as a flat uint32 vector: one word per element (two for 64-bit types)."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    x = jnp.stack([x.real, x.imag], axis=-1)
  info = jnp.finfo if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo
  if info(x.dtype).bits < 8:  # sub-byte types (int4, float4): by value, which they fit exactly
    x = x.astype(jnp.float32 if info is jnp.finfo else jnp.int32)
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).reshape(-1)


@jax.jit
def _leaf_checksums(leaves: list) -> jax.Array:
  """Two 32-bit sums per leaf, over every bit; the same on any device layout. [L, 2] uint32.

  The first weights word i by an odd number, so any single flipped bit changes it; the second sums
  a murmur3-style mix of (word, i), so a few corrupted words collide with probability ~2^-32.
  """
  out = []
  for leaf in leaves:
    u = _words(leaf)  # [n]
    out.append(jnp.stack(_mix(u, jax.lax.iota(jnp.uint32, u.size), jnp)))
  return jnp.stack(out) if out else jnp.zeros((0, 2), jnp.uint32)


def _mix(u, i, xp):
  """The two sums of `_leaf_checksums` over words `u` [n] at indices `i` [n]; xp: jnp or np."""
  first = xp.sum(u * (i * xp.uint32(0x9E3779B1) | xp.uint32(1)), dtype=xp.uint32)
  h = u ^ (i * xp.uint32(0x85EBCA77))
  h = (h ^ (h >> xp.uint32(16))) * xp.uint32(0x7FEB352D)
  h = (h ^ (h >> xp.uint32(15))) * xp.uint32(0x846CA68B)
  return first, xp.sum(h ^ (h >> xp.uint32(16)), dtype=xp.uint32)


def _host(x: jax.Array) -> np.ndarray:
  if x.is_fully_addressable or x.is_fully_replicated:
    return np.asarray(x)
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _host_checksums(leaves: list) -> np.ndarray | None:
  """`_leaf_checksums` in NumPy on the host, when every leaf is local and of a 1/2/4-byte type.

  Saves an XLA compile per state structure (seconds on CPU) in single-process runs.
  """
  out = []
  for leaf in leaves:
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
      return None
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      return None
    x = np.asarray(leaf)
    if x.dtype == np.bool_:
      x = x.astype(np.uint8)
    numeric = jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)
    if not numeric or x.dtype.itemsize not in (1, 2, 4) or _bits(x.dtype) < 8:
      return None
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]
    u = np.ascontiguousarray(x).view(unsigned).astype(np.uint32).reshape(-1)
    with np.errstate(over='ignore'):
      out.append(_mix(u, np.arange(u.size, dtype=np.uint32), np))
  return np.asarray(out, np.uint32).reshape(len(out), 2)


def _bits(dtype) -> int:
  info = jnp.finfo if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo
  return info(dtype).bits


def _checksums(tree: Any) -> dict[str, str]:
  """Leaf name -> 16 hex digits that change with any change to the leaf's bits."""
  named = jax.tree_util.tree_flatten_with_path(tree)[0]
  sums = _host_checksums([x for _, x in named])
  if sums is None:  # sharded over processes, or an unusual dtype: on the devices
    sums = _host(_leaf_checksums([jnp.asarray(x) for _, x in named]))  # [L, 2]
  return {util.key_name(p): f'{int(a):08x}{int(b):08x}' for (p, _), (a, b) in zip(named, sums)}


def _integrity_record(state: Any, data_state: dict) -> dict:
  """What `_read` checks: each leaf's shape, dtype and checksum, and the data state's sha256."""
  named = jax.tree_util.tree_flatten_with_path(state)[0]
  sums = _checksums(state)
  leaves = {}
  for path, x in named:
    name = util.key_name(path)
    dtype = getattr(x, 'dtype', None) or jnp.asarray(x).dtype
    leaves[name] = {'shape': list(np.shape(x)), 'dtype': str(dtype), 'checksum': sums[name]}
  record = {'format': _INTEGRITY_FORMAT, 'leaves': leaves, 'data_sha256': _json_sha256(data_state)}
  record['written_by'] = _installed()  # a reader older than this is told so, not called damage
  record['sha256'] = _json_sha256(record)
  return record


def _installed() -> dict[str, str]:
  """The versions of the libraries that write and read a checkpoint's files."""
  return {'orbax-checkpoint': getattr(ocp, '__version__', 'unknown'), 'jax': jax.__version__}


def read_run_config(workdir: str) -> dict | None:
  """The workdir's saved config.json as a dict, or None when there is none."""
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path):
    return None
  try:
    with open(path, 'rb') as f:
      saved = json.loads(f.read().decode())
  except (OSError, ValueError) as e:  # ValueError: not UTF-8 or not JSON
    raise ValueError(f'{path} is unreadable: {e}; restore it or use another workdir') from e
  if not isinstance(saved, dict) or not isinstance(saved.get('model'), dict):
    raise ValueError(
      f'{path} must hold a JSON object with a "model" object (as training writes it); got '
      f'{json.dumps(saved)[:80]}'
    )
  return saved


def check_resume_compatible(workdir: str, config: ml_collections.ConfigDict) -> None:
  """Raises one ValueError if `config` cannot resume the checkpoints in `workdir`; touches nothing.

  Every `model` key must match the saved config.json except RESUMABLE_MODEL_KEYS, and so must the
  DATA_KEYS of `data`. A key that one side lacks counts as its `ModelConfig` default there: a run
  saved before a knob existed resumes while the knob keeps its default (off). A workdir without
  checkpoints or without config.json always passes.
  """
  saved = read_run_config(workdir)
  if saved is None or not util.has_checkpoints(workdir):
    return
  here = json.loads(config.to_json_best_effort())  # JSON-normalised: tuples are lists, as saved
  missing = object()
  show = lambda value: 'absent' if value is missing else json.dumps(value)
  defaults = json.loads(json.dumps(ModelConfig().to_dict()))  # JSON-normalised too
  pairs = []
  saved_model, here_model = saved.get('model', {}), here.get('model', {})
  for key in [*here_model, *(k for k in saved_model if k not in here_model)]:
    if key in RESUMABLE_MODEL_KEYS:
      continue
    there_value, here_value = saved_model.get(key, missing), here_model.get(key, missing)
    if missing in (there_value, here_value) and key in defaults:
      present = here_value if there_value is missing else there_value
      if present == defaults[key]:
        continue  # a knob added (or dropped) since, at its default: the same model
    pairs.append((f'model.{key}', there_value, here_value))
  saved_data, here_data = saved.get('data', {}), here.get('data', {})
  for key in DATA_KEYS:
    pairs.append((f'data.{key}', saved_data.get(key, missing), here_data.get(key, missing)))
  for name, there_value, here_value in pairs:
    if there_value != here_value:
      raise ValueError(
        f'config does not match the checkpoint in {workdir}: {name} is {show(there_value)} there '
        f'and {show(here_value)} here; use another --workdir or the original config'
      )
