"""Timing helpers (bench/timing.py): the random batch a step is timed on."""

import pytest

from bench import timing
from transformer.config import ModelConfig


@pytest.mark.parametrize('family', ['encoder_decoder', 'causal_lm', 'bidirectional_lm'])
def test_synthetic_batch_has_the_family_inputs(family):
  cfg = ModelConfig(family=family, vocab_size=50, d_model=16, num_heads=2, d_ff=32, num_layers=1)
  batch = timing.synthetic_batch(cfg, 4, 12)
  assert {'targets', 'weights', 'inputs'} <= set(batch)
  assert all(v.shape == (4, 12) for v in batch.values())
  assert batch['inputs'].min() >= 5 and batch['inputs'].max() < 50
