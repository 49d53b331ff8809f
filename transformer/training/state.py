"""The training state and what builds it: `TrainState`, `create_state`, a run's model config."""

from __future__ import annotations

from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from transformer.config import ModelConfig
from transformer.config.experiment import Config, OptimConfig, TrainConfig, section
from transformer.model import models
from transformer.training.optim import RunOptim

Array = jax.Array


@flax.struct.dataclass
class TrainState:
  """Everything a step changes. `loss_scale`/`good_steps` drive float16 dynamic loss scaling."""

  step: Array  # int32 []
  params: Any
  opt_state: Any
  loss_scale: Array  # float32 []; 1 unless float16
  good_steps: Array  # int32 []: finite steps since the scale last changed


@flax.struct.dataclass
class BatchNormTrainState(TrainState):
  """A TrainState plus the running statistics of a model.norm='batchnorm' model (flax's
  'batch_stats' collection): the train step updates them, evaluation, decoding and inference
  normalise by them, and checkpoints save them with the rest. Every other model keeps the plain
  TrainState, so its checkpoints are unchanged."""

  batch_stats: Any  # {module path: {'mean': [D], 'var': [D]}}, float32


def weights(state: TrainState) -> Any:
  """What evaluation, decoding and inference apply the model with: `state.params`, or for a
  batchnorm model the variables {'params': ..., 'batch_stats': ...} (see `models.variables`).

  Also maps a tree of state shardings to the shardings of those weights.
  """
  stats = getattr(state, 'batch_stats', None)
  return state.params if stats is None else {'params': state.params, 'batch_stats': stats}


def model_inputs(family: str, batch: dict[str, Array]) -> dict[str, Array]:
  """The model's keyword arguments for a data batch of `family` (see transformer.data)."""
  if family == 'encoder_decoder':
    keys = ['inputs', 'decoder_inputs', 'inputs_segments', 'targets_segments']
    keys += ['inputs_positions', 'targets_positions']
  elif family == 'causal_lm':
    keys = ['inputs', 'segments', 'positions']
  else:
    keys = ['inputs', 'token_types', 'segments', 'positions']
  return {k: batch[k] for k in keys}


def optim_config(config: Config | ml_collections.ConfigDict, model_cfg: ModelConfig) -> RunOptim:
  """The optimizer knobs of `config` (typed and checked) plus the run length and model width that
  schedules need."""
  optim, train = config.optim, config.train
  if not isinstance(config, Config):
    optim, train = section(OptimConfig, optim), section(TrainConfig, train)
  return RunOptim(optim, steps=train.steps, d_model=model_cfg.d_model)


def create_state(
  model, model_cfg, tx, seed, loss_scale: float, *, boxed: bool = False
) -> TrainState:
  """A fresh TrainState from `seed` (an int, or a traced uint32); `boxed` keeps the parameters'
  logical axis names (for shardings)."""
  variables = models.init_variables(model, jax.random.PRNGKey(seed), boxed=True)
  # The moments inherit the parameters' logical axes, the running statistics have their own.
  scale = loss_scale if model_cfg.dtype == 'float16' else 1.0
  state = state_from_params(variables['params'], tx, scale, variables.get('batch_stats'))
  return state if boxed else nn.meta.unbox(state)


def state_from_params(
  params: Any, tx: Any, loss_scale: float = 1.0, batch_stats: Any = None
) -> TrainState:
  """Step 0 at `params` (trained elsewhere, or fresh), with fresh optimizer moments; a
  BatchNormTrainState when `batch_stats` (a batchnorm model's running statistics) are given."""
  fields = dict(
    step=jnp.zeros((), jnp.int32),
    params=params,
    opt_state=tx.init(params),
    loss_scale=jnp.asarray(loss_scale, jnp.float32),
    good_steps=jnp.zeros((), jnp.int32),
  )
  if batch_stats is None:
    return TrainState(**fields)
  return BatchNormTrainState(**fields, batch_stats=batch_stats)
