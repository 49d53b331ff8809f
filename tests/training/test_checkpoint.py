"""Tests for transformer.training.checkpoint: orbax save/restore, retention, atomicity, metadata."""

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from configs import base
from transformer.training import checkpoint, provenance


@flax.struct.dataclass
class TrainState:  # the shape of training.state.TrainState: a dataclass pytree, not a dict
  step: jax.Array
  params: dict
  opt_state: object


def _random_state(seed: int) -> dict:
  rng = np.random.default_rng(seed)
  return {
    'params': {
      'dense': {
        'kernel': rng.standard_normal((3, 5)).astype(np.float32),
        'bias': rng.standard_normal((5,)).astype(jnp.bfloat16),
      },
      'blocks': [
        rng.integers(-(2**31), 2**31 - 1, (2, 7), dtype=np.int32),
        np.float32(rng.standard_normal()),  # a scalar leaf
      ],
    },
    'step': np.int32(seed),
  }


def _assert_trees_equal(actual, expected):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    a, e = np.asarray(a), np.asarray(e)
    assert a.dtype == e.dtype and a.shape == e.shape
    bits = lambda x: x.reshape(-1).view(np.uint8)  # compare bit patterns, bfloat16 included
    np.testing.assert_array_equal(bits(a), bits(e))


def _abstract(tree, sharding=None):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding), tree)


def _save(ckpt, step):
  state = _random_state(step)
  assert ckpt.save(step, jax.tree.map(jnp.asarray, state), {'position': step})
  return state


# Checkpointer ----------------------------------------------------------------------------------
def test_round_trip_is_exact_in_a_fresh_checkpointer(tmp_path):
  state = _random_state(3)
  data_state = {'epoch': 2, 'offset': 2**40 + 1, 'loss': 0.1 + 0.2, 'files': ['a', 'b'], 'x': {}}
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  assert ckpt.latest_step() is None and ckpt.all_steps() == []
  assert ckpt.save(12, jax.tree.map(jnp.asarray, state), data_state)
  ckpt.close()

  resumed = checkpoint.Checkpointer(str(tmp_path))  # a new process would see exactly this
  assert resumed.latest_step() == 12 and resumed.all_steps() == [12]
  restored, restored_data, step = resumed.restore(_abstract(state))
  assert step == 12
  _assert_trees_equal(restored, state)
  assert restored_data == data_state
  assert {'data', 'state'} <= set(os.listdir(tmp_path / 'checkpoints' / '12'))


def test_restores_a_train_state_dataclass_with_optax_state(tmp_path):
  params = {'w': jnp.asarray(np.random.default_rng(0).standard_normal((4, 3)), jnp.float32)}
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
  opt_state = tx.update(params, tx.init(params), params)[1]  # count = 1, mu/nu nonzero
  state = TrainState(step=jnp.int32(7), params=params, opt_state=opt_state)
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  ckpt.save(7, state, {'position': 70})
  target = TrainState(jnp.int32(0), jax.tree.map(jnp.zeros_like, params), tx.init(params))
  restored, data_state, _ = ckpt.restore(target)  # concrete arrays as the target, as train.py does
  assert isinstance(restored, TrainState) and data_state == {'position': 70}
  _assert_trees_equal(restored, state)
  ckpt.close()


def test_keeps_only_the_last_checkpoints(tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=2)
  states = {step: _save(ckpt, step) for step in [10, 20, 30, 40, 50]}
  ckpt.close()
  assert ckpt.all_steps() == [40, 50]
  on_disk = sorted(int(n) for n in os.listdir(tmp_path / 'checkpoints') if n.isdigit())
  assert on_disk == [40, 50]
  restored, data_state, step = checkpoint.Checkpointer(str(tmp_path)).restore(
    _abstract(states[40]), step=40
  )
  assert step == 40 and data_state == {'position': 40}
  _assert_trees_equal(restored, states[40])


