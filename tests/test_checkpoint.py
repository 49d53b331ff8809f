"""Tests for transformer.checkpoint: orbax save/restore, retention, atomicity and run metadata."""

import logging
import os
import re
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
from transformer import checkpoint


@flax.struct.dataclass
class TrainState:  # the shape of transformer.train.TrainState: a dataclass pytree, not a dict
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
from transformer import checkpoint

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
  checkpoint.write_run_metadata(str(workdir), config)
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
  checkpoint.write_run_metadata(str(tmp_path), _config())
  before = (tmp_path / 'config.json').read_text()

  def failing_replace(src, dst):
    raise OSError('disk full')

  monkeypatch.setattr(os, 'replace', failing_replace)
  with pytest.raises(OSError, match='disk full'):
    checkpoint.write_run_metadata(str(tmp_path), _config(d_model=1024))
  assert (tmp_path / 'config.json').read_text() == before
  assert sorted(os.listdir(tmp_path)) == ['config.json', 'git_revision.txt']


def test_git_revision(tmp_path):
  assert checkpoint._git_revision(str(tmp_path)) == 'unknown'  # /tmp is not in a git tree

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
  assert checkpoint._git_revision(str(tmp_path / 'sub')) == commit
  (tmp_path / 'a.py').write_text('x = 2\n')
  assert checkpoint._git_revision(str(tmp_path / 'sub')) == commit + '-dirty'


def _workdir_with_checkpoint(tmp_path, config):
  checkpoint.write_run_metadata(str(tmp_path), config)
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


def test_check_resume_compatible_passes_without_checkpoints(tmp_path):
  checkpoint.check_resume_compatible(str(tmp_path / 'new'), _config())  # a fresh workdir
  checkpoint.write_run_metadata(str(tmp_path), _config())  # a run that never saved a step
  checkpoint.check_resume_compatible(str(tmp_path), _config(d_model=512))
