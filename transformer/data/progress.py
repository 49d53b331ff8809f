"""The progress lines of corpus preparation: phase, MB done, MB/s and ETA, at least every interval.

Whole lines, flushed, so a terminal and a log file (`2> prepare.log`) show the same thing.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

INTERVAL = 5.0  # seconds between lines while a phase runs: well inside the promised 10 s


def duration(seconds: float) -> str:
  """'1h02m03s', '2m03s' or '3s'; '?' for an unknown (infinite) time."""
  if not math.isfinite(seconds):
    return '?'
  minutes, secs = divmod(int(round(seconds)), 60)
  hours, minutes = divmod(minutes, 60)
  if hours:
    return f'{hours}h{minutes:02d}m{secs:02d}s'
  return f'{minutes}m{secs:02d}s' if minutes else f'{secs}s'


class Progress:
  """One line when a phase starts, then one at least every `interval` seconds until `close`.

  A thread writes the lines, so they keep coming while the caller blocks in a long call (the
  SentencePiece trainer, a pool of workers). Each line reads the phase's counters through the
  `done` callable; a phase whose progress cannot be read (a trainer) states its input and an
  estimated ETA instead.
  """

  def __init__(
    self,
    log: Callable[[str], None],
    interval: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    thread: bool = True,
  ):
    self._log, self._clock = log, clock
    self.interval = INTERVAL if interval is None else interval
    self._lock = threading.Lock()
    self._phase, self._total, self._start, self._last = '', 0, clock(), -math.inf
    self._done: Callable[[], int] | None = None
    self._detail: Callable[[], str] = lambda: ''
    self._estimate = math.inf
    self._stopped = threading.Event()
    self._thread = threading.Thread(target=self._beat, daemon=True) if thread else None
    if self._thread:
      self._thread.start()

  def phase(
    self,
    name: str,
    total_bytes: int | None,
    done: Callable[[], int] | None = None,
    detail: Callable[[], str] | None = None,
    estimate: float = math.inf,
  ) -> None:
    """Starts phase `name` over `total_bytes` (None: not known before it is read); `done()` gives
    the bytes done so far (None: not known until the phase ends, and `estimate` seconds is the
    guess of its length)."""
    with self._lock:
      self._phase, self._total, self._start = name, total_bytes, self._clock()
      self._done, self._detail, self._estimate = done, detail or (lambda: ''), estimate
      self._write()

  def note(self, text: str) -> None:
    """Writes one line of its own (a phase's result), which also counts as the latest line."""
    with self._lock:
      self._log(f'prepare: {text}')
      self._last = self._clock()

  def tick(self) -> None:
    """Writes the phase's line if the last line is `interval` seconds old."""
    with self._lock:
      if self._phase and self._clock() - self._last >= self.interval:
        self._write()

  def close(self) -> None:
    self._stopped.set()
    if self._thread:
      self._thread.join()

  def __enter__(self) -> Progress:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def line(self) -> str:
    """'prepare: PHASE, DONE/TOTAL MB, RATE MB/s, ETA T (detail)', or for a phase without
    counters 'prepare: PHASE, TOTAL MB, T so far, ETA ~T (detail)'."""
    elapsed = max(self._clock() - self._start, 1e-9)
    size = '?' if self._total is None else f'{self._total / 1e6:.1f}'
    if self._done is None:
      left = self._estimate - elapsed
      eta = f'~{duration(left)}' if 0 < left < math.inf else '?'
      text = f'{self._phase}, {size} MB, {duration(elapsed)} so far, ETA {eta}'
    else:
      done = self._done()
      rate = done / elapsed
      known = rate > 0 and self._total is not None and done <= self._total
      eta = duration((self._total - done) / rate) if known else '?'  # past a compressed total
      text = f'{self._phase}, {done / 1e6:.1f}/{size} MB, {rate / 1e6:.1f} MB/s, ETA {eta}'
    detail = self._detail()
    return f'prepare: {text}' + (f' ({detail})' if detail else '')

  def _write(self) -> None:
    self._log(self.line())
    self._last = self._clock()

  def _beat(self) -> None:
    while not self._stopped.wait(min(1.0, self.interval / 4)):
      self.tick()
