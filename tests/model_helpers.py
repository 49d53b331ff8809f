"""Small helpers that model tests share."""

import jax
import jax.numpy as jnp
import numpy as np

from transformer.model import models


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
