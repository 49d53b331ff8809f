"""A lost peer process: which errors mean one, the line a survivor prints, and the supervisor
(experiments/supervisor.py) that turns the coordination service's abort into that line.

The real thing, two processes of `experiments.train` and a SIGKILL, is
training/test_faults.py::test_a_lost_process_ends_the_others_cleanly_and_the_pair_resumes.
"""

import os
import signal
import subprocess
import sys
import time

import jax
import pytest

from transformer.training import peers

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, 'supervised_child.py')

GLOO = (
  'UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:547] Connection '
  'closed by peer [127.0.0.1]:17304'
)


def test_collective_and_barrier_errors_are_a_lost_peer_only_with_peers():
  orbax_wrapped = ValueError('could not save')
  orbax_wrapped.__cause__ = jax.errors.JaxRuntimeError(
    'DEADLINE_EXCEEDED: Barrier timed out. Barrier id: save_1'
  )
  for error in [
    ValueError(GLOO),  # what jax.device_get raised in the two-process kill test
    jax.errors.JaxRuntimeError('UNAVAILABLE: Task 1 heartbeat timeout.'),
    orbax_wrapped,
    RuntimeError('Socket closed'),
  ]:
    assert peers.is_peer_lost(error, process_count=2), error
    assert not peers.is_peer_lost(error, process_count=1), error
  for error in [
    ValueError('d_model=7 must be divisible by num_heads=2'),
    KeyError('task 1'),
    KeyboardInterrupt(),
  ]:
    assert not peers.is_peer_lost(error, process_count=4), error


def test_the_line_names_the_process_and_the_last_listed_checkpoint(tmp_path):
  for name in ['50', '100', '150.orbax-checkpoint-tmp-3', '7.corrupt']:
    os.mkdir(tmp_path / name)
  line = peers.message(3, str(tmp_path), 'UNAVAILABLE: Task 3 heartbeat timeout')
  assert line == (
    f'process 3 was lost (UNAVAILABLE: Task 3 heartbeat timeout); the last good checkpoint is '
    f'100 in {tmp_path}; rerun the same command on every host to resume'
  )
  assert peers.message(None, str(tmp_path / 'none')).startswith('a peer process was lost; ')
  assert 'process 0 (the coordinator) was lost' in peers.message(0, None)
  text = 'The following tasks are unhealthy (stopped sending heartbeats):\n2\nThe tasks have'
  assert peers.lost_process(text) == 2 and peers.lost_process(GLOO) is None


def test_a_peer_lost_while_joining_is_peer_lost():
  with pytest.raises(peers.PeerLost, match=r'^a peer process was lost \(while joining: '):
    with peers.at_start_up(2):
      raise jax.errors.JaxRuntimeError('DEADLINE_EXCEEDED: Barrier timed out; 1 task missing')
  with pytest.raises(ValueError, match='must be in'):  # any other error passes through
    with peers.at_start_up(2):
      raise ValueError('--process_id=3 must be in [0, 2)')


def _supervise(behaviour, tmp_path, **popen):
  return subprocess.Popen(
    [sys.executable, CHILD, behaviour, str(tmp_path)],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    **popen,
  )


def test_the_coordination_service_abort_becomes_one_line_and_status_75(tmp_path):
  os.mkdir(tmp_path / '40')
  proc = _supervise('aborted', tmp_path)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 75, err
  assert err == (
    f'lost peer: process 1 was lost; the last good checkpoint is 40 in {tmp_path}; rerun the '
    'same command on every host to resume\n'
  )
  proc = _supervise('coordinator_gone', tmp_path)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 75, err
  assert err.startswith('lost peer: process 0 (the coordinator) was lost; the last good '), err


@pytest.mark.parametrize('to_group', [False, True])
def test_sigterm_reaches_the_child_once(to_group, tmp_path):
  """Sent to the supervisor alone it is passed on; sent to the process group (a terminal, or a
  scheduler that signals every process) the child has it already and gets no second copy."""
  proc = _supervise('signals', tmp_path, start_new_session=True)
  assert proc.stdout.readline() == 'ready\n'
  if to_group:
    os.killpg(proc.pid, signal.SIGTERM)
  else:
    proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=60)
  assert (proc.returncode, err) == (75, 'preempted: 1 SIGTERM\n')


def test_other_deaths_pass_through_unchanged(tmp_path):
  proc = _supervise('crash', tmp_path)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 1 and 'RuntimeError: a bug: not a lost peer' in err
  proc = _supervise('segfault', tmp_path)
  started = time.time()
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGSEGV and 'nothing about other processes' in err
  assert time.time() - started < 30
