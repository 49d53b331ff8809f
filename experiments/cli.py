"""What the entry points share: the --config flag and one-line errors instead of tracebacks."""

import os
import sys
from collections.abc import Callable

from absl import app, flags, logging
from ml_collections import config_flags

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


def run(main: Callable[[], None]) -> None:
  """Runs `main` under absl; user errors print `error: ...` and exit with status 2.

  A run stopped by SIGTERM/SIGINT after its checkpoint prints `preempted: ...` and exits with
  status `transformer.training.faults.EXIT_PREEMPTED` (75): rerun the same command to resume.
  One that lost a peer process prints `lost peer: ...` and exits with 75 too.
  """

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
