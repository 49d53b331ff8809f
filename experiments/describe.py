"""Prints a model's architecture, its exact parameter count and its training FLOPs per token.

python -m experiments.describe --config=configs/gpt2_small.py [--seq_len=1024]
"""

from absl import flags

from experiments import cli

_CONFIG = cli.define_config()
_SEQ_LEN = flags.DEFINE_integer('seq_len', None, 'Sequence length for FLOPs; default max_length.')


def main():
  from transformer import config as config_lib
  from transformer.model import describe

  cfg = config_lib.ModelConfig.from_config(_CONFIG.value.model)
  print(describe.describe(cfg, seq_len=_SEQ_LEN.value))


if __name__ == '__main__':
  cli.run(main)
