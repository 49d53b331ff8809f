"""Tests of research.long_context: the step cost that the long_context sweep fits."""

import pytest

from configs import gpt_tiny
from research import long_context


def _config(**model):
  config = gpt_tiny.get_config()
  config.model.update(position='rope', vocab_size=300, d_model=32, d_ff=64, num_layers=1, **model)
  return config


@pytest.mark.parametrize(
  'model, low, high',
  [
    # [T, T] logits: 16x at 4x the length (measured 18.7x: 3.5 -> 65.6 MiB, 4.5 -> 65.6 before the
    # heads-in-batch path kept fewer buffers at T=256); linear would be ~4x
    (dict(attention_impl='xla'), 8.0, 24.0),
    # a [H, H] state per block: ~4x (slow, ~10 s: test_linear_attention checks the same growth)
    pytest.param(dict(attention='linear'), 2.0, 6.0, marks=pytest.mark.slow),
  ],
)
def test_step_memory_of_full_attention_is_quadratic_and_of_linear_attention_linear(
  model, low, high
):
  short, long = (long_context.step_cost(_config(**model), T, steps=1) for T in (256, 1024))
  assert short['ms'] > 0 and long['ms'] > 0
  assert low < long['mib'] / short['mib'] < high, (short, long)
