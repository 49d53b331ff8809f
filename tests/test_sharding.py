"""Mesh, logical rules and sharded training: equal to one device, on 8 fake devices and 2 processes.

The multi-device checks run in subprocesses (tests/sharding_worker.py, tests/multihost_worker.py)
so that the 8-device XLA flag never leaks into this process, which stays on 1 device.
"""

import json
import os
import signal
import socket
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest

from transformer import sharding
from transformer.training.workdir import load_run

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _run(args, timeout):
  proc = subprocess.Popen(
    [sys.executable, *args],
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    start_new_session=True,  # its own process group: a timeout kills it and its children
  )
  return proc, timeout


def _wait(procs_and_timeouts):
  outputs = []
  try:
    for proc, timeout in procs_and_timeouts:
      out, _ = proc.communicate(timeout=timeout)
      outputs.append(out)
      assert proc.returncode == 0, out[-3000:]
  finally:
    for proc, _ in procs_and_timeouts:
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
  return outputs


def _worker(out, mode):
  _wait([_run([os.path.join(HERE, 'sharding_worker.py'), str(out), mode], timeout=900)])
  with open(out / 'results.json') as f:
    return json.load(f), out


@pytest.fixture(scope='module')
def worker(tmp_path_factory):
  """The 'default' worker's results, from its two halves run at once (each compiles on one
  core): the rules, init, checkpoints and the dropout-off case; the dropout-on meshes."""
  outs = [tmp_path_factory.mktemp(f'sharding_{mode}') for mode in ('rules', 'dropout')]
  script = os.path.join(HERE, 'sharding_worker.py')
  _wait(
    [_run([script, str(out), mode], timeout=900) for out, mode in zip(outs, ('rules', 'dropout'))]
  )
  results = {}
  for out in outs:
    with open(out / 'results.json') as f:
      for key, value in json.load(f).items():
        if isinstance(value, list):
          results.setdefault(key, []).extend(value)
        elif isinstance(value, dict):
          results.setdefault(key, {}).update(value)
        else:
          results[key] = value
  return results, outs[0]


def _check_equal_to_one_device(cases):
  for case in cases:
    where = f'{case["family"]} dropout={case["dropout"]} mesh={case["mesh"]}'
    assert case['loss_error'] <= 1e-5, (where, case['losses'], case['ref_losses'])
    assert case['param_error'] <= 1e-5, where  # relative to the largest parameter
    assert case['update_error'] <= 1e-4, where  # relative to the largest change: much stricter
  # The steps did something: the loss changed over the 3 steps.
  assert all(abs(c['losses'][0] - c['losses'][-1]) > 1e-4 for c in cases)


def test_meshes_match_one_device_with_and_without_dropout(worker):
  """Dropout on (same RNG stream) under tensor parallelism and FSDP, and every family with dropout
  off on (2, 2, 2); the slow test below runs every family on every mesh both ways."""
  cases = worker[0]['equality']
  families = {'causal_lm', 'encoder_decoder', 'bidirectional_lm'}
  on = {(c['family'], tuple(c['mesh'])) for c in cases if c['dropout'] == 0.1}
  assert on == {('causal_lm', (1, 2, 4)), ('encoder_decoder', (1, 8, 1))}
  off = {(c['family'], tuple(c['mesh'])) for c in cases if c['dropout'] == 0.0}
  assert off == {(f, (2, 2, 2)) for f in families}
  _check_equal_to_one_device(cases)


@pytest.mark.slow
def test_every_family_on_every_mesh_matches_one_device(tmp_path):
  """The whole matrix: 3 families x 4 meshes, with dropout and without."""
  cases = _worker(tmp_path, 'full')[0]['equality']
  combos = {(c['family'], c['dropout'], tuple(c['mesh'])) for c in cases}
  assert len(cases) == len(combos) == 3 * 4 * 2
  _check_equal_to_one_device(cases)


def test_sharded_init_equals_single_device_init(worker):
  assert worker[0]['init'] and all(error == 0.0 for error in worker[0]['init'].values())


