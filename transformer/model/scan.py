"""The scanned layer loop and the parameter layout it makes: `scan` runs one block over stacked
[L, ...] parameters (compile time independent of depth, `scan_layers=True`), and `unscan_params`
gives those parameters the unscanned layout layer_0, layer_1, ... that the analyses read."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax

from transformer.config import ModelConfig

Array = jax.Array


def scan(block: Callable, num_layers: int, x: Array, *args) -> Array:
  """One block `layers` with stacked [L, ...] parameters, looped by nn.scan: compile time
  independent of depth."""
  if not num_layers:  # nn.scan needs a length
    return x
  scanned = nn.scan(
    block.func,
    # Each layer its own params, KV cache and (norm='batchnorm') running statistics.
    variable_axes={'params': 0, 'cache': 0, 'batch_stats': 0},
    split_rngs={'params': True, 'dropout': True},  # each layer its own init and dropout
    in_axes=(nn.broadcast,) * len(args),  # masks, positions, ...: the same for every layer
    length=num_layers,
    metadata_params={nn.PARTITION_NAME: 'layers'},  # stacked params: [layers, ...]
  )
  x, _ = scanned(*block.args, **block.keywords, scanned=True, name='layers')(x, *args)  # carry x
  return x  # [B, T, D]


def unscan_params(cfg: ModelConfig, params: Any) -> Any:
  """Parameters of a `scan_layers` model ([layers, ...] under 'layers') as layer_0, layer_1, ...

  A variables dict (`models.variables`: params and a batchnorm model's running statistics) has
  each of its collections converted.
  """
  if not cfg.scan_layers:
    return params

  def convert(tree):
    if not isinstance(tree, dict):
      return tree
    out = {}
    for key, value in tree.items():
      if key == 'layers' and isinstance(value, dict):
        count = jax.tree_util.tree_leaves(value)[0].shape[0]  # L, the stacked leading axis
        for i in range(count):
          # [L, ...] -> layer i's [...]; the names match Stack's unscanned f'layer_{i}'.
          out[f'layer_{i}'] = jax.tree_util.tree_map(lambda x, i=i: x[i], value)
      else:
        out[key] = convert(value)
    return out

  if isinstance(params, Mapping) and 'params' in params:  # a variables dict
    return {collection: convert(dict(tree)) for collection, tree in params.items()}
  return convert(dict(params))