def test_half_written_checkpoints_are_ignored(tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  state = _save(ckpt, 3)
  ckpt.close()
  # A save cut short leaves orbax's temporary directory (this version's name, and an older form).
  for name in ['7.orbax-checkpoint-tmp', '8.orbax-checkpoint-tmp-1234567']:
    (tmp_path / 'checkpoints' / name / 'state').mkdir(parents=True)
    (tmp_path / 'checkpoints' / name / 'state' / 'junk').write_bytes(os.urandom(64))

  resumed = checkpoint.Checkpointer(str(tmp_path))
  assert resumed.latest_step() == 3 and resumed.all_steps() == [3]
  restored, data_state, step = resumed.restore(_abstract(state))
  assert step == 3 and data_state == {'position': 3}
  _assert_trees_equal(restored, state)
  new_state = _save(resumed, 7)  # the step that was cut short saves cleanly
  resumed.close()
  assert not [n for n in os.listdir(tmp_path / 'checkpoints') if 'tmp' in n]
  restored, _, step = checkpoint.Checkpointer(str(tmp_path)).restore(_abstract(new_state))
  assert step == 7
  _assert_trees_equal(restored, new_state)


def test_save_skips_saved_and_older_steps_unless_forced(tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=5)
  _save(ckpt, 5)
  state = jax.tree.map(jnp.asarray, _random_state(0))
  assert not ckpt.save(5, state, {})  # e.g. the final step that was also a periodic one
  assert not ckpt.save(4, state, {})
  assert not ckpt.save(5, state, {}, force=True)
  assert ckpt.save(4, state, {'position': 4}, force=True)
  assert ckpt.all_steps() == [4, 5]
  assert ckpt.restore(_abstract(_random_state(0)), step=4)[1] == {'position': 4}
  ckpt.close()


def test_async_save(tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path), async_save=True)
  state = _save(ckpt, 1)
  ckpt.wait()
  ckpt.close()
  restored, data_state, _ = checkpoint.Checkpointer(str(tmp_path)).restore(_abstract(state))
  _assert_trees_equal(restored, state)
  assert data_state == {'position': 1}


def test_restore_lands_on_the_requested_sharding(tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  state = _save(ckpt, 1)
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  restored, _, _ = ckpt.restore(_abstract(state, sharding))
  for leaf in jax.tree.leaves(restored):
    assert isinstance(leaf, jax.Array) and leaf.sharding == sharding
  _assert_trees_equal(restored, state)
  ckpt.close()


_RESHARD_SCRIPT = """
import sys
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from transformer.training import checkpoint

workdir = sys.argv[1]
devices = np.array(jax.devices())
assert devices.size == 4, devices
x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6) / 7
row_mesh = Mesh(devices, ('rows',))
saved = jax.device_put(x, NamedSharding(row_mesh, P('rows')))  # written as 4 row blocks
ckpt = checkpoint.Checkpointer(workdir)
ckpt.save(1, {'x': saved}, {})
ckpt.wait()
grid = NamedSharding(Mesh(devices.reshape(2, 2), ('a', 'b')), P('b', 'a'))
one = jax.sharding.SingleDeviceSharding(jax.devices()[3])
for target in [grid, one]:
  abstract = {'x': jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=target)}
  restored = ckpt.restore(abstract)[0]['x']
  assert restored.sharding == target, restored.sharding
  np.testing.assert_array_equal(np.asarray(restored), x)
  for shard in restored.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), x[shard.index])
ckpt.close()
print('resharded ok')
"""


def test_restore_onto_another_device_layout(tmp_path):
  # Four CPU devices need XLA_FLAGS before jax starts, hence a fresh interpreter.
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=4', JAX_PLATFORMS='cpu')
  root = os.path.dirname(os.path.dirname(os.path.abspath(checkpoint.__file__)))
  result = subprocess.run(
    [sys.executable, '-c', textwrap.dedent(_RESHARD_SCRIPT), str(tmp_path)],
    cwd=root,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'resharded ok' in result.stdout


def test_restore_errors_are_clear(tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  state = _random_state(1)
  with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / 'checkpoints'))):
    ckpt.restore(_abstract(state))
  _save(ckpt, 1)
  with pytest.raises(FileNotFoundError, match=r'step 2 .*have \[1\]'):
    ckpt.restore(_abstract(state), step=2)
  renamed = {**state, 'params': {**state['params'], 'dense2': state['params']['dense']}}
  with pytest.raises(ValueError, match="no 'params/dense2/bias'"):
    ckpt.restore(_abstract(renamed))
  del renamed['params']['dense']
  with pytest.raises(ValueError, match="has 'params/dense/bias', which the state lacks"):
    ckpt.restore(_abstract(renamed))
  reshaped = jax.tree.map(lambda x: x, state)
  reshaped['params']['dense']['kernel'] = np.zeros((5, 3), np.float32)
  with pytest.raises(ValueError, match=r"'params/dense/kernel' of shape \(3, 5\).*\(5, 3\)"):
    ckpt.restore(_abstract(reshaped))
  ckpt.close()


