"""Only proven damage moves a checkpoint aside: restore faults injected one at a time.

A permission, an I/O error, a newer writer, another topology or an unknown error leaves every
checkpoint where it is and is one error; a checksum, a truncated or absent file is damage.
"""

import ctypes
import errno
import json
import logging
import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import gpt_tiny
from transformer.training import checkpoint, unreadable
from transformer.training.loop import train_and_evaluate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _state(step: int) -> dict:
  rng = np.random.default_rng(step)
  return {'w': jnp.asarray(rng.standard_normal((37, 5)), jnp.float32), 'step': jnp.int32(step)}


def _abstract(state):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


def _two_checkpoints(tmp_path) -> checkpoint.Checkpointer:
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=5)
  for step in (1, 2):
    assert ckpt.save(step, _state(step), {'position': step})
  ckpt.wait()
  return ckpt


def _failing_restore(monkeypatch, ckpt, error, times=None):
  """orbax's restore of the state raises `error` (`times` times, or always); the integrity
  record still reads. Returns the list of the steps it failed for."""
  real, failed = ckpt._manager.restore, []

  def restore(step, args):
    if 'state' in args.keys() and (times is None or len(failed) < times):
      failed.append(step)
      raise error
    return real(step, args=args)

  monkeypatch.setattr(ckpt._manager, 'restore', restore)
  return failed


def _listing(tmp_path):
  return sorted(os.listdir(tmp_path / 'checkpoints'))


@pytest.fixture(autouse=True)
def no_waits(monkeypatch):
  monkeypatch.setattr(unreadable, 'RETRY_SECONDS', (0.0, 0.0, 0.0))


def test_an_io_error_once_is_retried_with_a_line_and_restores_that_checkpoint(
  tmp_path, monkeypatch, caplog
):
  ckpt = _two_checkpoints(tmp_path)
  failed = _failing_restore(monkeypatch, ckpt, OSError(errno.EIO, 'Input/output error'), times=1)
  with caplog.at_level(logging.WARNING):
    state, data_state, step = ckpt.restore(_abstract(_state(2)))
  assert (step, data_state, failed) == (2, {'position': 2}, [2])
  np.testing.assert_array_equal(state['w'], _state(2)['w'])
  retries = [r.getMessage() for r in caplog.records if 'retry' in r.getMessage()]
  assert len(retries) == 1 and 'Input/output error' in retries[0] and 'retry 1 of 3' in retries[0]
  assert _listing(tmp_path) == ['1', '2']
  ckpt.close()


def test_an_io_error_that_lasts_is_one_error_and_moves_nothing(tmp_path, monkeypatch, caplog):
  ckpt = _two_checkpoints(tmp_path)
  # as tensorstore says it, errno in the text
  error = ValueError("UNKNOWN: Error reading 'w/0': [os_error_code='5'] Input/output error")
  failed = _failing_restore(monkeypatch, ckpt, error)
  with caplog.at_level(logging.WARNING):
    with pytest.raises(checkpoint.UnreadableCheckpointError) as raised:
      ckpt.restore(_abstract(_state(2)))
  message = str(raised.value)
  assert '\n' not in message and f'{tmp_path}/checkpoints/2 cannot be read here' in message
  assert 'Input/output error after 3 retries' in message and 'left in place' in message
  assert failed == [2, 2, 2, 2]  # the newest only: an older one is not tried, nor anything moved
  assert len([r for r in caplog.records if 'retry' in r.getMessage()]) == 3
  assert _listing(tmp_path) == ['1', '2']
  ckpt.close()


@pytest.mark.parametrize(
  'error, words',
  [
    (ValueError('sharding of array w names devices [0, 1, 2, 3]: mesh has 8 devices'), 'topology'),
    (RuntimeError('something nobody has seen'), 'does not show the files damaged'),
    (ValueError('PERMISSION_DENIED: Failed to open "d/ab12"'), 'Permission denied'),
  ],
)
def test_a_fault_of_the_reader_is_not_damage(tmp_path, monkeypatch, error, words):
  ckpt = _two_checkpoints(tmp_path)
  _failing_restore(monkeypatch, ckpt, error)
  for step in (None, 2):
    with pytest.raises(checkpoint.UnreadableCheckpointError, match=words) as raised:
      ckpt.restore(_abstract(_state(2)), step=step)
    assert '\n' not in str(raised.value)
  assert _listing(tmp_path) == ['1', '2'] and ckpt.all_steps() == [1, 2]
  ckpt.close()


