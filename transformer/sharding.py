"""Device mesh ('data', 'fsdp', 'tensor'), logical axis rules, sharded init and batch placement.

Parameters and activations carry logical axis names (`nn.with_logical_partitioning`,
`nn.with_logical_constraint`); `config.mesh.rules` maps each name to mesh axes. Everything runs
through `jax.jit` with NamedShardings: data parallel, FSDP (ZeRO-3) and Megatron-style tensor
parallel are the same code with different rules and mesh shapes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from absl import logging
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from transformer.config.experiment import MeshConfig

MESH_AXES = ('data', 'fsdp', 'tensor')
# Every logical axis name the model uses, in rule precedence order (batch claims its mesh axes
# before embed, so activations [batch, length, embed] shard the batch and keep d_model whole).
LOGICAL_AXES = ('batch', 'length', 'embed', 'heads', 'kv_heads', 'kv', 'mlp', 'vocab', 'layers')

Rules = tuple[tuple[str, Any], ...]


def default_rules() -> dict[str, str]:
  """The default rules table, `MeshConfig().rules` (config/experiment.py explains each rule)."""
  return dataclasses.asdict(MeshConfig().rules)


def parse_rules(rules: Mapping[str, str] | Sequence[tuple[str, Any]]) -> Rules:
  """Config rules ({'batch': 'data,fsdp', ...} or pairs) -> flax's ((name, axes), ...) table.

  Raises ValueError for an unknown logical name, an unknown mesh axis, a mesh axis used twice in
  one rule, or a logical name without a rule.
  """
  items = rules.items() if isinstance(rules, Mapping) else rules
  table = {}
  for name, axes in items:
    if name not in LOGICAL_AXES:
      raise ValueError(
        f'unknown logical axis {name!r} in config.mesh.rules; valid names: {list(LOGICAL_AXES)}'
      )
    if isinstance(axes, str):
      axes = tuple(a.strip() for a in axes.split(',') if a.strip())
    elif axes is None:
      axes = ()
    else:
      axes = tuple(axes)
    for axis in axes:
      if axis not in MESH_AXES:
        raise ValueError(
          f'config.mesh.rules.{name}={",".join(axes)!r} names mesh axis {axis!r}; '
          f'valid mesh axes: {list(MESH_AXES)} (or empty for replicated)'
        )
    if len(set(axes)) != len(axes):
      raise ValueError(f'config.mesh.rules.{name} uses a mesh axis twice: {axes}')
    table[name] = axes
  missing = [n for n in LOGICAL_AXES if n not in table]
  if missing:
    raise ValueError(f'config.mesh.rules has no rule for {missing}; give each "" to replicate it')
  return tuple((n, table[n] or None) for n in LOGICAL_AXES)


def mesh_shape(shape: Sequence[int], num_devices: int) -> tuple[int, int, int]:
  """(data, fsdp, tensor) with at most one -1, which takes the devices the others leave."""
  shape = tuple(shape)
  valid = 'three ints, e.g. (8, 1, 1) or (-1, 2, 1) where -1 fills the remaining devices'
  if len(shape) != 3 or not all(isinstance(s, (int, np.integer)) for s in shape):
    raise ValueError(f'config.mesh.shape={shape} must be {valid}')
  if any(s == 0 or s < -1 for s in shape) or shape.count(-1) > 1:
    raise ValueError(f'config.mesh.shape={shape} must be {valid}, sizes >= 1')
  if -1 in shape:
    known = math.prod(s for s in shape if s != -1)
    if num_devices % known:
      raise ValueError(
        f'config.mesh.shape={shape}: {num_devices} devices do not divide by {known}; '
        f'the known axes must divide the device count'
      )
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  if math.prod(shape) != num_devices:
    raise ValueError(
      f'config.mesh.shape={shape} needs {math.prod(shape)} devices, but there are {num_devices}; '
      f'make the product {num_devices} or use -1 for one axis'
    )
  return shape


_CORES_AS_DEVICES = False  # use_every_core() made one CPU device per core


def use_every_core() -> int:
  """On CPU, one JAX device per core this process may run on; returns the count (1: unchanged).

  XLA:CPU runs a device's program one op after another and splits only large ops over threads,
  so a small model's step leaves the other cores idle. With one device per core, a run whose
  mesh is the default splits its batch over them (`default_devices`), each a shard of the same
  global batch: the same data, gradients averaged across the shards (floating-point sums in
  another order). Call before anything touches a device; does nothing when a device count was
  chosen (`XLA_FLAGS=--xla_force_host_platform_device_count`, `jax_num_cpu_devices`), and
  nothing to GPUs and TPUs, which stay the default devices where present.
  """
  global _CORES_AS_DEVICES
  chosen = 'xla_force_host_platform_device_count' in os.environ.get('XLA_FLAGS', '')
  if chosen or jax.config.jax_num_cpu_devices != -1:
    return 1
  cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
  if (cores or 1) > 1:
    jax.config.update('jax_num_cpu_devices', cores)
    _CORES_AS_DEVICES = True
  return cores or 1


def default_devices(mesh_shape: Sequence[int], rows: Sequence[int]) -> list | None:
  """The devices a run lays its mesh over when it names none: None (all of them), except after
  `use_every_core` with the default mesh (-1, 1, 1) in one process: as many CPU devices as
  divide every batch's `rows` (12 rows on 8 cores: 6 devices)."""
  default = tuple(mesh_shape) == (-1, 1, 1) and jax.process_count() == 1
  if not (_CORES_AS_DEVICES and default and jax.default_backend() == 'cpu'):
    return None
  devices = jax.devices()
  count = max(n for n in range(1, len(devices) + 1) if all(r % n == 0 for r in rows))
  return devices[:count]


