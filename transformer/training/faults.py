"""What a long run does about faults: stop signals, non-finite steps, loss spikes, out of memory.

The training loop (`transformer.training.loop`) uses these; docs/reliability.md lists each
fault, what sparrow does about it and the test that shows it.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import re
import signal
import threading
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from transformer import util
from transformer.model import models, objectives
from transformer.training.state import model_inputs

# Exit status of a run stopped by SIGTERM/SIGINT after saving its checkpoint: sysexits.h's
# EX_TEMPFAIL ("try again later"), distinct from errors (1, 2) and from deaths by a signal (128+N).
EXIT_PREEMPTED = 75
MAX_ROLLBACKS = 3  # rollbacks to one checkpoint before the run halts instead of looping
MAX_SKIPS_IN_A_ROW = 25  # non-finite steps in a row that 'skip' accepts before it halts


class Preempted(Exception):
  """SIGTERM or SIGINT stopped the run after it saved a checkpoint; the same command resumes it."""

  def __init__(self, message: str, *, step: int, signal_name: str | None):
    super().__init__(message)
    self.step = step  # the step saved, which a rerun resumes from
    self.signal_name = signal_name  # 'SIGTERM' | 'SIGINT'; None if only another process got one


class NonFiniteError(ValueError):
  """A step's loss or gradient was NaN or Inf and train.nonfinite says to stop (or gave up)."""


class OutOfMemoryError(ValueError):
  """The train step does not fit in device memory; the message has the estimate and the knobs."""


# Config ------------------------------------------------------------------------------------------
def nonfinite_policy(policy: str, dtype: str) -> str:
  """train.nonfinite (`policy`, checked by TrainConfig) with 'auto' resolved: 'skip' for float16
  (loss scaling), else 'halt'."""
  if policy == 'auto':
    return 'skip' if dtype == 'float16' else 'halt'
  return policy