def test_a_newer_writer_is_named_even_when_its_layout_looks_like_missing_files(
  tmp_path, monkeypatch
):
  ckpt = _two_checkpoints(tmp_path)
  path = tmp_path / 'checkpoints' / '2' / 'integrity' / 'metadata'
  record = json.loads(path.read_text())
  assert record['written_by'] == {'orbax-checkpoint': ocp.__version__, 'jax': jax.__version__}
  record['written_by']['orbax-checkpoint'] = '99.0.0'
  record['sha256'] = checkpoint._json_sha256({k: v for k, v in record.items() if k != 'sha256'})
  path.write_text(json.dumps(record))
  _failing_restore(monkeypatch, ckpt, ValueError('NOT_FOUND: "w/.zarray" does not exist'))
  with pytest.raises(checkpoint.UnreadableCheckpointError) as raised:
    ckpt.restore(_abstract(_state(2)))
  assert 'written by orbax-checkpoint 99.0.0, newer than this' in str(raised.value)
  assert 'pip install -U orbax-checkpoint jax' in str(raised.value)
  assert _listing(tmp_path) == ['1', '2']
  ckpt.close()


def test_missing_files_of_the_same_writer_are_damage(tmp_path, monkeypatch, caplog):
  ckpt = _two_checkpoints(tmp_path)
  _failing_restore(monkeypatch, ckpt, ValueError('NOT_FOUND: "w/.zarray" does not exist'), times=1)
  with caplog.at_level(logging.WARNING):
    _, _, step = ckpt.restore(_abstract(_state(2)))
  assert step == 1 and _listing(tmp_path) == ['1', '2.corrupt']
  ckpt.close()


# Runs argv[1:] as a process that file modes bind: root drops the capabilities that override them
# (the bounding set, before exec: the command starts without them); another user already is one.
_WITHOUT_FILE_OVERRIDES = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
  if os.geteuid() == 0 and libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
    raise OSError(ctypes.get_errno(), 'prctl(PR_CAPBSET_DROP)')
