"""What the entry points share: the --config flag and one-line errors instead of tracebacks."""

import os
import sys
from collections.abc import Callable

from absl import app, flags, logging
from ml_collections import config_flags

from experiments import supervisor

_DEBUG = flags.DEFINE_bool('debug', False, 'Show full tracebacks instead of one-line errors.')
# Errors that a user's input or machine causes (ConnectionError: a dataset that could not be
# downloaded); anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, PermissionError, NotADirectoryError, ConnectionError)


def define_config(default: str = 'configs/default.py') -> flags.FlagHolder:
  """--config=FILE plus --config.a.b=value overrides; a bad override is one clear error line."""
  try:
    return config_flags.DEFINE_config_file('config', default, 'Experiment config file (Python).')
  except (KeyError, AttributeError, TypeError, ValueError) as error:
    text = str(error).replace('\\n', ' ').replace('\\', '').replace("'", '').strip('"')
    message = ' '.join(text.split())
    sys.exit(f'error: bad --config override: {message}')


def huge_page_tunables() -> str | None:
  """GLIBC_TUNABLES with glibc's malloc asking for transparent huge pages; None where that
  changes nothing or the variable already sets it.

  XLA:CPU allocates a step's scratch buffer afresh and returns it after the step; above 32 MB
  glibc always maps such a buffer with mmap, so each step faults in its pages one 4 KiB page at a
  time. gpt_tiny's train step maps 114 MB a step: 29k page faults and ~65 ms of kernel time per
  step on 2 cores. Where the kernel gives huge pages only to memory that asks (`madvise`, the
  usual default), `glibc.malloc.hugetlb=1` makes malloc ask: ~500 faults a step, and 400 steps of
  the default run took 49.6 s instead of 66.5 s, with the same losses.
  """
  tunables = os.environ.get('GLIBC_TUNABLES', '')
  if 'glibc.malloc.hugetlb' in tunables:
    return None
  try:
    with open('/sys/kernel/mm/transparent_hugepage/enabled') as f:
      if '[madvise]' not in f.read():  # [always]: every mapping gets them; [never]: none can
        return None
  except OSError:  # not Linux
    return None
  return ':'.join(filter(None, [tunables, 'glibc.malloc.hugetlb=1']))


def compilation_cache() -> None:
  """Turns on JAX's persistent compilation cache in ~/.cache/sparrow/jax, so that relaunching a
  run (a resume, another seed, sampling) skips most compiling: char_lm reached its first step in
  5.1 s instead of 26.2 s on 2 busy cores. JAX_COMPILATION_CACHE_DIR, when set, is used instead;
  SPARROW_COMPILATION_CACHE=0 turns it off."""
  import jax

  if os.environ.get('SPARROW_COMPILATION_CACHE', '1') == '0':
    return
  if not os.environ.get('JAX_COMPILATION_CACHE_DIR'):
    jax.config.update('jax_compilation_cache_dir', os.path.expanduser('~/.cache/sparrow/jax'))
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)


def _with_huge_pages(main: Callable[[], None]) -> None:
  """Starts this command again, once, under `huge_page_tunables()`: glibc reads its tunables only
  when a process starts. Not when `main` was called from other code."""
  tunables = huge_page_tunables() if main.__module__ == '__main__' else None
  if tunables is not None:
    os.environ['GLIBC_TUNABLES'] = tunables
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def run(main: Callable[[], None], first_line: str = '') -> None:
  """Runs `main` under absl; user errors print `error: ...` and exit with status 2.

  `first_line` goes to stdout at once, before the config (which imports JAX, about 2 s) is read,
  so that a long command says within a second that it started; stderr stays for what went wrong.

  On Linux it first starts the command again with huge pages for large host buffers (see
  `huge_page_tunables`): a CPU training step of the default ran 1.34x faster
  (`python -m experiments.bench_huge_pages --config=configs/default.py`).

  A run stopped by SIGTERM/SIGINT after its checkpoint prints `preempted: ...` and exits with
  status `transformer.training.faults.EXIT_PREEMPTED` (75): rerun the same command to resume.
  One that lost a peer process prints `lost peer: ...` and exits with 75 too.
  """

  _with_huge_pages(main)
  if first_line and not os.environ.get(supervisor.SUPERVISED_ENV):  # its parent said it
    print(first_line, flush=True)

  def wrapped(argv):
    if len(argv) > 1:
      raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
    logging.set_verbosity(logging.WARNING)  # progress goes to stdout; keep absl INFO out of it
    from transformer.training import faults, peers  # after flag parsing: keeps --help fast

    try:
      main()
    except peers.PeerLost as lost:  # at once: a normal exit would wait for the lost peer
      peers.exit_now(f'lost peer: {lost}', faults.EXIT_PREEMPTED)
    except faults.Preempted as stop:
      print(f'preempted: {stop}', file=sys.stderr, flush=True)
      sys.exit(faults.EXIT_PREEMPTED)
    except USER_ERRORS as error:
      if _DEBUG.value:
        raise
      print(f'error: {error}', file=sys.stderr)
      sys.exit(2)

  app.run(wrapped)
