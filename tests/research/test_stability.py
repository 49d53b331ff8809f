"""The output-init measures (research/stability): loss spikes on hand-built curves, and the
residual stream's growth at init checked against what the parameters force."""

import jax
import numpy as np
import pytest

from research import stability
from transformer.config import ModelConfig
from transformer.model import models


def test_spikes_count_rises_above_the_running_median():
  curve = [5.0, 4.0, 3.0, 3.0, 3.0, 3.0, 3.5, 3.0, 3.0, 3.0]
  out = stability.spikes(curve, window=5, rise=0.1)
  assert out['train.spikes'] == 1 and out['train.max_jump'] == pytest.approx(0.5 / 3.0)
  assert stability.spikes(curve, window=5, rise=0.2)['train.spikes'] == 0
  assert stability.spikes(curve, window=5, rise=0.1, skip=7)['train.spikes'] == 0
  diverged = stability.spikes([*curve, float('nan')], window=5, rise=0.1)
  assert diverged['train.spikes'] == 2 and diverged['train.max_jump'] == float('inf')


def _model(init: str, layers: int = 3):
  cfg = ModelConfig(family='causal_lm', vocab_size=50, d_model=16, num_heads=2, d_ff=32,
                    num_layers=layers, max_length=16, norm_placement='pre', dropout_rate=0.0,
                    position='learned', init=init)  # fmt: skip
  return cfg, models.init_params(models.build(cfg), jax.random.PRNGKey(7))


def _scale_outputs(params, factor, layers=None, which=('out', 'wo')):
  """Multiplies the attention output (out) and FFN second-layer (wo) kernels of `layers`."""

  def scale(path, x):
    keys = [str(getattr(p, 'key', p)) for p in path]
    layer = next((k for k in keys if k.startswith('layer_')), None)
    hit = keys[-1] == 'kernel' and keys[-2] in which
    return x * factor if hit and (layers is None or layer in layers) else x

  return jax.tree_util.tree_map_with_path(scale, params)


def test_residual_growth_follows_the_output_projections():
  cfg, params = _model('plain')
  ids = np.random.default_rng(0).integers(1, 50, (3, 11)).astype(np.int32)
  real = np.ones(ids.shape, bool)
  base = stability.residual_growth(cfg, params, {'inputs': ids}, real)
  assert base['rms'].shape == (4,) and base['branch'].shape == (3,)
  # No output projections: every block adds nothing, so the stream leaves as it came in.
  zero = stability.residual_growth(cfg, _scale_outputs(params, 0.0), {'inputs': ids}, real)
  np.testing.assert_allclose(zero['branch'], 0.0, atol=1e-7)
  assert zero['init.growth'] == pytest.approx(1.0) and zero['init.branch_ratio'] < 1e-6
  # With its attention silenced, the first block adds its FFN's output, linear in the FFN's second
  # layer (zero biases at init): three times the kernel, three times the branch.
  silent = _scale_outputs(params, 0.0, layers={'layer_0'}, which=('out',))
  once = stability.residual_growth(cfg, silent, {'inputs': ids}, real)
  tripled = _scale_outputs(silent, 3.0, layers={'layer_0'}, which=('wo',))
  thrice = stability.residual_growth(cfg, tripled, {'inputs': ids}, real)
  assert thrice['branch'][0] == pytest.approx(3.0 * once['branch'][0], rel=1e-5)
  assert thrice['rms'][0] == pytest.approx(base['rms'][0], rel=1e-6)


def test_padding_is_left_out_and_the_inits_order_the_growth():
  cfg, params = _model('plain')
  rng = np.random.default_rng(1)
  ids = rng.integers(1, 50, (2, 12)).astype(np.int32)
  real = np.zeros(ids.shape, bool)
  real[:, :7] = True
  other = ids.copy()
  other[:, 7:] = rng.integers(1, 50, (2, 5))  # a causal model's first 7 tokens cannot see these
  a = stability.residual_growth(cfg, params, {'inputs': ids}, real)
  b = stability.residual_growth(cfg, params, {'inputs': other}, real)
  np.testing.assert_allclose(a['rms'], b['rms'], rtol=1e-5)
  full = stability.residual_growth(cfg, params, {'inputs': other}, np.ones(ids.shape, bool))
  assert not np.allclose(full['rms'], b['rms'], rtol=1e-5)
  # The same seed under the three inits: the scaled one moves the stream least, large most.
  growth = {}
  for init in ('scaled', 'plain', 'large'):
    cfg, params = _model(init, layers=4)
    growth[init] = stability.residual_growth(cfg, params, {'inputs': ids}, real)
  ratios = [growth[i]['init.branch_ratio'] for i in ('scaled', 'plain', 'large')]
  assert ratios[0] < ratios[1] < ratios[2]
