"""A multi-process run that loses a peer process: find it fast, say so in one line, exit with 75.

`train_and_evaluate` turns the error a collective raises when a peer is gone into `PeerLost`;
`experiments/supervisor.py` covers what no Python code sees (the coordination service's abort).
The timeouts are `transformer.sharding`'s; docs/reliability.md ("Lost peer process") explains them.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import sys
import threading
import time
from collections.abc import Iterator

from transformer import util

RESUME = 'rerun the same command on every host to resume'
INFO_ENV = 'SPARROW_SUPERVISOR_INFO'  # where a supervised process tells its supervisor its run

# What the collectives (gloo, NCCL, MPI) and the coordination service say when a peer is gone.
_SIGNS = re.compile(
  r'gloo|nccl|connection (closed|reset|refused)|broken pipe|socket closed|heartbeat|'
  r'coordination ?service|unavailable:|deadline_exceeded|task \d+',
  re.IGNORECASE,
)


class PeerLost(Exception):
  """Another process of a multi-process run is gone; rerun every process to resume."""

  def __init__(self, message: str, *, process: int | None):
    super().__init__(message)
    self.process = process  # the lost process, when it is known


def is_peer_lost(error: BaseException, process_count: int) -> bool:
  """Whether `error` (or an error it came from) is a collective or barrier failing for a peer."""
  if process_count < 2:
    return False
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if not isinstance(error, (KeyboardInterrupt, SystemExit)) and _SIGNS.search(str(error)):
      if isinstance(error, (RuntimeError, ValueError, OSError, TimeoutError)) or _is_jax(error):
        return True
    error = error.__cause__ or error.__context__
  return False


def _is_jax(error: BaseException) -> bool:
  return type(error).__module__.startswith(('jax', 'jaxlib', 'orbax'))


def lost_process(text: str) -> int | None:
  """The process that the coordination service names in `text` as dead, if it names one."""
  match = re.search(r'[Tt]ask (\d+) heartbeat timeout', text) or re.search(
    r'stopped sending heartbeats\):\s*(\d+)', text
  )
  return int(match.group(1)) if match else None


BEAT_SECONDS = 1.0  # how often each process bumps its counter in the coordination service


def start_beating(process_index: int) -> None:
  """Bumps `sparrow_beat/<process>` in the coordination service's key-value store every
  BEAT_SECONDS from a daemon thread, so that survivors can tell which process stopped."""
  client = util.coordination_client()
  if client is None or _BEATING:
    return
  _BEATING.append(process_index)

  stop = threading.Event()

  def beat():
    count = 0
    while not stop.is_set():
      count += 1
      try:
        client.key_value_set(f'sparrow_beat/{process_index}', str(count), allow_overwrite=True)
      except Exception:  # the service is gone: the survivors' problem, not this thread's
        return
      stop.wait(BEAT_SECONDS)

  thread = threading.Thread(target=beat, name='sparrow-beat', daemon=True)
  thread.start()

  def stop_beating():  # at exit, before jax.distributed's own shutdown (registered earlier)
    stop.set()
    thread.join(timeout=5)

  atexit.register(stop_beating)


_BEATING: list[int] = []


def ask_who_is_lost(num_processes: int) -> int | None:
  """The lowest process whose beat stopped (read twice, 3 beats apart); 0 when the service
  itself is gone (it runs in process 0); None when no beat stopped or nobody beats."""
  client = util.coordination_client()
  if client is None or not _BEATING:
    return None

  def counts():
    out = {}
    for i in range(num_processes):
      try:
        out[i] = client.key_value_try_get(f'sparrow_beat/{i}')
      except Exception as error:  # NOT_FOUND: it never beat; anything else: no service
        if 'NOT_FOUND' not in str(error):
          raise
    return out

  try:
    before = counts()
    time.sleep(3 * BEAT_SECONDS)
    after = counts()
  except Exception:
    return 0
  stopped = [i for i in range(num_processes) if i != _BEATING[0] and before.get(i) == after.get(i)]
  return stopped[0] if stopped else None


def latest_listed(checkpoint_dir: str | None) -> int | None:
  """The newest complete checkpoint in `checkpoint_dir` (orbax names only those with digits)."""
  try:
    steps = [int(name) for name in os.listdir(checkpoint_dir) if name.isdigit()]
  except (OSError, TypeError):
    return None
  return max(steps) if steps else None


def message(process: int | None, checkpoint_dir: str | None, reason: str = '') -> str:
  """The one line a survivor prints (after 'lost peer: ')."""
  who = f'process {process}' if process is not None else 'a peer process'
  if process == 0:
    who += ' (the coordinator)'
  step = latest_listed(checkpoint_dir)
  if step is not None:
    kept = f'the last good checkpoint is {step} in {checkpoint_dir}'
  elif checkpoint_dir:
    kept = f'there is no checkpoint yet in {checkpoint_dir}'
  else:
    kept = 'no checkpoint was written'
  why = f' ({reason})' if reason else ''
  return f'{who} was lost{why}; {kept}; {RESUME}'


def from_error(error: BaseException, checkpoint_dir: str, num_processes: int) -> PeerLost:
  """`PeerLost` for a collective that failed because a peer is gone: names it if it can."""
  text = ' '.join(str(error).split())
  process = lost_process(text)
  if process is None:
    process = ask_who_is_lost(num_processes)
  reason = text if len(text) <= 160 else text[:157] + '...'
  return PeerLost(message(process, checkpoint_dir, reason), process=process)


@contextlib.contextmanager
def at_start_up(num_processes: int | None) -> Iterator[None]:
  """Turns a peer lost while the processes join (`jax.distributed.initialize`) into PeerLost."""
  try:
    yield
  except Exception as error:
    if not is_peer_lost(error, num_processes or 2):
      raise
    text = ' '.join(str(error).split())[:160]
    lost = PeerLost(message(lost_process(text), None, f'while joining: {text}'), process=None)
    raise lost from error


def announce(checkpoint_dir: str, process_index: int) -> None:
  """Tells a supervisor (experiments/supervisor.py) where this run's checkpoints are."""
  path = os.environ.get(INFO_ENV)
  if path:
    with open(path, 'w') as f:
      json.dump({'checkpoints': checkpoint_dir, 'process': process_index}, f)


def exit_now(line: str, status: int) -> None:
  """Prints `line`, flushes and ends the process at once with `status`.

  After a lost peer, normal exit would wait at jax.distributed's shutdown barrier, which a dead
  peer never reaches, and end in the coordination service's abort: so no clean-up runs.
  """
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
  os.write(2, (line.rstrip('\n') + '\n').encode())
  os._exit(status)
