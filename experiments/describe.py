"""Prints a model's architecture, its exact parameter count and its training FLOPs per token.

python -m experiments.describe --config=configs/gpt2_small.py [--seq_len=1024]
"""

from absl import app, flags
from ml_collections import config_flags

from transformer import config as config_lib
from transformer import inspect as inspect_lib

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/default.py', 'Experiment config file.')
_SEQ_LEN = flags.DEFINE_integer('seq_len', None, 'Sequence length for FLOPs; default max_length.')


def main(argv):
  del argv
  cfg = config_lib.ModelConfig.from_config(_CONFIG.value.model)
  print(inspect_lib.describe(cfg, seq_len=_SEQ_LEN.value))


if __name__ == '__main__':
  app.run(main)
