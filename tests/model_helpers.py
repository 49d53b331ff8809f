"""Small helpers that model tests share."""

import importlib
import pkgutil

import jax
import jax.numpy as jnp
import numpy as np

from transformer.config import ModelConfig
from transformer.model import models


def preset_names() -> list[str]:
  """Experiment files in the clone's `configs/` that define a model (all but base and sweeps)."""
  import configs

  skip = {'base', 'sweeps'}
  return sorted(m.name for m in pkgutil.iter_modules(configs.__path__) if m.name not in skip)


def preset(name: str, **overrides) -> ModelConfig:
  """The model of `configs/<name>.py`, with optional field overrides."""
  available = preset_names()
  if name not in available:
    raise ValueError(f'unknown preset {name!r}; available presets: {", ".join(available)}')
  experiment = importlib.import_module(f'configs.{name}').get_config()
  return ModelConfig.from_config(experiment.model).replace(**overrides)


def random_model(cfg, seed: int, scale: float = 0.3):
  """(model, params) of `cfg` with every parameter drawn N(0, scale^2) from `seed`: far from the
  init, so that norms, biases and every option's weights all matter."""
  model = models.build(cfg)
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), **model.dummy_inputs())['params']
  rng = np.random.default_rng(seed)
  params = jax.tree.map(
    lambda x: jnp.asarray(scale * rng.standard_normal(x.shape), x.dtype),
    jax.tree.map(lambda x: x.value if hasattr(x, 'value') else x, shapes),
  )
  return model, params
