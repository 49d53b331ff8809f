"""Train (or resume) one experiment: python -m experiments.train --config=configs/X.py --workdir=DIR

Any config key can be overridden: --config.model.num_heads=4 --config.train.steps=3000.
Rerunning the same command on the same workdir resumes from the latest checkpoint.
A config file is Python code: run only configs you trust.
"""

import os

from absl import flags

from experiments import cli

_CONFIG = cli.define_config()
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory; default runs/<config name>.')


def main():
  from transformer import train  # imported after flag parsing: keeps --help fast

  config = _CONFIG.value
  train.train_and_evaluate(config, _WORKDIR.value or os.path.join('runs', config.name))


if __name__ == '__main__':
  cli.run(main)
