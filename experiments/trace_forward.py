"""Counts the library lines a reader follows through one forward pass of a preset.

python -m experiments.trace_forward --config=configs/gpt_tiny.py

The config is turned into a `ModelConfig` (its checks are not traced), then the model is built
and applied once to a batch of 2 x 16 tokens under a line tracer (bench/reading.py) that counts
each library line run and the `def` line of each function entered; the parameters come from an
untraced `init`. Prints the distinct lines per library file and the total (docs/architecture.md).
"""

import os

from experiments import cli

_CONFIG = cli.define_config()


def main():
  import jax
  import jax.numpy as jnp

  import transformer
  from bench import reading

  config = _CONFIG.value
  tokens = jnp.ones((2, 16), jnp.int32)
  args = (tokens, tokens) if config.model.family == 'encoder_decoder' else (tokens,)
  cfg = transformer.ModelConfig.from_config(config.model)
  variables = transformer.build(cfg).init(jax.random.key(0), *args)

  def forward():
    return transformer.build(cfg).apply(variables, *args)

  root = os.path.dirname(transformer.__file__)
  rows = reading.summary(reading.lines_run(forward, root), root)
  for path, count in rows:
    print(f'{count:5d}  {path}')
  print(f'{sum(c for _, c in rows):5d}  lines in {len(rows)} files')


if __name__ == '__main__':
  cli.run(main)