def test_bad_arguments(tmp_path):
  blocker = tmp_path / 'a_file'
  blocker.write_text('not a directory')
  with pytest.raises(ValueError, match=re.escape(f"workdir '{blocker}/run' is not writable")):
    checkpoint.Checkpointer(str(blocker / 'run'))
  with pytest.raises(ValueError, match='keep=0'):
    checkpoint.Checkpointer(str(tmp_path), keep=0)
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  state = {'x': jnp.zeros(2)}
  with pytest.raises(ValueError, match='JSON dict'):
    ckpt.save(1, state, [1, 2])
  with pytest.raises(ValueError, match='JSON-serialisable'):
    ckpt.save(1, state, {'rng': np.zeros(2)})
  assert ckpt.all_steps() == []
  ckpt.close()


@pytest.mark.skipif(os.geteuid() == 0, reason='root can write anywhere')
def test_read_only_workdir(tmp_path):
  tmp_path.chmod(0o500)
  try:
    with pytest.raises(ValueError, match='not writable.*choose another --workdir'):
      checkpoint.Checkpointer(str(tmp_path / 'run'))
  finally:
    tmp_path.chmod(0o700)


def test_orbax_info_logging_is_dropped_and_warnings_kept(tmp_path, caplog, monkeypatch):
  def orbax_info():
    return [r for r in caplog.records if '/orbax/' in r.pathname and r.levelno < logging.WARNING]

  ckpt = checkpoint.Checkpointer(str(tmp_path))
  absl_logger = logging.getLogger('absl')
  with caplog.at_level(logging.INFO, logger='absl'):
    with monkeypatch.context() as patch:
      patch.setattr(absl_logger, 'filters', [])  # without the filter orbax is chatty
      _save(ckpt, 1)
    assert len(orbax_info()) > 5
    caplog.clear()
    _save(ckpt, 2)
    ckpt.restore(_abstract(_random_state(2)))
    absl_logger.info('a caller message')
  assert orbax_info() == []
  assert 'a caller message' in caplog.text  # the caller's own INFO lines still pass
  ckpt.close()
  keep = checkpoint._DropOrbaxInfo().filter
  record = lambda level, path: logging.LogRecord('absl', level, path, 1, 'm', None, None)
  assert not keep(record(logging.INFO, '/x/site-packages/orbax/checkpoint/a.py'))
  assert keep(record(logging.WARNING, '/x/site-packages/orbax/checkpoint/a.py'))
  assert keep(record(logging.INFO, '/x/transformer/train.py'))


# Faults: damaged checkpoints, interrupted saves, a full disk ----------------------------------
def _big_state(seed: int) -> dict:
  """A state whose largest file on disk is the array data of 'big' (16 KiB of float32)."""
  rng = np.random.default_rng(seed)
  return {
    'big': jnp.asarray(rng.standard_normal(4096), jnp.float32),
    'small': {'b': jnp.asarray(rng.standard_normal(3), jnp.bfloat16), 'n': jnp.int32(seed)},
  }


def _three_checkpoints(tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=5)
  states = {step: _big_state(step) for step in (1, 2, 3)}
  for step, state in states.items():
    assert ckpt.save(step, state, {'position': step})
  ckpt.close()
  return states


def _largest_file(directory) -> str:
  paths = [os.path.join(root, name) for root, _, names in os.walk(directory) for name in names]
  return max(paths, key=os.path.getsize)


def _rewrite(path, change):
  with open(path, 'rb') as f:
    data = f.read()
  with open(path, 'wb') as f:
    f.write(change(data))


def _flip_middle(data: bytes) -> bytes:
  middle = len(data) // 2
  return data[:middle] + bytes([data[middle] ^ 0x10]) + data[middle + 1 :]


