"""The console progress line of a training run: step, loss, learning rate, tokens/s and ETA."""

import math
import sys
import time


class Progress:
  """One console line per log step: step, loss, learning rate, tokens/s and ETA."""

  def __init__(self, total: int, start: int):
    self.total, self.start_step, self.start_time = total, start, time.time()
    self.tty = sys.stdout.isatty()

  def update(self, step: int, loss: float, lr: float, tokens_per_sec: float) -> None:
    done = step - self.start_step
    rate = done / max(time.time() - self.start_time, 1e-9)
    eta = (self.total - step) / rate if rate > 0 else float('inf')
    width = 20
    filled = int(width * step / self.total)
    bar = '#' * filled + '.' * (width - filled)
    line = (
      f'[{bar}] step {step}/{self.total} | loss {loss:.4f} | lr {lr:.3g} | '
      f'{tokens_per_sec / 1e3:.1f}k tok/s | ETA {_duration(eta)}'
    )
    print(('\r' + line) if self.tty else line, end='' if self.tty else '\n', flush=True)

  def close(self) -> None:
    if self.tty:
      print()


def _duration(seconds: float) -> str:
  if not math.isfinite(seconds):
    return '?'
  minutes, seconds = divmod(int(seconds), 60)
  return f'{minutes}m{seconds:02d}s'