# Stop signals ----------------------------------------------------------------------------------
class StopSignals:
  """While open, SIGTERM and SIGINT ask the run to stop after its current step.

  The first signal only sets `received`, which the loop polls after each step. A second one is
  handled as if this object had not been installed: SIGTERM ends the process at once, SIGINT
  raises KeyboardInterrupt. A checkpoint being written then is left as orbax's temp directory,
  which is never listed and is deleted by the next run. Closing restores the previous handlers.
  Python only lets the main thread install handlers; elsewhere nothing is installed.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.received: str | None = None  # name of the first signal, e.g. 'SIGTERM'
    self._previous: dict[int, Any] = {}

  def __enter__(self) -> StopSignals:
    if threading.current_thread() is threading.main_thread():
      for signum in self.SIGNALS:
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def close(self) -> None:
    """Puts back the handlers that were there before."""
    previous, self._previous = self._previous, {}
    for signum, handler in previous.items():
      signal.signal(signum, signal.SIG_DFL if handler is None else handler)

  def _handle(self, signum: int, frame: Any) -> None:
    name = signal.Signals(signum).name
    if self.received is None:
      self.received = name  # no printing here: the signal may interrupt a print
      return
    self.close()
    os.write(2, f'\nsecond {name}: stopping at once, without waiting for a checkpoint\n'.encode())
    signal.raise_signal(signum)  # now handled as it was before this object


class HostAgreement:
  """The element-wise max of a few int flags over all processes: the same answer on each.

  One process needs no agreement: `combine` returns its own flags. With several, the max is
  computed on the devices and read at the next call, so no call waits for the other processes:
  `combine(flags)` returns the agreed flags of the previous call (zeros the first time).
  """

  def __init__(self, size: int):
    self.size = size
    self._pending: jax.Array | None = None
    if jax.process_count() > 1:
      mesh = Mesh(np.asarray(jax.devices()), ('devices',))
      self._sharding = NamedSharding(mesh, PartitionSpec('devices'))
      replicated = NamedSharding(mesh, PartitionSpec())
      self._max = jax.jit(lambda x: jnp.max(x, axis=0), out_shardings=replicated)

  def now(self, flags: Sequence[int]) -> np.ndarray:
    """The agreed flags of this call: waits for every process (use it outside the step loop)."""
    flags = np.asarray(flags, np.int32).reshape(self.size)
    if jax.process_count() == 1:
      return flags
    local = np.broadcast_to(flags, (jax.local_device_count(), self.size))
    return np.asarray(self._max(jax.make_array_from_process_local_data(self._sharding, local)))

  def combine(self, flags: Sequence[int]) -> np.ndarray:
    flags = np.asarray(flags, np.int32).reshape(self.size)
    if jax.process_count() == 1:
      return flags
    agreed = np.zeros(self.size, np.int32) if self._pending is None else np.asarray(self._pending)
    local = np.broadcast_to(flags, (jax.local_device_count(), self.size))
    self._pending = self._max(jax.make_array_from_process_local_data(self._sharding, local))
    return agreed


# Loss spikes -------------------------------------------------------------------------------------
class SpikeDetector:
  """A loss above `factor` x the median of the last `window` losses is a spike (factor 0 = off).

  Nothing is flagged until the window is full, so a resumed run waits `window` steps (a rollback
  keeps the losses up to its checkpoint). Spikes enter the window too: the median shrugs off a
  few, and follows a lasting shift.
  """

  def __init__(self, factor: float, window: int):
    self.factor = factor
    self._losses: collections.deque = collections.deque(maxlen=max(int(window), 1))

  def check(self, step: int, loss: float) -> float | None:
    """Adds the loss of `step`; returns loss / median if it is a spike, else None."""
    if not self.factor or not math.isfinite(loss):
      return None
    ratio = None
    if len(self._losses) == self._losses.maxlen:
      median = float(np.median([value for _, value in self._losses]))
      if median > 0 and loss > self.factor * median:
        ratio = loss / median
    self._losses.append((step, loss))
    return ratio

  def forget_after(self, step: int) -> None:
    """Drops the losses of steps after `step` (after a rollback)."""
    kept = [(s, value) for s, value in self._losses if s <= step]
    self._losses.clear()
    self._losses.extend(kept)


# Finding the first non-finite tensor -----------------------------------------------------------
def describe_nonfinite(
  run: Any, params: Any, host_batch: dict[str, np.ndarray], rng: jax.Array, step: int, scale: float
) -> str:
  """Names the first non-finite tensor of a bad step by recomputing the step; one sentence.

  Only called after a bad step, so the train step itself stays as it was. Looks in order at the
  batch's float arrays, the parameters, then each micro-batch's forward pass (the output of every
  module, in the order the modules finish), its loss, and its gradients, where the deepest
  non-finite one is named: backprop starts there and carries it into every layer before it.
  Every process must call it: the recomputation runs on the whole mesh.

  Args:
    run: the `Run` of the step.
    params: the parameters the step started from (a non-finite step leaves them unchanged).
    host_batch: this process's rows of the step's batch.
    rng: the run's dropout key; the step used fold_in(rng, step - 1), as train_step does.
    step: the 1-based step that was not finite.
    scale: the loss scale the step used (1 unless float16).
  """
  with run.partitioner.context():
    count = jax.jit(_count_tree, out_shardings=run.partitioner.replicated)
    param_counts = jax.device_get(count(params))
  modules, result = _recompute(run, params, host_batch, rng, step, scale)
  order = _forward_order(modules)
  for key, value in host_batch.items():  # this process's rows only
    if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
      return (
        f'batch[{key!r}] is non-finite ({_nan_inf(np.isnan(value).sum(), np.isinf(value).sum())})'
      )
  bad = sorted((name for name, c in param_counts.items() if c.any()), key=order)
  if bad:
    more = f', and {len(bad) - 1} more parameters' if len(bad) > 1 else ''
    return f'parameter {bad[0]} is non-finite ({_nan_inf(*param_counts[bad[0]])}){more}'
  if result is None:
    return (
      'the gradient norm was non-finite, but recomputing the step gave finite values everywhere '
      '(a transient device fault?)'
    )
  index, activations, loss, grad_counts, grad_max = result
  where = f'micro-batch {index + 1} of {run.experiment.train.grad_accum_steps}: ' if index else ''
  for name, counts in activations:
    if counts.any():
      first = 'the first in the forward pass'
      return f'{where}the output of {name} is non-finite ({_nan_inf(*counts)}), {first}'
  if not math.isfinite(loss):
    return f'{where}the loss is non-finite ({loss}) while every activation is finite'
  bad = sorted((name for name, c in grad_counts.items() if c.any()), key=order)
  if not bad:
    largest = max(grad_max, key=lambda name: grad_max[name])
    return (
      f'{where}every gradient is finite but their norm overflows: the largest entry, '
      f'{float(grad_max[largest]):.3g}, is in the gradient of {largest}; the loss ({loss:.4g}) '
      'and every activation are finite'
    )
  return (
    f'{where}gradient of {bad[-1]} is non-finite ({_nan_inf(*grad_counts[bad[-1]])}), the '
    f'deepest of {len(bad)} non-finite gradients (backprop carries it to the layers before); '
    f'the loss ({loss:.4g}) and every activation are finite'
  )


def _nan_inf(nans: Any, infs: Any) -> str:
  return f'{int(nans)} NaN, {int(infs)} Inf'


def _count_tree(tree: Any) -> dict[str, jax.Array]:
  """Leaf name -> [NaN count, Inf count] (int32)."""
  return {util.key_name(p): _counts(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _counts(x: jax.Array) -> jax.Array:
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros((2,), jnp.int32)
  return jnp.stack([jnp.isnan(x).sum(dtype=jnp.int32), jnp.isinf(x).sum(dtype=jnp.int32)])


def _forward_order(modules: list[str]):
  """A sort key for parameter names: where their module first finishes in the forward pass.

  Names of modules never seen (a scanned stack) sort after, in natural order (layer_2 < layer_10).
  """
  first = {}
  for index, module in enumerate(modules):
    first.setdefault(module.split('.')[0], index)

  def key(name: str):
    natural = [int(t) if t.isdigit() else t for t in re.split(r'(\d+)', name)]
    return (first.get(name.rsplit('/', 1)[0], len(first)), natural)

  return key


def _recorder(records: list):
  """An `nn.intercept_methods` interceptor: appends (module name, [NaN, Inf]) per module call."""

  def intercept(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    floats = [
      x
      for x in jax.tree_util.tree_leaves(out)
      if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    if floats:
      module = context.module
      name = '/'.join(module.path) or type(module).__name__
      if context.method_name != '__call__':
        name = f'{name}.{context.method_name}'
      records.append((name, sum(_counts(x) for x in floats)))
    return out

  return intercept


def _recompute(run, params, host_batch, rng, step, scale):
  """Reruns the step one micro-batch at a time, as train_step does.

  Returns (module names in the order they finish, result): result is (micro-batch index,
  [(module, [NaN, Inf])], loss, {parameter: [NaN, Inf] of its gradient}, {parameter: largest
  |gradient|}) for the first micro-batch with anything non-finite (the gradient norm included),
  or None.
  """
  cfg = run.experiment.train
  accum, label_smoothing = cfg.grad_accum_steps, cfg.label_smoothing
  # Module outputs are read through an interceptor; inside remat or a scanned stack they would
  # be values of an inner trace, so they are read from the same model without remat (the same
  # numbers), and not at all from a scanned stack.
  plain = None
  if not run.model_cfg.scan_layers:
    plain = models.build(dataclasses.replace(run.model_cfg, remat='none'))
  names: list[str] = []

  def diagnose(params, batch, rng, index, counter, scale):  # counter = state.step = step - 1
    def pick(x):  # micro-batch `index` of [B, ...], as train_step splits it
      x = x.reshape((accum, x.shape[0] // accum) + x.shape[1:])
      return jax.lax.dynamic_index_in_dim(x, index, keepdims=False)

    micro = jax.tree_util.tree_map(pick, batch)
    dropout_rng = jax.random.fold_in(rng, counter)  # as train_step: fold_in(rng, state.step)
    if accum > 1:
      dropout_rng = jax.random.fold_in(dropout_rng, index)
    inputs, size = model_inputs(run.family, micro), micro['weights'].size

    def loss_fn(p, model):  # train_step's, with its loss scale
      logits = model.apply(
        {'params': p}, **inputs, deterministic=False, rngs={'dropout': dropout_rng}
      )
      sums = objectives.compute_metrics(
        logits, micro['targets'], micro['weights'], label_smoothing, accuracy=False
      )
      return sums['loss'] * scale / size, sums

    records = []
    if plain is not None:
      with nn.intercept_methods(_recorder(records)):
        loss_fn(params, plain)
      names[:] = [name for name, _ in records]
    grads, sums = jax.grad(lambda p: loss_fn(p, run.model), has_aux=True)(params)
    grads = jax.tree_util.tree_map(lambda g: g * (size / scale), grads)
    loss = sums['loss'] / jnp.maximum(sums['denominator'], 1.0)
    named = jax.tree_util.tree_flatten_with_path(grads)[0]
    largest = {util.key_name(p): jnp.max(jnp.abs(g)).astype(jnp.float32) for p, g in named}
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for _, g in named))
    return [counts for _, counts in records], loss, _count_tree(grads), largest, norm

  with run.partitioner.context():
    fn = jax.jit(diagnose, out_shardings=run.partitioner.replicated)
    batch = run.place(host_batch)
    for index in range(accum):
      args = (params, batch, rng, index, np.int32(step - 1), np.float32(scale))
      activations, loss, grads, largest, norm = jax.device_get(fn(*args))
      activations = list(zip(names, activations))
      bad = any(c.any() for _, c in activations) or any(c.any() for c in grads.values())
      if bad or not math.isfinite(loss) or not math.isfinite(norm):
        return names, (index, activations, float(loss), grads, largest)
  return names, None


# Out of memory -------------------------------------------------------------------------------
def is_out_of_memory(error: BaseException) -> bool:
  """Whether `error` is XLA's RESOURCE_EXHAUSTED / out of memory (at compile or at run time)."""
  if isinstance(error, MemoryError):
    return True
  text = str(error)
  return 'RESOURCE_EXHAUSTED' in text or 'out of memory' in text.lower()


