"""Runs one process of a multi-process job as a child, so that losing a peer ends it cleanly.

When a peer is lost, JAX's coordination service aborts the others from a C++ thread (SIGABRT
and a crash dump), at once if the lost one was process 0, else after the heartbeat timeout. No
Python code in the child can stop that, so this parent, which never imports JAX, prints one
`lost peer: ...` line instead and exits with status 75. It passes SIGTERM and SIGINT on (once,
even when the child got them too), and its child dies with it (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import NoReturn

SUPERVISED_ENV = 'SPARROW_SUPERVISED_FD'  # set in the child: its signal wake-up pipe
HOLD_SECONDS = 60.0  # the child's stderr is passed on this late (at once when it ends)
_FORWARD_AFTER = 0.2  # seconds to wait for the child to say it got a signal itself
_LOST = re.compile(
  r'JAX distributed service detected fatal errors|coordination.?service|heartbeat|Gloo|'
  r'Socket closed|Connection (closed|reset|refused)',
  re.IGNORECASE,
)


def _peers():
  """transformer/training/peers.py alone (stdlib only): importing `transformer` loads JAX."""
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'transformer')
  spec = importlib.util.spec_from_file_location('_sparrow_peers', f'{path}/training/peers.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def is_child() -> bool:
  """Whether this process is the supervised child; if so, its signals now reach the parent."""
  fd = os.environ.get(SUPERVISED_ENV)
  if not fd:
    return False
  os.set_blocking(int(fd), False)
  signal.set_wakeup_fd(int(fd), warn_on_full_buffer=False)  # one byte per signal received
  return True


def run_child() -> NoReturn:
  """Runs this command again as a child and exits as described above."""
  peers = _peers()
  wake_read, wake_write = os.pipe()
  info = tempfile.NamedTemporaryFile(prefix='sparrow_run_', suffix='.json', delete=False).name
  env = {**os.environ, SUPERVISED_ENV: str(wake_write), peers.INFO_ENV: info}
  proc = subprocess.Popen(
    [sys.executable, *sys.orig_argv[1:]],
    env=env,
    stderr=subprocess.PIPE,
    pass_fds=(wake_write,),
    preexec_fn=_die_with_parent,
  )
  os.close(wake_write)
  pending: list[tuple[int, float]] = []  # signals this process got, not yet passed on
  for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, lambda signum, frame: pending.append((signum, time.time())))
  stderr = _Stderr()
  child_got: dict[int, float] = {}
  streams = [proc.stderr.fileno(), wake_read]
  while streams:
    try:
      ready, _, _ = select.select(streams, [], [], 0.05)
    except InterruptedError:
      ready = []
    for fd in ready:
      chunk = os.read(fd, 65536)
      if not chunk:
        streams.remove(fd)
      elif fd == wake_read:
        child_got.update((byte, time.time()) for byte in chunk)
      else:
        stderr.feed(chunk)
    now = time.time()
    for signum, when in list(pending):
      if child_got.get(signum, 0.0) >= when - 1.0:  # the child got it itself (a process group)
        pending.remove((signum, when))
      elif now - when > _FORWARD_AFTER:
        pending.remove((signum, when))
        if proc.poll() is None:
          proc.send_signal(signum)
    stderr.release_old(now)
  code = proc.wait()
  os.close(wake_read)
  try:
    with open(info) as f:
      run = json.load(f)
  except (OSError, ValueError):
    run = {}
  os.unlink(info)
  text = stderr.all_text()
  if code < 0 and _LOST.search(text):  # aborted by the coordination service: a peer is gone
    process = peers.lost_process(text)
    if process is None and run.get('process', 0) != 0:
      # The service names a process it declares dead; an abort naming none means the service
      # itself, which runs in process 0, is gone.
      process = 0
    peers.exit_now(f'lost peer: {peers.message(process, run.get("checkpoints"))}', 75)
  # A preempted or peer-lost child says what it has to in one line; the rest is shutdown noise.
  stderr.release(re.compile(r'(preempted|lost peer): ') if code == 75 else None)
  if code < 0:  # the same death for whoever started this process
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
  sys.exit(code)


def _die_with_parent() -> None:
  """In the child before exec: SIGKILL when the parent dies (Linux), e.g. a SIGKILL'd host."""
  try:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass


class _Stderr:
  """The child's stderr, passed on line by line HOLD_SECONDS late, so that what the child
  prints while the coordination service takes it down (C++ logs, a crash dump) can be dropped."""

  def __init__(self):
    self.partial, self.held = b'', []
    self.tail: list[str] = []  # what the verdict reads: the last lines, held or not

  def feed(self, chunk: bytes) -> None:
    *lines, self.partial = (self.partial + chunk).split(b'\n')
    for raw in lines:
      line = raw.decode(errors='replace')
      self.tail = (self.tail + [line])[-400:]
      self.held.append((time.time(), line))

  def release_old(self, now: float) -> None:
    while self.held and now - self.held[0][0] > HOLD_SECONDS:
      self._write(self.held.pop(0)[1])

  def release(self, only: re.Pattern | None = None) -> None:
    """Passes on every held line (or those that match `only`), and drops the rest."""
    held, self.held = [line for _, line in self.held], []
    if self.partial:
      held.append(self.partial.decode(errors='replace'))
      self.partial = b''
    for line in held:
      if only is None or only.match(line):
        self._write(line)

  def all_text(self) -> str:
    return '\n'.join(self.tail + [self.partial.decode(errors='replace')])

  @staticmethod
  def _write(line: str) -> None:
    sys.stderr.write(line + '\n')
    sys.stderr.flush()