_DAMAGE = {  # what can happen to the files of one checkpoint
  'array bytes flipped': lambda d: _rewrite(_largest_file(d / 'state'), _flip_middle),
  'array file truncated': lambda d: _rewrite(
    _largest_file(d / 'state'), lambda b: b[: len(b) // 2]
  ),
  'array file zeroed': lambda d: _rewrite(_largest_file(d / 'state'), lambda b: bytes(len(b))),
  'array file deleted': lambda d: os.remove(_largest_file(d / 'state')),
  'array metadata unreadable': lambda d: (d / 'state' / '_METADATA').write_bytes(b'{"tree_m'),
  'data state changed': lambda d: (d / 'data' / 'metadata').write_text('{"position": 999}'),
  'integrity record deleted': lambda d: shutil.rmtree(d / 'integrity'),
  'integrity record edited': lambda d: _rewrite(
    d / 'integrity' / 'metadata', lambda b: b.replace(b'"float32"', b'"float16"', 1)
  ),
}


@pytest.mark.parametrize('damage', list(_DAMAGE))
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(damage, tmp_path, caplog):
  states = _three_checkpoints(tmp_path)
  directory = tmp_path / 'checkpoints'
  _DAMAGE[damage](directory / '3')
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=5)
  with pytest.raises(
    checkpoint.CorruptCheckpointError, match=re.escape(f'{directory}/3 is corrupt')
  ):
    ckpt.restore(_abstract(states[3]), step=3)  # an explicit step never falls back
  assert ckpt.all_steps() == [1, 2, 3]  # ... nor moves anything

  with caplog.at_level(logging.WARNING):
    restored, data_state, step = ckpt.restore(_abstract(states[3]))
  assert step == 2 and data_state == {'position': 2}
  _assert_trees_equal(restored, states[2])
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warnings) == 1, warnings
  assert (
    f'{directory}/3 is corrupt' in warnings[0]
    and f'restored checkpoint {directory}/2' in warnings[0]
  )
  # The damaged one is kept for inspection but no longer listed, so saving resumes normally.
  assert ckpt.all_steps() == [1, 2] and (directory / '3.corrupt').is_dir()
  assert ckpt.save(3, _big_state(33), {'position': 33})
  ckpt.close()
  restored, data_state, step = checkpoint.Checkpointer(str(tmp_path)).restore(_abstract(states[3]))
  assert step == 3 and data_state == {'position': 33}
  _assert_trees_equal(restored, _big_state(33))


def test_checksums_catch_what_orbax_reads_without_complaint(tmp_path, monkeypatch):
  states = _three_checkpoints(tmp_path)
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=5)
  manager = ckpt._manager
  real_restore = manager.restore

  def one_bit_off(step, args):  # as if a flipped bit on disk decoded without error
    restored = real_restore(step, args=args)
    if 'state' in restored:
      big = np.asarray(restored['state']['big']).copy()
      big.view(np.uint32)[1234] ^= 1 << 7
      restored['state']['big'] = jnp.asarray(big)
    return restored

  monkeypatch.setattr(manager, 'restore', one_bit_off)
  with pytest.raises(checkpoint.CorruptCheckpointError, match="array 'big' does not match"):
    ckpt.restore(_abstract(states[3]), step=3)
  ckpt.close()


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16', 'float16', 'int8', 'uint32', 'bool'])
def test_checksums_see_every_single_bit(dtype):
  x = np.random.default_rng(0).integers(0, 2, 4096 * 4, dtype=np.uint8)
  x = x.view(np.uint8 if dtype == 'bool' else jnp.dtype(dtype))
  x = x.astype(bool) if dtype == 'bool' else x
  base = checkpoint._checksums({'x': x})['x']
  raw = x.view(np.uint8).copy()
  for index in [0, 1, 777, raw.size - 1]:
    for bit in [0, 3, 7] if dtype != 'bool' else [0]:
      flipped = raw.copy()
      flipped[index] ^= 1 << bit
      assert checkpoint._checksums({'x': flipped.view(x.dtype)})['x'] != base, (index, bit)
  moved = np.roll(x, 1)  # same values, other places
  assert checkpoint._checksums({'x': moved})['x'] != base


def test_every_checkpoint_damaged_is_one_error_listing_them(tmp_path):
  states = _three_checkpoints(tmp_path)
  for step in (1, 2, 3):
    _DAMAGE['array file deleted'](tmp_path / 'checkpoints' / str(step))
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  with pytest.raises(checkpoint.CorruptCheckpointError) as error:
    ckpt.restore(_abstract(states[3]))
  message = str(error.value)
  assert 'no checkpoint in' in message and all(f'step {s}: ' in message for s in (1, 2, 3))
  assert ckpt.all_steps() == [1, 2, 3]  # nothing is moved when nothing could be restored
  ckpt.close()


def test_a_config_mismatch_is_not_taken_for_damage(tmp_path):
  states = _three_checkpoints(tmp_path)
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  wrong = {**states[3], 'big': jnp.zeros(5)}
  with pytest.raises(ValueError, match=r"'big' of shape \(4096,\).*\(5,\)"):
    ckpt.restore(_abstract(wrong))
  assert ckpt.all_steps() == [1, 2, 3]
  ckpt.close()


def test_restore_into_another_dtype_is_checked_then_cast(tmp_path):
  states = _three_checkpoints(tmp_path)
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), states[3])
  target['big'] = jax.ShapeDtypeStruct((4096,), jnp.bfloat16)
  restored, _, step = checkpoint.Checkpointer(str(tmp_path)).restore(target)
  assert step == 3 and restored['big'].dtype == jnp.bfloat16
  np.testing.assert_array_equal(restored['big'], states[3]['big'].astype(jnp.bfloat16))