def make_mesh(shape: Sequence[int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ('data', 'fsdp', 'tensor') mesh over `devices` (default: every device of every process)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(shape, len(devices))
  auto = (AxisType.Auto,) * 3
  if len(devices) == len(jax.devices()):  # the whole job: let JAX order devices for the topology
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)
  return Mesh(np.array(devices).reshape(shape), MESH_AXES, axis_types=auto)


# The partitioners whose context() is open, innermost last: `layers.constrain` reads the mesh
# and rules of the last one.
ACTIVE: list[Partitioner] = []


class Partitioner:
  """A mesh plus logical rules: shardings for pytrees, batch placement and the jit context."""

  def __init__(self, mesh: Mesh, rules: Rules):
    self.mesh, self.rules = mesh, rules

  @classmethod
  def from_config(cls, mesh_cfg: Any, devices: Sequence[jax.Device] | None = None) -> Partitioner:
    """From `config.mesh` (a MeshConfig, or its ConfigDict); None means all devices data
    parallel."""
    if mesh_cfg is None:
      return cls(make_mesh((-1, 1, 1), devices), parse_rules(default_rules()))
    rules = mesh_cfg.rules
    if isinstance(rules, ml_collections.ConfigDict):
      rules = rules.to_dict()
    elif dataclasses.is_dataclass(rules):  # MeshRules: its fields in order
      rules = dataclasses.asdict(rules)
    return cls(make_mesh(tuple(mesh_cfg.shape), devices), parse_rules(rules))

  @contextlib.contextmanager
  def context(self) -> Iterator[None]:
    """While tracing inside it, the models' `constrain` calls take effect on this mesh."""
    ACTIVE.append(self)
    try:
      yield
    finally:
      ACTIVE.pop()

  def spec(self, logical: Sequence[str | None]) -> PartitionSpec:
    return nn.logical_to_mesh_axes(tuple(logical), self.rules)

  def sharding(self, logical: Sequence[str | None]) -> NamedSharding:
    return NamedSharding(self.mesh, self.spec(logical))

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())

  def axis_size(self, axes: Any) -> int:
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return math.prod(self.mesh.shape[a] for a in axes)

  def tree_shardings(self, boxed_abstract: Any) -> Any:
    """NamedShardings for the unboxed form of a pytree whose leaves may be logically boxed.

    Checks that every sharded dimension divides by its mesh axes; raises ValueError naming the
    parameter, its shape, the logical axis and the mesh axes otherwise.
    """
    specs = nn.get_partition_spec(boxed_abstract)  # logical names per leaf, () when unboxed
    leaves = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(boxed_abstract))[0]
    flat_specs = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    for (path, leaf), logical in zip(leaves, flat_specs):
      for name in logical:
        if name is not None and name not in LOGICAL_AXES:
          raise ValueError(
            f'{jax.tree_util.keystr(path)} uses unknown logical axis {name!r}; '
            f'valid: {list(LOGICAL_AXES)}'
          )
      self._check_divisible(jax.tree_util.keystr(path), leaf.shape, logical)
    return nn.logical_to_mesh_sharding(specs, self.mesh, self.rules)

  def sharded_init(self, make: Callable, *args: Any) -> tuple[Callable, Any, Any]:
    """A pytree factory placed on the mesh: (jitted `make`, its shardings, its abstract value).

    `make(*args, boxed=True)` returns the tree with its leaves' logical axis names (flax's
    `nn.with_logical_partitioning`), which give the shardings; the jitted `make(*args)` creates
    each array directly on its devices (never whole on one). The abstract value is the tree's
    ShapeDtypeStructs with those shardings: a restore target for orbax.
    """
    shardings = self.tree_shardings(jax.eval_shape(functools.partial(make, boxed=True), *args))
    abstract = with_shardings(jax.eval_shape(make, *args), shardings)
    # Outside the mesh context: flax would constrain DenseGeneral's flat init shapes.
    return jax.jit(make, out_shardings=shardings), shardings, abstract

  def _check_divisible(self, what: str, shape: Sequence[int], logical: Sequence[str | None]):
    mesh_axes = self.spec(logical)
    for dim, (size, name, axes) in enumerate(zip(shape, logical, mesh_axes)):
      parts = self.axis_size(axes)
      if size % parts:
        hint = ' or set config.data.vocab_multiple' if name == 'vocab' else ''
        raise ValueError(
          f'{what}: dimension {dim} (logical {name!r}) has size {size}, which mesh axes {axes} '
          f'of total size {parts} do not divide (mesh {dict(self.mesh.shape)}); change '
          f'config.mesh.shape, or config.mesh.rules.{name} to shard it differently{hint}'
        )

  def batch_sharding(self, ndim: int = 2) -> NamedSharding:
    """Data batches: [batch, length, ...] with the batch split by the 'batch' rule."""
    return self.sharding(('batch', 'length') + (None,) * (ndim - 2))

  def check_batch_rows(self, name: str, rows: int) -> None:
    """A global batch of `rows` must split evenly over the processes and the mesh's batch axes;
    raises ValueError naming `name` (e.g. 'data.batch_size') and the multiple to use otherwise."""
    parts = self.axis_size(self.spec(('batch',))[0])
    for divisor, what in ((jax.process_count(), 'processes'), (parts, 'mesh batch shards')):
      if rows % divisor:
        raise ValueError(
          f'{name}={rows} does not divide over {divisor} {what} '
          f'(mesh {dict(self.mesh.shape)}); use a multiple of {divisor}'
        )

  def place_batch(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """This process's rows of a batch -> global arrays on the mesh (rows of all processes).

    Every process passes its own `batch_size // process_count` rows, in process order.
    """
    out = {}
    for key, local in batch.items():
      local = np.asarray(local)
      sharding = self.batch_sharding(local.ndim)
      global_rows = local.shape[0] * jax.process_count()
      parts = self.axis_size(sharding.spec[0])
      if global_rows % parts:
        raise ValueError(
          f'batch {key!r} has {global_rows} rows across processes, which the mesh batch axes '
          f'{sharding.spec[0]} of total size {parts} do not divide; make config.data.batch_size '
          f'(and eval_batch_size) a multiple of {parts}'
        )
      out[key] = jax.make_array_from_process_local_data(sharding, local)
    return out

  def jit(
    self,
    fn: Callable,
    in_shardings: Any,
    out_shardings: Any,
    donate_argnums: tuple[int, ...] = (),
  ) -> Callable:
    """`jax.jit(fn, ...)` whose calls trace under `self.context()` (so constraints apply)."""
    jitted = jax.jit(
      fn, in_shardings=in_shardings, out_shardings=out_shardings, donate_argnums=donate_argnums
    )
    return _InContext(jitted, self)

  def replicate(self, x: Any) -> jax.Array:
    """A host value that every process holds identically -> a replicated global array."""
    return jax.make_array_from_process_local_data(self.replicated, np.asarray(x))


class _InContext:
  """A jitted function that traces and lowers under its partitioner's context."""

  def __init__(self, jitted: Callable, partitioner: Partitioner):
    self._jitted, self._partitioner = jitted, partitioner

  def __call__(self, *args):
    with self._partitioner.context():
      return self._jitted(*args)

  def lower(self, *args):
    with self._partitioner.context():
      return self._jitted.lower(*args)

  def _cache_size(self) -> int:
    return self._jitted._cache_size()


def with_shardings(abstract: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs of `abstract` carrying `shardings`: a restore target for orbax."""
  return jax.tree_util.tree_map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
  )


# Multi-host -----------------------------------------------------------------------------------
# Seconds without a heartbeat before the coordination service declares a process dead and stops
# every other one. Heartbeats come from a C++ thread of each process, not from Python, so long
# compiles, checkpoint saves and evaluations never delay them (one holding the GIL does not
# either); only a dead, frozen or cut-off process misses them. See docs/reliability.md.
HEARTBEAT_TIMEOUT_SECONDS = 30
# How long every process waits for all of them to join at start-up: the hosts of a large job
# start minutes apart (image pulls, scheduling), so this one stays at JAX's default.
INITIALIZATION_TIMEOUT_SECONDS = 300
# How long a finished process waits at exit for the others to finish too.
SHUTDOWN_TIMEOUT_SECONDS = 60


def initialize_distributed(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
) -> bool:
  """Joins a multi-process job through `jax.distributed.initialize`; returns True if it did.

  Explicit arguments (from --coordinator_address/--num_processes/--process_id) win. Otherwise a
  multi-host environment is detected: SLURM with more than one task, or a Cloud TPU pod slice;
  `jax.distributed.initialize()` then reads everything from the environment. A single machine
  does nothing. Must run before anything touches a device. A process that stops sending
  heartbeats for HEARTBEAT_TIMEOUT_SECONDS is declared dead (docs/reliability.md).
  """
  explicit = [coordinator_address, num_processes, process_id]
  if any(v is not None for v in explicit):
    if any(v is None for v in explicit):
      raise ValueError(
        'multi-process runs need all of --coordinator_address, --num_processes and '
        f'--process_id; got {coordinator_address!r}, {num_processes!r}, {process_id!r}'
      )
    if not 0 <= process_id < num_processes:
      raise ValueError(f'--process_id={process_id} must be in [0, {num_processes})')
    _cpu_collectives()
    jax.distributed.initialize(coordinator_address, num_processes, process_id, **_TIMEOUTS)
    _no_cache_on_cpu()
    return True
  slurm = int(os.environ.get('SLURM_NTASKS', '1')) > 1
  tpu_pod = len(os.environ.get('TPU_WORKER_HOSTNAMES', '').split(',')) > 1
  if slurm or tpu_pod:
    _cpu_collectives()
    jax.distributed.initialize(**_TIMEOUTS)
    _no_cache_on_cpu()
    return True
  return False


_TIMEOUTS = {
  'initialization_timeout': INITIALIZATION_TIMEOUT_SECONDS,
  'heartbeat_timeout_seconds': HEARTBEAT_TIMEOUT_SECONDS,
  'shutdown_timeout_seconds': SHUTDOWN_TIMEOUT_SECONDS,
}


def _no_cache_on_cpu() -> None:
  """Multi-process CPU runs (gloo) compile afresh: with jax 0.12.1, a two-process run resumed on a
  warm persistent compilation cache (JAX_COMPILATION_CACHE_DIR) waited forever before its first
  step (jax 0.10 resumes fine). One line says so; GPU and TPU runs keep the cache."""
  newer = tuple(int(x) for x in jax.__version__.split('.')[:2]) >= (0, 12)  # 0.10 resumes fine
  if newer and jax.default_backend() == 'cpu' and jax.config.jax_compilation_cache_dir:
    jax.config.update('jax_enable_compilation_cache', False)
    if jax.process_index() == 0:
      logging.warning(
        'the persistent compilation cache (%s) is off in this multi-process CPU run: a resumed '
        'run on jax 0.12 waited forever on it',
        jax.config.jax_compilation_cache_dir,
      )


def _cpu_collectives() -> None:
  """Cross-process collectives for CPU devices (tests, CPU clusters); GPUs/TPUs ignore it."""
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
