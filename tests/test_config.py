"""ModelConfig's one source of facts: its defaults are configs/base.py's model, and its lists of
choices are the keys of the registries that implement them."""

import dataclasses

from configs import base
from transformer import config
from transformer.model import attention, layers


def test_model_defaults_are_the_base_config():
  model = base.get_config().model
  fields = {f.name: f.default for f in dataclasses.fields(config.ModelConfig)}
  assert sorted(model.keys()) == sorted(fields)  # every field once in base.py, nothing else
  different = {k: (v, model[k]) for k, v in fields.items() if model[k] != v}
  assert different == {}, 'ModelConfig default != configs/base.py (field: (default, base))'


def test_choice_lists_are_the_registries():
  # swiglu is a gated pair of projections, not an elementwise function, so FeedForward builds it.
  assert sorted(config.ACTIVATIONS) == sorted([*layers.ACTIVATIONS, 'swiglu'])
  assert sorted(config.REMAT_POLICIES) == sorted(['none', *layers.REMAT_POLICIES])
  assert sorted(config.ATTENTION_IMPLEMENTATIONS[1:]) == sorted(attention.registered())
