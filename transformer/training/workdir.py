"""A run directory: the one `load_run` (config.json + the latest good checkpoint), on any mesh."""

from __future__ import annotations

import os

import jax
import ml_collections

from transformer import sharding
from transformer.config import ModelConfig
from transformer.training import checkpoint
from transformer.training.run import Run
from transformer.training.state import TrainState

Array = jax.Array


def fit_mesh(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A saved run's config whose mesh fits this machine: its own, else all devices data parallel.

  Checkpoints restore onto any layout, so a run trained on (2, 2, 2) loads on 1 device.
  """
  if 'mesh' in config:
    try:
      sharding.mesh_shape(tuple(config.mesh.shape), jax.device_count())
    except ValueError:
      config.mesh.shape = type(config.mesh.shape)((-1, 1, 1))
  return config


def load_run(
  workdir: str,
  step: int | None = None,
  *,
  config: ml_collections.ConfigDict | None = None,
  with_data: bool = True,
) -> tuple[Run, TrainState, int]:
  """Rebuilds the Run of `workdir` and restores a checkpoint (the latest good one by default).

  Args:
    config: the config to rebuild with (e.g. a sweep's eval variant); default the workdir's own
      config.json. Either way the vocabulary size is the saved one, and the mesh fits this machine.
    with_data: False skips the data task (a notebook that only decodes needs no data).

  Raises:
    FileNotFoundError: no such workdir, or no config.json in it.
    CheckpointError: no checkpoint, or none that is intact.
  """
  if not os.path.isdir(workdir):
    raise FileNotFoundError(f'no workdir {workdir!r}: give the --workdir of a training run')
  saved = checkpoint.read_run_config(workdir)
  if saved is None:
    raise FileNotFoundError(
      f'no config.json in {workdir!r}; is it a sparrow workdir (python -m experiments.train '
      'or experiments.convert_hf writes one)?'
    )
  if config is None:
    data_cfg = saved.get('data')
    if isinstance(data_cfg, dict) and 'text_format' not in data_cfg:
      data_cfg['text_format'] = 'lines'  # saved before data.text_format: a document a line
    try:
      config = ml_collections.ConfigDict(saved)
      ModelConfig.from_config(config.model)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
      path = os.path.join(workdir, 'config.json')
      raise ValueError(f'{path} holds a config that cannot build a model: {e}') from e
  else:
    config = ml_collections.ConfigDict(config.to_dict())
    config.model.vocab_size = saved['model']['vocab_size']
  run = Run(fit_mesh(config), workdir if with_data else None, with_data=with_data)
  ckpt = checkpoint.Checkpointer(workdir, keep=run.experiment.train.keep_checkpoints)
  try:
    state, _, step = ckpt.restore(run.abstract_state, step)
  finally:
    ckpt.close()
  return run, state, step