def test_parameter_and_optimizer_shardings_follow_the_rules(worker):
  specs = worker[0]['specs']
  tp = specs['(1, 2, 4)']  # fsdp=2, tensor=4: the default rules
  assert tp['embedding'] == ['tensor', 'fsdp']  # [vocab, embed]
  assert tp['query'] == ['fsdp', 'tensor', None]  # [embed, heads, head_dim]
  assert tp['query_bias'] == ['tensor', None]
  assert tp['out'] == ['tensor', None, 'fsdp']  # [heads, head_dim, embed]
  assert tp['wi'] == ['fsdp', 'tensor']  # [embed, mlp]
  assert tp['wo'] == ['tensor', 'fsdp']  # [mlp, embed]
  assert tp['norm'] == ['fsdp']
  assert tp['positions'] == [None, 'fsdp']
  assert tp['adam_mu_query'] == tp['query']  # optimizer state follows the parameter
  assert tp['step'] == []  # scalars are replicated
  assert specs['(8, 1, 1)']['query'] == ['fsdp', 'tensor', None]  # size-1 axes: replicated


def test_fsdp_cuts_per_device_bytes_by_the_fsdp_size(worker):
  sizes = worker[0]['bytes']
  fsdp, data_parallel = sizes['(1, 8, 1)'], sizes['(8, 1, 1)']
  assert data_parallel['per_device'] == data_parallel['total']  # replicated
  # Every tensor with an embed axis is split 8 ways; only the few biases without one are whole.
  assert fsdp['per_device'] * 8 <= fsdp['total'] * 1.1
  assert fsdp['opt_per_device'] * 8 <= fsdp['opt_total'] * 1.1


def test_checkpoint_from_a_2x2x2_mesh_restores_on_8x1x1_and_on_one_device(worker):
  results, out = worker
  saved = np.asarray(results['logits']['saved'])
  assert results['restored_equal']  # every array bit for bit, now split ('tensor', 'fsdp') -> 8
  assert results['restored_sharding'] == "P('tensor', 'fsdp')"
  np.testing.assert_array_equal(np.asarray(results['logits']['restored_8_1_1']), saved)
  # This process has one device: load the workdir the 8-device worker wrote.
  assert jax.device_count() == 1
  run, state, step = load_run(str(out / 'run'))
  assert step == 3
  saved_params = np.load(out / 'params.npz')
  flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
  assert sorted(jax.tree_util.keystr(k) for k, _ in flat) == sorted(saved_params.files)
  for key, value in flat:
    np.testing.assert_array_equal(np.asarray(value), saved_params[jax.tree_util.keystr(key)])
  # Same parameters; the logits differ only by this process's XLA flags (optimisation level).
  logits = run.model.apply({'params': state.params}, np.load(out / 'tokens.npy'))
  np.testing.assert_allclose(np.asarray(logits), saved, rtol=1e-5, atol=1e-5)


def test_bad_meshes_are_clear_errors(worker):
  errors = worker[0]['errors']
  assert 'needs 4 devices, but there are 8' in errors['mesh_count']
  assert 'has size 4' in errors['not_divisible'] and 'total size 8' in errors['not_divisible']
  assert "unknown logical axis 'hidden'" in errors['unknown_axis']
  assert 'data.batch_size=12' in errors['batch']


@pytest.mark.parametrize(
  'shape,message',
  [
    ((2, 1, 1), 'needs 2 devices, but there are 1'),
    ((1, 1), 'must be three ints'),
    ((-1, -1, 1), 'must be three ints'),
    ((0, 1, 1), 'sizes >= 1'),
  ],
)
def test_mesh_shape_errors_name_the_values(shape, message):
  with pytest.raises(ValueError, match=message.replace('(', r'\(')):
    sharding.make_mesh(shape)


@pytest.mark.parametrize(
  'rules,message',
  [
    ({'hidden': 'tensor'}, "unknown logical axis 'hidden'"),
    ({'batch': 'model'}, "mesh axis 'model'"),
    ({'batch': 'data,data'}, 'uses a mesh axis twice'),
  ],
)
def test_rule_errors_name_the_values(rules, message):
  table = {**sharding.default_rules(), **rules}
  with pytest.raises(ValueError, match=message):
    sharding.parse_rules(table)


def test_missing_rule_is_an_error():
  table = sharding.default_rules()
  del table['mlp']
  with pytest.raises(ValueError, match="no rule for \\['mlp'\\]"):
    sharding.parse_rules(table)


def test_default_mesh_fills_all_devices():
  mesh_cfg = ml_collections.ConfigDict({'shape': (-1, 1, 1), 'rules': sharding.default_rules()})
  partitioner = sharding.Partitioner.from_config(mesh_cfg)
  assert dict(partitioner.mesh.shape) == {'data': jax.device_count(), 'fsdp': 1, 'tensor': 1}