_INTERRUPTED_SAVE = """
import os, sys
import jax.numpy as jnp
from orbax.checkpoint._src.path import atomicity
from transformer.training import checkpoint

ckpt = checkpoint.Checkpointer(sys.argv[1])
ckpt.save(1, {'x': jnp.arange(8.0)}, {'position': 1})
finalize = atomicity.AtomicRenameTemporaryPath.finalize

async def die_before_the_rename(self):  # every file of step 2 is written; the process dies
  if self.get().name.startswith('2.orbax-checkpoint-tmp'):
    os._exit(17)
  return await finalize(self)

atomicity.AtomicRenameTemporaryPath.finalize = die_before_the_rename
ckpt.save(2, {'x': jnp.arange(8.0) + 1}, {'position': 2})
"""


def test_a_save_killed_before_its_rename_is_never_listed(tmp_path):
  root = os.path.dirname(os.path.dirname(os.path.abspath(checkpoint.__file__)))
  result = subprocess.run(
    [sys.executable, '-c', textwrap.dedent(_INTERRUPTED_SAVE), str(tmp_path)],
    cwd=root,
    env=dict(os.environ, JAX_PLATFORMS='cpu'),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode == 17, result.stderr[-3000:]
  directory = tmp_path / 'checkpoints'
  (partial,) = [n for n in os.listdir(directory) if n.startswith('2.')]
  assert os.path.isdir(directory / partial / 'state') and os.path.isdir(
    directory / partial / 'data'
  )
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  assert ckpt.all_steps() == [1] and os.listdir(directory) == ['1']  # the partial save is removed
  restored, data_state, step = ckpt.restore({'x': jax.ShapeDtypeStruct((8,), jnp.float32)})
  assert step == 1 and data_state == {'position': 1}
  np.testing.assert_array_equal(restored['x'], np.arange(8.0))
  ckpt.close()


_FULL_DISK = """
import os, shutil, sys
import jax, jax.numpy as jnp, numpy as np
from transformer.training import checkpoint

workdir, ballast_bytes = sys.argv[1], int(sys.argv[2])
state = {'x': jnp.asarray(np.random.default_rng(0).integers(0, 256, 256 * 1024, dtype=np.uint8))}
abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
for async_save in (False, True):
  if os.path.exists(workdir):
    shutil.rmtree(workdir)
  ckpt = checkpoint.Checkpointer(workdir, async_save=async_save)
  ckpt.save(1, state, {'position': 1})
  ckpt.wait()
  ballast = os.path.join(os.path.dirname(workdir), 'ballast')
  if ballast_bytes:
    with open(ballast, 'wb') as f:  # leaves less room than one more checkpoint needs
      f.write(b'x' * max(0, shutil.disk_usage(workdir).free - ballast_bytes))
  else:
    import resource, signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
  try:
    ckpt.save(2, state, {'position': 2})
    ckpt.wait()
    raise SystemExit('the save into a full file system did not fail')
  except checkpoint.CheckpointError as error:
    message = str(error)
  print(message)
  directory = os.path.join(workdir, 'checkpoints')
  assert f'could not save checkpoint 2 in {directory}: ' in message, message
  assert ' free of ' in message and 'checkpoint 1 is intact' in message, message
  assert os.listdir(directory) == ['1'], os.listdir(directory)  # no partial directory
  assert ckpt.all_steps() == [1]
  _, data_state, step = checkpoint.Checkpointer(workdir).restore(abstract)
  assert (step, data_state) == (1, {'position': 1})
  if ballast_bytes:
    os.remove(ballast)  # space again: the same Checkpointer saves
  else:
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
  assert ckpt.save(2, state, {'position': 2})
  ckpt.close()
  assert checkpoint.Checkpointer(workdir).restore(abstract)[2] == 2
print('full disk ok')
"""


def _size_capped_runs(script: str, workdir: str) -> list[list[str]]:
  """Ways to run `script` against a size-capped file system here, best first.

  A 1 MiB tmpfs mounted in a private mount namespace (unshare: unprivileged through a user
  namespace, or as root), gone when the process ends; else RLIMIT_FSIZE, which fails writes past a
  file size with EFBIG: a per-file limit, not a full disk, so only a fallback.
  """
  mount = os.path.join(os.path.dirname(workdir), 'fs')
  python = [sys.executable, '-c', script, os.path.join(mount, 'run')]
  inner = f'mkdir -p {mount} && mount -t tmpfs -o size=1m sparrow-test {mount} && exec "$@"'
  runs = []
  if shutil.which('unshare'):
    for flags in (['--user', '--map-root-user', '--mount'], ['--mount']):
      probe = ['unshare', *flags, 'sh', '-c', inner, 'sh', 'true']
      if subprocess.run(probe, capture_output=True, timeout=60).returncode == 0:
        runs.append(['unshare', *flags, 'sh', '-c', inner, 'sh', *python, str(200 * 1024)])
  runs.append([sys.executable, '-c', script, workdir, '0'])
  return runs


def test_a_full_disk_is_one_clear_error_and_keeps_the_previous_checkpoint(tmp_path):
  """Saves into a 1 MiB tmpfs (see _size_capped_runs), sync and async.

  Only where no mount namespace can be made does it fall back to RLIMIT_FSIZE (EFBIG).
  """
  command = _size_capped_runs(textwrap.dedent(_FULL_DISK), str(tmp_path / 'run'))[0]
  root = os.path.dirname(os.path.dirname(os.path.abspath(checkpoint.__file__)))
  result = subprocess.run(
    command,
    cwd=root,
    env=dict(os.environ, JAX_PLATFORMS='cpu'),
    capture_output=True,
    text=True,
    timeout=180,
  )
  assert result.returncode == 0 and 'full disk ok' in result.stdout, result.stderr[-3000:]
  assert result.stdout.count('No space left on device') == 2 or command[0] != 'unshare'
  assert 'Traceback' not in result.stderr  # orbax's own error log for it is dropped


# Run metadata ----------------------------------------------------------------------------------
def _config(**model_overrides) -> ml_collections.ConfigDict:
  config = base.get_config()
  config.model.d_model = 256
  config.model.window = (4, 0)  # a tuple: saved as a JSON list
  for key, value in model_overrides.items():
    config.model[key] = value
  return config


def test_write_and_read_run_metadata(tmp_path):
  workdir = tmp_path / 'run'
  config = _config()
  provenance.write_run_metadata(str(workdir), config)
  saved = checkpoint.read_run_config(str(workdir))
  assert saved['model']['d_model'] == 256 and saved['model']['window'] == [4, 0]
  assert saved['model']['num_kv_heads'] is None and saved['data']['task'] == config.data.task
  assert saved['optim']['eps'] == config.optim.eps and saved['name'] == config.name
  assert set(saved) == set(config.keys())
  revision = (workdir / 'git_revision.txt').read_text()
  assert re.fullmatch(r'([0-9a-f]{40}(-dirty)?|unknown)\n', revision), revision
  assert sorted(os.listdir(workdir)) == ['config.json', 'git_revision.txt']  # no temp files left
  assert checkpoint.read_run_config(str(tmp_path / 'nothing_here')) is None


def test_config_write_is_atomic(tmp_path, monkeypatch):
  provenance.write_run_metadata(str(tmp_path), _config())
  before = (tmp_path / 'config.json').read_text()

  def failing_replace(src, dst):
    raise OSError('disk full')

  monkeypatch.setattr(os, 'replace', failing_replace)
  with pytest.raises(OSError, match='disk full'):
    provenance.write_run_metadata(str(tmp_path), _config(d_model=1024))
  assert (tmp_path / 'config.json').read_text() == before
  assert sorted(os.listdir(tmp_path)) == ['config.json', 'git_revision.txt']


def test_every_revision_that_trained_a_workdir_is_recorded_with_its_steps(
  tiny_config, monkeypatch, tmp_path
):
  from transformer.training.loop import train_and_evaluate

  workdir, first, second = tmp_path / 'run', 'a' * 40, 'b' * 40
  monkeypatch.setattr(provenance, '_git_revision', lambda *_: first)
  train_and_evaluate(tiny_config('causal_lm', steps=4), str(workdir))
  with open(workdir / provenance.REVISIONS, 'a') as f:
    f.write('{"revision": "cut short by a ki')  # a kill during the append
  monkeypatch.setattr(provenance, '_git_revision', lambda *_: second + '-dirty')
  train_and_evaluate(tiny_config('causal_lm', steps=8), str(workdir))
  history = provenance.revision_history(str(workdir))
  ranges = [(e['revision'], e['dirty'], e['start_step'], e['end_step']) for e in history]
  assert ranges == [(first, False, 0, 4), (second, True, 4, 8)]
  assert (workdir / 'git_revision.txt').read_text() == second + '-dirty\n'  # the latest only
  command = [sys.executable, '-m', 'experiments.describe', f'--workdir={workdir}']
  done = subprocess.run(command, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr
  shown = done.stdout.splitlines()
  assert shown[-3] == f'{workdir}: trained by 2 revision(s)', done.stdout
  assert re.fullmatch(rf'  steps 0-4 +{first}, started 20\d\d-.*', shown[-2]), shown
  assert re.fullmatch(rf'  steps 4-8 +{second} with uncommitted changes, started .*', shown[-1])
  os.remove(workdir / provenance.REVISIONS)  # a workdir from before the record: still read
  assert provenance.describe_history(str(workdir)) == (
    f'{workdir}: last trained by revision {second} with uncommitted changes (git_revision.txt; '
    'the revisions of earlier starts were not recorded then)'
  )


def test_a_start_from_an_earlier_checkpoint_ends_the_ranges_before_it(tmp_path):
  lines = [{'revision': r, 'dirty': False, 'start_step': s, 'time': 't'} for r, s in
           [('a', 0), ('b', 6), ('c', 4)]]  # fmt: skip
  (tmp_path / provenance.REVISIONS).write_text(''.join(json.dumps(x) + '\n' for x in lines))
  os.makedirs(tmp_path / 'checkpoints' / '8')
  history = provenance.revision_history(str(tmp_path))
  # c resumed from step 4 (b's checkpoints were lost): none of b's steps are in checkpoint 8.
  assert [(e['start_step'], e['end_step']) for e in history] == [(0, 4), (6, 6), (4, 8)]
  assert provenance.revision_history(str(tmp_path / 'none')) == []
  # Resumed from a checkpoint made before the record, with a damaged line and a cut one.
  (tmp_path / provenance.REVISIONS).write_text(
    '[1]\n' + json.dumps(lines[1]) + '\n{"revision": "c", "dirty": false, "start_st'
  )
  history = provenance.revision_history(str(tmp_path))
  assert [(e['revision'], e['start_step'], e['end_step']) for e in history] == [
    (None, 0, 6),
    ('b', 6, 8),
  ]
  assert provenance.describe_history(str(tmp_path)).splitlines()[1:] == [
    '  steps 0-6        an unrecorded revision (trained before revisions.jsonl)',
    '  steps 6-8        b, started t',
  ]


def test_git_revision(tmp_path):
  assert provenance._git_revision(str(tmp_path)) == 'unknown'  # /tmp is not in a git tree

  def git(*args):
    command = ['git', '-c', 'user.name=t', '-c', 'user.email=t@t', *args]
    return subprocess.run(command, cwd=tmp_path, check=True, capture_output=True, text=True)

  git('init', '-q')
  (tmp_path / 'a.py').write_text('x = 1\n')
  git('add', 'a.py')
  git('commit', '-q', '-m', 'first')
  head = (tmp_path / '.git' / 'HEAD').read_text().split()[-1]  # e.g. refs/heads/main
  commit = (tmp_path / '.git' / head).read_text().strip()
  (tmp_path / 'sub').mkdir()
  assert provenance._git_revision(str(tmp_path / 'sub')) == commit
  (tmp_path / 'a.py').write_text('x = 2\n')
  assert provenance._git_revision(str(tmp_path / 'sub')) == commit + '-dirty'


def _workdir_with_checkpoint(tmp_path, config):
  provenance.write_run_metadata(str(tmp_path), config)
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  _save(ckpt, 1)
  ckpt.close()


def _snapshot(directory):
  return {
    os.path.join(root, name): os.stat(os.path.join(root, name)).st_mtime_ns
    for root, _, names in os.walk(directory)
    for name in names
  }


def test_check_resume_compatible_names_the_first_difference(tmp_path):
  _workdir_with_checkpoint(tmp_path, _config())
  before = _snapshot(tmp_path)
  message = (
    f'config does not match the checkpoint in {tmp_path}: model.d_model is 256 there and 512 '
    'here; use another --workdir or the original config'
  )
  with pytest.raises(ValueError, match=re.escape(message)):
    checkpoint.check_resume_compatible(str(tmp_path), _config(d_model=512))
  assert _snapshot(tmp_path) == before  # nothing in the workdir was touched
  with pytest.raises(ValueError, match=r'model\.scan_layers is false there and true here'):
    checkpoint.check_resume_compatible(str(tmp_path), _config(scan_layers=True))
  with pytest.raises(ValueError, match=r'model\.window is \[4, 0\] there and \[8, 0\] here'):
    checkpoint.check_resume_compatible(str(tmp_path), _config(window=(8, 0)))
  config = _config()
  config.data.tokenizer = 'sentencepiece'
  with pytest.raises(ValueError, match=r'data\.tokenizer is "byte" there and "sentencepiece" here'):
    checkpoint.check_resume_compatible(str(tmp_path), config)
  config = _config()
  config.model.new_knob = 3  # a key the saved run did not have
  with pytest.raises(ValueError, match=r'model\.new_knob is absent there and 3 here'):
    checkpoint.check_resume_compatible(str(tmp_path), config)
  assert _snapshot(tmp_path) == before


def test_check_resume_compatible_allows_compute_only_changes(tmp_path):
  _workdir_with_checkpoint(tmp_path, _config())
  config = _config(attention_impl='chunked', remat='full', dtype='bfloat16')
  config.data.batch_size = 8  # neither the params nor the tokenizer depend on these
  config.train.steps = 10_000
  config.optim.learning_rate = 0.5
  checkpoint.check_resume_compatible(str(tmp_path), config)
  checkpoint.check_resume_compatible(str(tmp_path), _config())


def test_a_knob_added_since_the_checkpoint_resumes_at_its_default_only(tmp_path):
  _workdir_with_checkpoint(tmp_path, _config())
  path = tmp_path / 'config.json'
  saved = json.loads(path.read_text())
  del saved['model']['short_conv'], saved['model']['qk_norm']  # written before these knobs
  path.write_text(json.dumps(saved))
  checkpoint.check_resume_compatible(str(tmp_path), _config())  # both at their defaults
  with pytest.raises(ValueError, match=r'model\.short_conv is absent there and 4 here'):
    checkpoint.check_resume_compatible(str(tmp_path), _config(short_conv=4))
  with pytest.raises(ValueError, match=r'model\.qk_norm is absent there and true here'):
    checkpoint.check_resume_compatible(str(tmp_path), _config(qk_norm=True))
  saved['model']['retired_knob'] = 1  # a knob this version no longer has: not a default
  path.write_text(json.dumps(saved))
  with pytest.raises(ValueError, match=r'model\.retired_knob is 1 there and absent here'):
    checkpoint.check_resume_compatible(str(tmp_path), _config())


def test_check_resume_compatible_passes_without_checkpoints(tmp_path):
  checkpoint.check_resume_compatible(str(tmp_path / 'new'), _config())  # a fresh workdir
  provenance.write_run_metadata(str(tmp_path), _config())  # a run that never saved a step
  checkpoint.check_resume_compatible(str(tmp_path), _config(d_model=512))


def test_host_checksums_equal_the_device_checksums():
  """The NumPy fast path (single process) computes exactly the jitted device checksums."""
  rng = np.random.default_rng(0)
  leaves = [
    rng.normal(size=(33, 7)).astype(np.float32),
    rng.integers(-5, 5, size=(5,)).astype(np.int32),
    jnp.asarray(rng.normal(size=(9,)), jnp.bfloat16),
    np.asarray(True),
    rng.integers(0, 255, size=(17,)).astype(np.uint8),
    jnp.float16(3.5),
    np.zeros((0, 3), np.float32),
    np.asarray(-3, np.int8),
    rng.integers(0, 2**32 - 1, size=(100_000,), dtype=np.uint32),  # sums wrap around 2^32
  ]
  host = checkpoint._host_checksums(leaves)
  device = np.asarray(checkpoint._leaf_checksums([jnp.asarray(x) for x in leaves]))
  assert host is not None and host.dtype == np.uint32
  np.testing.assert_array_equal(host, device)


def test_late_event_loop_echoes_are_dropped_only_after_a_failed_read_or_full_disk(
  tmp_path, monkeypatch
):
  """orbax's writes that finish after its event loop closed print 'Event loop is closed' through
  sys.unraisablehook; after the one clear error of a full disk that echo is dropped, and before
  any failure (or for any other error) it is shown."""
  shown = []
  hook = checkpoint._DropOrbaxLeftovers(shown.append)
  late = type('U', (), dict(exc_value=RuntimeError('Event loop is closed'), object=None))()
  other = type('U', (), dict(exc_value=RuntimeError('another error'), object=None))()
  monkeypatch.setattr(checkpoint._DropOrbaxLeftovers, 'failures', 0)
  hook(late)
  assert shown == [late]
  ckpt = checkpoint.Checkpointer(str(tmp_path / 'run'))
  with pytest.raises(checkpoint.CheckpointError, match='No space left on device'):
    try:
      raise OSError(28, 'No space left on device')
    except OSError as error:
      ckpt._raise_save_error(2, error)
  ckpt.close()
  assert checkpoint._DropOrbaxLeftovers.failures == 1
  hook(late)
  hook(other)
  assert shown == [late, other]
