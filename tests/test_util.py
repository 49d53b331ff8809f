"""transformer.util: the host-memory release that training calls after each compile."""

import ctypes
import ctypes.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run in a fresh interpreter, whose heap holds nothing else: 160 MiB of small blocks, as a
# compiler leaves them, below glibc's mmap threshold, so free() keeps their pages in the arena.
# Writing each block makes its page resident; a block allocated after them keeps the heap's top.
_PROBE = """
import ctypes, ctypes.util, json, sys
from transformer import util

def anon():
  with open('/proc/self/status') as f:
    fields = dict(line.split(':', 1) for line in f)
  return int(fields['RssAnon'].split()[0]) / 1024

libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(4096) for _ in range(40_000)]
for b in blocks:
  ctypes.memset(b, 1, 4096)
keep = libc.malloc(64)
held = anon()
for b in blocks:
  libc.free(b)
after_free = anon()
released = util.release_host_memory() if sys.argv[1] == 'release' else None
print(json.dumps({'held': held, 'after_free': after_free, 'after': anon(), 'ran': released}))
"""


def _glibc() -> bool:
  try:
    ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6').malloc_trim  # noqa: B018
    return True
  except (OSError, AttributeError):
    return False


def _probe(mode: str) -> dict:
  out = subprocess.run(
    [sys.executable, '-c', _PROBE, mode], cwd=ROOT, capture_output=True, text=True, check=True
  )
  return json.loads(out.stdout)


@pytest.mark.skipif(not _glibc(), reason='malloc_trim is glibc-only; elsewhere a no-op')
def test_release_host_memory_returns_freed_heap_pages():
  kept = _probe('keep')  # free() alone keeps the pages resident
  assert kept['held'] - kept['after'] < 40, kept
  released = _probe('release')
  assert released['ran'] is True
  assert released['after_free'] - released['after'] > 100, released  # the release returned them
