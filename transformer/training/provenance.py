"""Which code trained and measured a run: the git revision of the source (`source_state`, `Source`),
written beside the run's config (`write_run_metadata`) and appended to its `revisions.jsonl` at
every start of training and every measurement (`record_start`, `record_measure`), and read back
as step ranges (`revision_history`, `describe_history`)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
from collections.abc import Sequence

import jax
import ml_collections

from transformer import util

_SOURCE_DIR = os.path.dirname(os.path.abspath(__file__))
REVISIONS = 'revisions.jsonl'  # a JSON line per start of training: see record_start


def source_state(
  source_dir: str = _SOURCE_DIR, ignore: Sequence[str] = ()
) -> tuple[str, list[str]]:
  """(HEAD sha, changed files) of the git checkout holding `source_dir`; ('unknown', []) outside
  git. Untracked files count, except those git ignores and those under a path in `ignore`: an
  absolute path, or one relative to the checkout's top (such as 'docs/results'). A sweep's
  check and each of its runs leave out the same paths: the sweep's own output, never code."""

  def git(*args: str) -> str:
    out = subprocess.run(['git', '-C', source_dir, *args], capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip
    return out.stdout

  try:
    top = os.path.realpath(git('rev-parse', '--show-toplevel').strip())
    head = git('rev-parse', 'HEAD').strip()
    status = git('status', '--porcelain=v1', '-z', '--untracked-files=all').split('\0')
  except (OSError, subprocess.SubprocessError):
    return 'unknown', []
  skip = []
  for path in ignore:
    rel = os.path.relpath(os.path.realpath(path), top) if os.path.isabs(path) else path
    if not rel.startswith('..') and os.path.normpath(rel) != '.':
      skip.append(os.path.normpath(rel).replace(os.sep, '/'))
  changed, entries = [], iter(status)
  for entry in entries:
    if not entry:
      continue
    if entry[0] in 'RC':  # a rename or copy: the next entry is the old path
      next(entries, None)
    path = entry[3:]
    if not any(path == s or path.startswith(s + '/') for s in skip):
      changed.append(path)
  return head, sorted(changed)


def _git_revision(source_dir: str = _SOURCE_DIR, ignore: Sequence[str] = ()) -> str:
  """The HEAD sha of the checkout holding `source_dir`, + '-dirty' when it has changes outside
  `ignore` (`source_state`); 'unknown' outside git."""
  head, changed = source_state(source_dir, ignore)
  return head + ('-dirty' if changed and head != 'unknown' else '')


@dataclasses.dataclass(frozen=True)
class Source:
  """Where a run's code is: the git checkout holding `directory`, and the paths in it that are
  output, not code (`ignore`, as `source_state` reads them). A sweep passes its own output
  folder and the results roots, so that the runs' revisions are clean when the sweep's is."""

  directory: str = _SOURCE_DIR
  ignore: tuple[str, ...] = ()

  def revision(self, workdir: str) -> str:
    """The revision a run in `workdir` records: its own files never make it dirty."""
    return _git_revision(self.directory, (*self.ignore, os.path.abspath(workdir)))


def write_run_metadata(
  workdir: str, config: ml_collections.ConfigDict, source: Source | None = None
) -> None:
  """Writes workdir/config.json and workdir/git_revision.txt (process 0 only), each atomically.

  Call `check_resume_compatible` first: this overwrites the config.json of a previous run.
  """
  if jax.process_index() != 0:
    return
  os.makedirs(workdir, exist_ok=True)
  util.write_atomic(
    os.path.join(workdir, 'config.json'), config.to_json_best_effort(indent=2) + '\n'
  )
  revision = (source or Source()).revision(workdir)
  util.write_atomic(os.path.join(workdir, 'git_revision.txt'), revision + '\n')


def record_start(workdir: str, step: int, source: Source | None = None) -> None:
  """Appends this start of training to workdir/revisions.jsonl (process 0): the code's revision,
  whether it had uncommitted changes (outside `source.ignore` and the workdir), the step it
  trains from and the time (UTC).

  The file is only ever appended to, so it keeps every revision that trained the workdir;
  `revision_history` turns its lines into step ranges. git_revision.txt holds the latest only.
  """
  if jax.process_index() != 0:
    return
  _append_revision(workdir, (source or Source()).revision(workdir), {'start_step': int(step)})


def record_measure(workdir: str, source: Source | None = None) -> None:
  """Appends to workdir/revisions.jsonl the code that measures the run there (a sweep's measure,
  or an evaluation of another run's checkpoint): a line with "measure": true and no start_step,
  so that `revision_history`, which is about training, skips it."""
  if jax.process_index() != 0:
    return
  _append_revision(workdir, (source or Source()).revision(workdir), {'measure': True})


def _append_revision(workdir: str, revision: str, fields: dict) -> None:
  line = {
    'revision': revision.removesuffix('-dirty'),
    'dirty': revision.endswith('-dirty'),
    **fields,
    'time': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
  }
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, REVISIONS)
  with open(path, 'a+b') as f:  # appends go to the end, wherever the file position is
    cut = False
    if f.seek(0, os.SEEK_END):
      f.seek(-1, os.SEEK_END)
      cut = f.read(1) != b'\n'  # a line cut short by a kill: start on a new line
    f.write((b'\n' if cut else b'') + json.dumps(line).encode() + b'\n')
    f.flush()
    os.fsync(f.fileno())


