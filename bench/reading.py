"""How far a reader walks: the distinct library lines one call runs, counted by a line tracer.

`python -m experiments.trace_forward` counts building and applying a preset once ("how far a
reader walks"); docs/architecture.md holds the figures.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
from collections.abc import Callable
from typing import Any


def lines_run(fn: Callable[[], Any], root: str) -> dict[str, set[int]]:
  """{file: distinct line numbers} of the files under `root` that run while `fn()` runs.

  A `sys.settrace` tracer over the calling thread: it counts each line once however often it
  runs, the `def` line of each function entered among them, and follows Python only, so jitted
  and compiled code counts by the Python that traces it.
  """
  root = os.path.abspath(root) + os.sep
  seen: dict[str, set[int]] = collections.defaultdict(set)

  def local(frame, event, arg):
    if event == 'line':
      seen[frame.f_code.co_filename].add(frame.f_lineno)
    return local

  def on_call(frame, event, arg):
    if not frame.f_code.co_filename.startswith(root):
      return None
    seen[frame.f_code.co_filename].add(frame.f_code.co_firstlineno)  # the def (or decorator)
    return local

  previous = sys.gettrace()
  threading.settrace(on_call)
  sys.settrace(on_call)
  try:
    fn()
  finally:
    sys.settrace(previous)
    threading.settrace(previous)
  return dict(seen)


def summary(seen: dict[str, set[int]], root: str) -> list[tuple[str, int]]:
  """[(path relative to root's parent, lines)], most lines first."""
  parent = os.path.dirname(os.path.abspath(root))
  rows = [(os.path.relpath(f, parent), len(lines)) for f, lines in seen.items()]
  return sorted(rows, key=lambda r: (-r[1], r[0]))