def test_distributed_flags_must_come_together():
  with pytest.raises(ValueError, match='--process_id'):
    sharding.initialize_distributed('127.0.0.1:1234', None, None)
  with pytest.raises(ValueError, match=r'--process_id=2 must be in \[0, 2\)'):
    sharding.initialize_distributed('127.0.0.1:1234', 2, 2)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@pytest.mark.slow  # about 50 s: three processes at once on two cores, then two
def test_two_processes_match_one_and_resume(tmp_path):
  """2 OS processes x 4 CPU devices (jax.distributed + gloo) == 1 process x 8 devices."""
  script = os.path.join(HERE, 'multihost_worker.py')
  workdir = tmp_path / 'run'

  def launch(steps, out):
    port = _free_port()
    return [
      _run(['-u', script, 'host', str(i), str(port), str(workdir), str(steps), str(out)], 120)
      for i in range(2)
    ]

  reference = tmp_path / 'reference.json'
  reference_proc = _run([script, 'reference', '4', str(reference)], 120)
  _wait(launch(2, tmp_path / 'first.json') + [reference_proc])
  assert sorted(os.listdir(workdir / 'checkpoints')) == ['2']
  _wait(launch(4, tmp_path / 'second.json'))  # resumes from step 2
  losses = {**json.loads((tmp_path / 'first.json').read_text())}
  second = json.loads((tmp_path / 'second.json').read_text())
  assert sorted(second) == ['3', '4']  # only the steps after the resume point
  losses.update(second)
  expected = json.loads(reference.read_text())
  assert sorted(losses) == sorted(expected) == ['1', '2', '3', '4']
  for step in expected:
    np.testing.assert_allclose(losses[step], expected[step], rtol=1e-5)


def test_transformer_load_of_a_2x2x2_run_in_a_fresh_one_device_process(worker):
  results, out = worker
  code = (
    'import json, jax, numpy as np, transformer\n'
    f'm = transformer.load({str(out / "run")!r})\n'
    f'logits = m.logits(np.load({str(out / "tokens.npy")!r}))\n'
    'print(json.dumps([jax.device_count(), m.step, logits.tolist()]))\n'
  )
  proc = subprocess.run(
    [sys.executable, '-c', code],
    capture_output=True,
    text=True,
    timeout=120,
    cwd=ROOT,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu', 'XLA_FLAGS': ''},
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  devices, step, logits = json.loads(proc.stdout.strip().splitlines()[-1])
  assert (devices, step) == (1, 3)
  saved = np.asarray(results['logits']['saved'])
  np.testing.assert_allclose(np.asarray(logits), saved, rtol=1e-5, atol=1e-5)


_EVERY_CORE = """
import json, os, sys
cores = int(sys.argv[1])
os.sched_getaffinity = lambda pid: set(range(cores))  # a machine with this many cores
from transformer import sharding
import jax
made = sharding.use_every_core()
picks = {
  str(rows): [None if d is None else len(d) for d in (
    sharding.default_devices((-1, 1, 1), rows), sharding.default_devices((1, 2, 1), rows))]
  for rows in ([12, 64], [7, 64], [])
}
print(json.dumps([made, jax.device_count(), picks]))
"""


@pytest.mark.parametrize('cores,xla_flags', [(8, ''), (1, ''), (8, 'count')])
def test_use_every_core_splits_the_default_mesh_over_the_cores_the_batches_divide(cores, xla_flags):
  """8 cores: 8 CPU devices; a batch of 12 rows (eval 64) runs on 4 of them, 7 rows on 1, and a
  mesh the config names keeps all 8 (None). One core, or a device count the user chose through
  XLA_FLAGS, changes nothing."""
  flags = '--xla_force_host_platform_device_count=2' if xla_flags else ''
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'XLA_FLAGS': flags}
  proc = subprocess.run(
    [sys.executable, '-c', _EVERY_CORE, str(cores)],
    capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-3000:]
  made, devices, picks = json.loads(proc.stdout.strip().splitlines()[-1])
  if xla_flags:
    assert (made, devices) == (1, 2)
    assert picks == {'[12, 64]': [None, None], '[7, 64]': [None, None], '[]': [None, None]}
  elif cores == 1:
    assert (made, devices) == (1, 1)
    assert picks['[12, 64]'] == [None, None]
  else:
    assert (made, devices) == (8, 8)
    assert picks == {'[12, 64]': [4, None], '[7, 64]': [1, None], '[]': [8, None]}