def revision_history(workdir: str) -> list[dict]:
  """Every start of training in `workdir`, oldest first: revision, dirty, start_step, time and
  end_step, the step that the later starts kept of its work (the next start's step, or the latest
  checkpoint for the last start; equal to start_step when nothing it trained was kept).

  Steps trained before revisions.jsonl existed come first, with revision None. A workdir trained
  only before it gives one entry from git_revision.txt (the latest start's revision) with
  start_step None; one with neither gives [].
  """
  entries = []
  try:
    with open(os.path.join(workdir, REVISIONS)) as f:
      for text in f:
        try:
          entry = json.loads(text)
        except ValueError:  # a line cut short by a kill
          continue
        if isinstance(entry, dict) and type(entry.get('start_step')) is int:
          entries.append(entry)
  except FileNotFoundError:
    old = os.path.join(workdir, 'git_revision.txt')
    if not os.path.exists(old):
      return []
    with open(old) as f:
      revision = f.read().strip()
    entry = {'revision': revision.removesuffix('-dirty'), 'dirty': revision.endswith('-dirty')}
    return [{**entry, 'start_step': None, 'end_step': None, 'time': None}]
  if entries and entries[0]['start_step'] > 0:  # resumed a checkpoint made before the record
    entries.insert(0, {'revision': None, 'dirty': None, 'start_step': 0, 'time': None})
  directory = os.path.join(workdir, 'checkpoints')
  listed = os.listdir(directory) if os.path.isdir(directory) else []
  bound = max((int(name) for name in listed if name.isdigit()), default=0)
  for entry in reversed(entries):  # a later start from an earlier step drops the steps after it
    entry['end_step'] = max(entry['start_step'], bound)
    bound = min(bound, entry['start_step'])
  return entries


def describe_history(workdir: str) -> str:
  """The revisions that trained `workdir`, a line each with its steps: for a reader."""
  entries = revision_history(workdir)
  if not entries:
    return f'{workdir}: no record of the code that trained it'
  if entries[0]['start_step'] is None:
    entry = entries[0]
    dirty = ' with uncommitted changes' if entry['dirty'] else ''
    return (
      f'{workdir}: last trained by revision {entry["revision"]}{dirty} (git_revision.txt; the '
      'revisions of earlier starts were not recorded then)'
    )
  revisions = {e['revision'] for e in entries if e['revision'] is not None}
  lines = [f'{workdir}: trained by {len(revisions)} revision(s)']
  for entry in entries:
    steps = f'steps {entry["start_step"]}-{entry["end_step"]}'
    if entry['revision'] is None:
      lines.append(f'  {steps:<16} an unrecorded revision (trained before revisions.jsonl)')
      continue
    dirty = ' with uncommitted changes' if entry['dirty'] else ''
    lines.append(f'  {steps:<16} {entry["revision"]}{dirty}, started {entry["time"]}')
  return '\n'.join(lines)
