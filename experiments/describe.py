"""Prints a model's architecture, its exact parameter count and its training FLOPs per token; for a
workdir, also every revision of the code that trained it, with its steps.

python -m experiments.describe --config=configs/gpt2_small.py [--seq_len=1024]
python -m experiments.describe --workdir=runs/gpt_tiny
"""

from absl import flags

from experiments import cli

_CONFIG = cli.define_config()
_SEQ_LEN = flags.DEFINE_integer('seq_len', None, 'Sequence length for FLOPs; default max_length.')
_WORKDIR = flags.DEFINE_string(
  'workdir', None, 'A training workdir: its saved model, and the revisions that trained it.'
)


def main():
  import ml_collections

  from transformer import config as config_lib
  from transformer.model import describe
  from transformer.training import checkpoint, provenance

  model = _CONFIG.value.model
  if _WORKDIR.value:
    saved = checkpoint.read_run_config(_WORKDIR.value)
    if saved is None:
      raise FileNotFoundError(f'no config.json in {_WORKDIR.value!r}: give a training workdir')
    model = ml_collections.ConfigDict(saved['model'])
  print(describe.describe(config_lib.ModelConfig.from_config(model), seq_len=_SEQ_LEN.value))
  if _WORKDIR.value:
    print(provenance.describe_history(_WORKDIR.value))


if __name__ == '__main__':
  cli.run(main)