def out_of_memory_error(run: Any, error: BaseException, host_batch: dict) -> OutOfMemoryError:
  """One clear error for a train step that ran out of memory: its size, and what shrinks it.

  The size comes from compiling the step again for its memory analysis; when that fails too (a
  compile-time out of memory), from what the error says.
  """
  stats = None
  try:
    batch = {
      k: jax.ShapeDtypeStruct(
        (v.shape[0] * jax.process_count(),) + v.shape[1:],
        v.dtype,
        sharding=run.partitioner.batch_sharding(v.ndim),
      )
      for k, v in host_batch.items()
    }
    rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=run.partitioner.replicated)
    stats = run.train_step.lower(run.abstract_state, batch, rng).compile().memory_analysis()
  except Exception:  # the compile itself may run out of memory (TPU): no estimate then
    stats = None
  said = util.first_line(error)
  if stats is not None:
    state = stats.argument_size_in_bytes
    temp = stats.temp_size_in_bytes + stats.generated_code_size_in_bytes
    out = stats.output_size_in_bytes - stats.alias_size_in_bytes
    size = (
      f'XLA estimates {_gib(state + out + temp)} per device (arguments {_gib(state)}: parameters, '
      f'optimizer state and batch; temporaries {_gib(temp)}; outputs not in place {_gib(out)})'
    )
  else:
    size = 'XLA gave no estimate'
  limit = (jax.local_devices()[0].memory_stats() or {}).get('bytes_limit')
  have = f' and a device has {_gib(limit)}' if limit else ''
  config, cfg = run.experiment, run.model_cfg
  d = config.data
  knobs = [
    f'lower data.batch_size={d.batch_size} (or keep it and raise '
    f'train.grad_accum_steps={config.train.grad_accum_steps}: smaller micro-batches)'
  ]
  remat = {'none': "'save_matmuls' or 'full'", 'save_matmuls': "'full'"}.get(cfg.remat)
  if remat:
    knobs.append(f'set model.remat={remat} (now {cfg.remat!r})')
  if run.family == 'encoder_decoder':
    lengths = f'data.max_source_length={d.max_source_length}'
    knobs.append(f'lower {lengths} or data.max_target_length={d.max_target_length}')
  else:
    knobs.append(f'lower data.max_length={d.max_length}')
  shape = tuple(run.partitioner.mesh.shape.values())
  if jax.device_count() > 1:
    knobs.append(
      f'shard parameters and optimizer state over more devices: config.mesh.shape={shape} with '
      f'a larger fsdp axis, e.g. (1, {jax.device_count()}, 1)'
    )
  return OutOfMemoryError(
    f'the train step does not fit in device memory: {size}{have}. XLA said: {said}. '
    f'To fit it, {"; ".join(knobs)}'
  )


def _gib(num_bytes: float) -> str:
  return f'{num_bytes / 2**30:.2f} GiB'