os.execv(sys.argv[1], sys.argv[1:])
"""


def test_a_run_whose_checkpoint_it_may_not_read_stops_with_one_line_and_keeps_it(tmp_path):
  """gpt_tiny trains 4 steps (a checkpoint every 2); checkpoint 4's array files lose every
  permission, bytes intact; `experiments.train` rerun by a process that the modes bind (root
  without CAP_DAC_OVERRIDE): status 2, one `error:` line, checkpoints 2 and 4 where they were."""
  overrides = {
    'model.d_model': 16,
    'model.num_heads': 2,
    'model.d_ff': 32,
    'model.num_layers': 1,
    'data.tokenizer': 'byte',
    'data.batch_size': 4,
    'data.eval_batch_size': 4,
    'data.num_train_examples': 32,
    'data.num_eval_examples': 4,
    'data.max_length': 16,
    'train.steps': 4,
    'train.eval_every': 100,
    'train.checkpoint_every': 2,
    'train.eval_decode_examples': 0,
    'optim.warmup_steps': 0,
  }
  config, workdir = gpt_tiny.get_config(), tmp_path / 'run'
  for key, value in overrides.items():
    section, name = key.split('.')
    config[section][name] = value
  train_and_evaluate(config, str(workdir))
  arrays = workdir / 'checkpoints' / '4' / 'state'
  files = [os.path.join(root, name) for root, _, names in os.walk(arrays) for name in names]
  data_files = [f for f in files if f'{os.sep}d{os.sep}' in f]
  assert data_files
  for path in data_files:
    os.chmod(path, 0)
  command = [sys.executable, '-c', _WITHOUT_FILE_OVERRIDES, sys.executable]
  command += ['-m', 'experiments.train', '--config=configs/gpt_tiny.py']
  rerun = {**overrides, 'train.steps': 6}
  command += [f'--workdir={workdir}'] + [f'--config.{k}={v}' for k, v in rerun.items()]
  proc = subprocess.run(
    command,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2, proc.stderr
  assert len(lines) == 1 and lines[0].startswith('error: checkpoint '), proc.stderr
  assert 'checkpoints/4 cannot be read here: Permission denied: ' in lines[0], lines[0]
  assert 'chmod' in lines[0] and 'Traceback' not in proc.stderr
  assert _listing(workdir) == ['2', '4']
  for path in data_files:
    os.chmod(path, 0o644)
  assert checkpoint.Checkpointer(str(workdir)).latest_step() == 4  # intact, once readable again


def test_a_run_resumes_through_an_io_error_that_passes(tmp_path, tiny_config, monkeypatch, capsys):
  """orbax's restore raises OSError(EIO) once when the run resumes: one retry line, and the run
  goes on from its checkpoint, not from scratch nor from an older one."""
  config = tiny_config('causal_lm', steps=4, checkpoint_every=2, eval_every=100)
  train_and_evaluate(config, str(tmp_path))
  real, calls = ocp.CheckpointManager.restore, []

  def restore(self, step, *args, **kwargs):
    calls.append(step)
    if len(calls) == 1:
      raise OSError(errno.EIO, 'Input/output error')
    return real(self, step, *args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, 'restore', restore)
  config.train.steps = 6
  history = train_and_evaluate(config, str(tmp_path))['train']
  assert [h['step'] for h in history] == [5, 6] and calls[0] == 4
  assert 'resumed from step 4' in capsys.readouterr().out
  assert _listing(tmp_path) == ['2', '4', '6']  # nothing moved aside
  assert checkpoint._DropOrbaxLeftovers.reading == 0  # echoes after the reads are printed again


def test_late_echoes_that_tensorstore_prints_from_its_thread_are_dropped_after_a_failure(
  monkeypatch, capsys
):
  """tensorstore reports a callback that found the loop closed with PyErr_Print from its own
  thread, which goes to sys.excepthook: during a read (a failing one echoes before it raises) or
  after a failure that echo is dropped; the same error outside both, another error, or one
  raised on the main thread is still printed."""
  monkeypatch.setattr(sys, 'excepthook', sys.__excepthook__)
  checkpoint._quiet_orbax()
  assert isinstance(sys.excepthook, checkpoint._DropLateEcho)

  def print_from_a_thread(message: str) -> None:
    def run():  # PyRun_SimpleString reports the error with PyErr_Print, as tensorstore does
      ctypes.pythonapi.PyRun_SimpleString(f'raise RuntimeError({message!r})'.encode())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()

  monkeypatch.setattr(checkpoint._DropOrbaxLeftovers, 'failures', 0)
  monkeypatch.setattr(checkpoint._DropOrbaxLeftovers, 'reading', 0)
  print_from_a_thread('Event loop is closed')
  assert 'RuntimeError: Event loop is closed' in capsys.readouterr().err
  monkeypatch.setattr(checkpoint._DropOrbaxLeftovers, 'reading', 1)
  print_from_a_thread('Event loop is closed')
  assert capsys.readouterr().err == ''
  monkeypatch.setattr(checkpoint._DropOrbaxLeftovers, 'reading', 0)
  monkeypatch.setattr(checkpoint._DropOrbaxLeftovers, 'failures', 1)
  print_from_a_thread('Event loop is closed')
  assert capsys.readouterr().err == ''
  print_from_a_thread('another error')
  assert 'RuntimeError: another error' in capsys.readouterr().err
  sys.excepthook(RuntimeError, RuntimeError('Event loop is closed'), None)
  assert 'RuntimeError: Event loop is closed' in capsys.readouterr().err


def test_the_other_failed_reads_of_a_failed_restore_are_not_logged_again(monkeypatch, caplog):
  """A restore reads many arrays at once and raises the first failure as one error; asyncio would
  log each other orbax task's failure ("Task exception was never retrieved") when it is
  collected. After a failed read those echoes are dropped; any other task's failure still shows."""
  import asyncio
  import gc

  checkpoint._quiet_orbax()
  namespace = {}
  source = 'async def read():\n  raise PermissionError("Permission denied")\n'
  exec(compile(source, os.path.join(os.sep, 'site', 'orbax', 'reader.py'), 'exec'), namespace)

  def unretrieved(read):
    loop = asyncio.new_event_loop()
    task = loop.create_task(read())
    loop.run_until_complete(asyncio.sleep(0))  # the task runs and fails; nobody asks for it
    loop.close()
    del task
    gc.collect()

  other = {}
  exec(compile(source, os.path.join(os.sep, 'site', 'mine', 'reader.py'), 'exec'), other)
  monkeypatch.setattr(checkpoint._DropOrbaxLeftovers, 'failures', 1)
  with caplog.at_level(logging.ERROR, logger='asyncio'):
    unretrieved(namespace['read'])
    assert not [r for r in caplog.records if 'never retrieved' in r.getMessage()]
    unretrieved(other['read'])
  echoes = [r.getMessage() for r in caplog.records if 'never retrieved' in r.getMessage()]
  assert len(echoes) == 1 and f'{os.sep}mine{os.sep}' in echoes[0], echoes
  monkeypatch.setattr(checkpoint._DropOrbaxLeftovers, 'failures', 0)
  with caplog.at_level(logging.ERROR, logger='asyncio'):
    unretrieved(namespace['read'])  # no read has failed: shown
  echoes = [r.getMessage() for r in caplog.records if 'never retrieved' in r.getMessage()]
  assert len(echoes) == 2 and f'{os.sep}orbax{os.sep}' in echoes[1], echoes
