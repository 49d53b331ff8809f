"""Train (or resume) one experiment: python -m experiments.train --config=configs/X.py --workdir=DIR

Any config key can be overridden: --config.model.num_heads=4 --config.train.steps=3000.
A config file is Python code: run only configs you trust.
"""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/default.py', 'Experiment config file.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory; default runs/<config name>.')
_DEBUG = flags.DEFINE_bool('debug', False, 'Show full tracebacks instead of one-line errors.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  logging.set_verbosity(logging.WARNING)  # our own progress goes to stdout
  from transformer import train  # after absl parsed flags: keeps --help fast

  config = _CONFIG.value
  workdir = _WORKDIR.value or os.path.join('runs', config.name)
  try:
    train.train_and_evaluate(config, workdir)
  except (ValueError, FileNotFoundError, PermissionError) as error:
    if _DEBUG.value:
      raise
    print(f'error: {error}', file=sys.stderr)
    sys.exit(2)


if __name__ == '__main__':
  app.run(main)
