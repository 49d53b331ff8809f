"""Every knob of a sparrow experiment, with its default: the library's config dataclasses.

Each knob is written once, with a one-line comment, in `transformer/config/`: the model's in
`ModelConfig` (`__init__.py`), the rest in `experiment.py` (`DataConfig`, `TrainConfig`,
`OptimConfig`, `MeshConfig`). An experiment file starts from `get_config()` and overrides what it
changes; it never copies this file. Command-line flags override further:
`--config.model.num_heads=4`.
"""

import ml_collections

from transformer.config import experiment


def get_config() -> ml_collections.ConfigDict:
  return experiment.default_configdict()
