"""Small helpers that every room shares: one-line error text, JSON that never fails, atomic file
writes, whether a workdir has checkpoints and a headless pyplot."""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import jax

# errno values that mean "the file system has no room": full disk, quota, per-file size limit.
NO_SPACE = {errno.ENOSPC: 'No space left on device', errno.EDQUOT: 'Disk quota exceeded'}
NO_SPACE[errno.EFBIG] = 'File too large'


def first_line(error: BaseException, limit: int = 300) -> str:
  """The first non-blank line of an error's message (its type name if it has none), cut short."""
  lines = [line for line in str(error).strip().splitlines() if line.strip()]
  text = lines[0] if lines else type(error).__name__
  return text if len(text) <= limit else text[: limit - 3] + '...'


def coordination_client() -> Any:
  """jax.distributed's coordination client (its key-value store), or None in a single process."""
  try:
    from jax._src import distributed  # jax has no public handle on its coordination client
  except ImportError:
    return None
  return distributed.global_state.client


def key_name(path: tuple) -> str:
  """'opt_state/1/mu/w' for a jax key path (dict keys, attributes and indices alike)."""
  return jax.tree_util.keystr(path, simple=True, separator='/')


def jsonable(x: Any) -> Any:
  """`x` as plain JSON data: what is not JSON (arrays, paths, dtypes) becomes its str()."""
  return json.loads(json.dumps(x, default=str))


def write_atomic(path: str, text: str) -> None:
  """Writes a temp file in the same directory, then renames it over `path`: never half a file."""
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or '.', prefix=f'.{os.path.basename(path)}.')
  try:
    with os.fdopen(fd, 'w') as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def write_json(path: str, value: Any) -> None:
  """`value` as indented JSON at `path`, atomically."""
  write_atomic(path, json.dumps(value, indent=1, default=str))


def has_checkpoints(workdir: str) -> bool:
  """Whether workdir/checkpoints holds a step (orbax names each step's directory '<step>')."""
  directory = os.path.join(workdir, 'checkpoints')
  return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def pyplot():
  """matplotlib.pyplot on the headless Agg backend (plots are files, never windows)."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  return plt


def release_host_memory() -> bool:
  """Hands the C heap's free pages back to the operating system (glibc's `malloc_trim`).

  XLA compiles on the host heap; what the compiler frees stays in glibc's arenas, so a process's
  resident memory keeps every compile's peak. Trimming after a compile lets the next one, and
  the steps, reuse pages the system already reclaimed. Returns whether anything ran: False off
  glibc (macOS, musl), where this is a no-op.
  """
  import ctypes
  import ctypes.util

  global _LIBC
  if _LIBC is None:
    try:
      _LIBC = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
      _LIBC.malloc_trim  # noqa: B018 - glibc only
    except (OSError, AttributeError):
      _LIBC = False
  if not _LIBC:
    return False
  _LIBC.malloc_trim(0)
  return True


_LIBC: Any = None


def causes(error: BaseException) -> Iterator[BaseException]:
  """`error`, then each error it was raised from or during, once each."""
  seen, todo = set(), [error]
  while todo:
    item = todo.pop()
    if item is None or id(item) in seen:
      continue
    seen.add(id(item))
    yield item
    todo += [item.__cause__, item.__context__]


def os_reason(error: BaseException | str, codes: dict[int, str]) -> str | None:
  """codes[errno] when `error` or a cause is an OSError with one of those errnos, or says so in
  its text (orbax's tensorstore reports the errno only there: `[os_error_code='28']`)."""
  for item in causes(error) if isinstance(error, BaseException) else [error]:
    if isinstance(item, OSError) and item.errno in codes:
      return codes[item.errno]
    text = str(item)
    for code, reason in codes.items():
      if reason in text or f"os_error_code='{code}'" in text:
        return reason
  return None


def no_space_reason(error: BaseException | str) -> str | None:
  """'No space left on device' (or quota, file size) if `error` or its causes say so, else None."""
  return os_reason(error, NO_SPACE)


def byte_size(num_bytes: float) -> str:
  """`num_bytes` for a reader: '512 bytes', '3.2 MiB'."""
  for unit in ('bytes', 'KiB', 'MiB', 'GiB'):
    if num_bytes < 1024 or unit == 'GiB':
      return f'{num_bytes:.0f} {unit}' if unit == 'bytes' else f'{num_bytes:.1f} {unit}'
    num_bytes /= 1024
  return f'{num_bytes:.1f} TiB'
