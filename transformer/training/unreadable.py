"""Why a checkpoint did not read back: damage its own files prove, or a fault of the reader.

`checkpoint.Checkpointer.restore` moves a checkpoint aside only for proven damage: a checksum
that does not match, an integrity record that is missing or malformed, or a stored file that is
truncated, absent or does not decode (what tensorstore and the JSON reader say of the bytes they
read). Every other failure leaves the checkpoint where it is and ends the run with one line that
names the checkpoint, the reason and what to do (`diagnose`): a file this user may not read,
an I/O error that outlived its retries, an orbax or jax that cannot read what a newer one wrote,
another device topology, or an error that proves nothing. Before anything is called damaged,
every file of the checkpoint is read to its end, so a permission or an I/O error is never taken
for damage, whatever orbax made of it.
"""

from __future__ import annotations

import errno
import json
import os
import re

from transformer import util

# A transient I/O error is retried after each of these waits (one warning line each), then fails.
RETRY_SECONDS = (2.0, 5.0, 10.0)

_PERMISSION = {errno.EACCES: 'Permission denied', errno.EPERM: 'Operation not permitted'}
_IO = {
  errno.EIO: 'Input/output error',
  errno.ESTALE: 'Stale file handle',  # a network file system's server restarted
  errno.ENOTCONN: 'Transport endpoint is not connected',  # a FUSE mount that went away
  errno.ETIMEDOUT: 'Connection timed out',
}
# What tensorstore and the JSON reader say of bytes that are not what was written.
_DAMAGE = re.compile(
  r'OUT_OF_RANGE|DATA_LOSS|NOT_FOUND|[Tt]runcated|ZSTD|[Dd]ecompress|[Dd]ecod(e|ing)|'
  r'[Cc]orrupt|does not exist|not a valid|Unexpected end|unexpected EOF',
)
_TOPOLOGY = re.compile(
  r'topolog|device mesh|number of devices|device count|devices? (do not|does not) match|'
  r'addressable devices|[Ss]harding .*(devices|mesh)|mesh .*devices',
)
_VERSION = re.compile(
  r'[Uu]nsupported (checkpoint |)(format|version)|newer version|[Uu]nknown (format|version)'
)


causes = util.causes


def _os_reason(error: BaseException, codes: dict[int, str]) -> str | None:
  """util.os_reason, where tensorstore's `PERMISSION_DENIED` also counts as EACCES."""
  reason = util.os_reason(error, codes)
  if reason is None and codes is _PERMISSION:
    if any('PERMISSION_DENIED' in str(item) for item in causes(error)):
      return _PERMISSION[errno.EACCES]
  return reason


def transient(error: BaseException) -> str | None:
  """The I/O error's name ('Input/output error', ...) when a retry may read what failed."""
  return _os_reason(error, _IO)


def access_problem(path: str) -> str | None:
  """Reads every file under `path` to its end: the first permission or I/O error, as
  'Permission denied: FILE', else None (an absent file is damage, not access)."""
  problems: list[OSError] = []
  for root, _, names in os.walk(path, onerror=problems.append):
    for name in names:
      try:
        with open(os.path.join(root, name), 'rb') as f:
          while f.read(1 << 24):
            pass
      except OSError as e:
        problems.append(e)
  for e in problems:
    if not isinstance(e, FileNotFoundError):
      return f'{e.strerror or type(e).__name__}: {e.filename}'
  return None


def damage(error: BaseException) -> str | None:
  """What proves the bytes damaged (a file truncated, absent or not decoding), else None."""
  for item in causes(error):
    if isinstance(item, (json.JSONDecodeError, FileNotFoundError, EOFError)):
      return f'{type(item).__name__}: {util.first_line(item)}'
    if _DAMAGE.search(str(item)):
      return util.first_line(_innermost(error))
  return None


def _innermost(error: BaseException) -> BaseException:
  """The deepest cause: tensorstore's status line, under orbax's wrapper."""
  *_, last = causes(error)
  return last


def diagnose(
  error: BaseException, path: str, written_by: dict | None, installed: dict[str, str]
) -> tuple[bool, str]:
  """(True, what proves it) for damage; else (False, the one line for a checkpoint that failed to
  read through no proven damage: 'checkpoint PATH cannot be read here: REASON; ... WHAT TO DO').

  The reader's faults are ruled out first: a file this user cannot read, an I/O error, a writer
  newer than the reader (whose layout may look like missing files to an older orbax).
  """
  head = f'checkpoint {path} cannot be read here'
  kept = 'it was left in place and nothing else was moved'
  inner = util.first_line(_innermost(error), 160)
  access = access_problem(path) or _os_reason(error, _PERMISSION)
  if access:
    return False, (
      f'{head}: {access}; {kept}. Give this user read access (for example chmod -R u+rX '
      f'{path}, or run as its owner) and rerun to resume from it'
    )
  io = transient(error)
  if io:
    return False, (
      f'{head}: {io} after {len(RETRY_SECONDS)} retries ({inner}); {kept}. Check the disk or '
      'the network mount (dmesg, mount), then rerun to resume from it'
    )
  newer = _newer_writer(written_by or {}, installed)
  if newer or _VERSION.search(str(_innermost(error))):
    wrote = f' (written by {newer}, newer than this {_versions(installed)})' if newer else ''
    return False, (
      f'{head}: {inner}{wrote}; {kept}. Install the orbax-checkpoint and jax that wrote it '
      '(pip install -U orbax-checkpoint jax) and rerun'
    )
  proof = damage(error)
  if proof:
    return True, proof
  if any(_TOPOLOGY.search(str(item)) for item in causes(error)):
    return False, (
      f'{head}: it was written for another device topology ({inner}); {kept}. Restore it on '
      'one device (transformer.load does) or on as many devices as the run that wrote it'
    )
  return False, (
    f'{head}: orbax failed with {type(_innermost(error)).__name__}: {inner}, which does not '
    f'show the files damaged; {kept}. Check the file system and the orbax-checkpoint and jax '
    'versions, then rerun; to resume from an older checkpoint instead, move this one aside'
  )


def _version_tuple(text: str) -> tuple[int, ...]:
  return tuple(int(x) for x in re.findall(r'\d+', text)[:3])


def _newer_writer(written_by: dict, installed: dict[str, str]) -> str | None:
  """'orbax-checkpoint 0.12.0' when the checkpoint's writer is newer than what is installed."""
  newer = [
    f'{name} {written_by[name]}'
    for name, here in installed.items()
    if isinstance(written_by.get(name), str)
    and _version_tuple(written_by[name]) > _version_tuple(here)
  ]
  return ', '.join(newer) or None


def _versions(installed: dict[str, str]) -> str:
  return ', '.join(f'{name} {version}' for name, version in installed.items())
