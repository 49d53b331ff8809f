"""transformer.util: the host-memory release that training calls after each compile."""

import ctypes
import ctypes.util

import pytest

from transformer import util


def _rss_anon_mib() -> float:
  with open('/proc/self/status') as f:
    fields = dict(line.split(':', 1) for line in f)
  return int(fields['RssAnon'].split()[0]) / 1024


def _glibc():
  try:
    libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
    libc.malloc_trim  # noqa: B018
    return libc
  except (OSError, AttributeError):
    return None


@pytest.mark.skipif(_glibc() is None, reason='malloc_trim is glibc-only; elsewhere a no-op')
def test_release_host_memory_returns_freed_heap_pages():
  # 160 MiB of small blocks, as a compiler leaves them: below glibc's mmap threshold, so free()
  # keeps their pages in the arena. Writing each block makes its page resident.
  libc = _glibc()
  libc.malloc.restype = ctypes.c_void_p
  libc.free.argtypes = [ctypes.c_void_p]
  size, count = 4096, 40_000
  blocks = [libc.malloc(size) for _ in range(count)]
  for b in blocks:
    ctypes.memset(b, 1, size)
  keep = libc.malloc(64)  # on top of the heap, so that free() alone cannot shrink it
  held = _rss_anon_mib()
  for b in blocks:
    libc.free(b)
  after_free = _rss_anon_mib()
  assert util.release_host_memory() is True
  released = _rss_anon_mib()
  libc.free(keep)
  assert held - after_free < 40, (held, after_free)  # free() kept most pages resident
  assert after_free - released > 100, (held, after_free, released)  # the release returned them
