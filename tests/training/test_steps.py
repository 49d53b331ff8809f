"""train_step with the fused head + loss equals the logits path; train.fused_loss resolution."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from transformer.model import models
from transformer.training.run import Run, loss_chunk_size
from transformer.training.steps import train_step


def _step(run, chunk):
  return jax.jit(
    functools.partial(
      train_step,
      model=run.model,
      family=run.family,
      tx=run.tx,
      schedule=run.schedule,
      label_smoothing=0.1,
      loss_chunk_size=chunk,
    )
  )


@pytest.mark.parametrize('family', ['encoder_decoder', 'causal_lm', 'bidirectional_lm'])
def test_fused_loss_step_equals_logits_step(family, tmp_path, tiny_config):
  config = tiny_config(family)
  config.model.dropout_rate = 0.0
  config.optim.warmup_steps, config.optim.learning_rate = 1, 1.0  # a large first step
  config.optim.eps = 1.0  # updates proportional to the gradient (see test_loop)
  run = Run(config, str(tmp_path))
  batch = next(run.task.train_iterator())
  rng = jax.random.PRNGKey(0)
  state = run.init_state()
  vocab = run.model_cfg.vocab_size
  assert vocab % 64  # the byte vocabulary leaves a short last chunk
  want, want_metrics = _step(run, None)(state, batch, rng)
  got, got_metrics = _step(run, 64)(run.init_state(), batch, rng)
  for name in ('loss', 'nll', 'denominator', 'grad_norm'):
    np.testing.assert_allclose(got_metrics[name], want_metrics[name], rtol=1e-5)
  moved = jax.tree_util.tree_map(lambda a, b: np.abs(a - b).max(), want.params, state.params)
  assert max(jax.tree_util.tree_leaves(moved)) > 1e-4  # the step did change the parameters
  jax.tree_util.tree_map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got.params, want.params
  )


class _Device:
  def __init__(self, platform):
    self.platform = platform


def test_fused_loss_resolution(tiny_config):
  config = tiny_config('causal_lm')
  run = Run(config, None, with_data=False)
  cfg, t = run.model_cfg, run.experiment.train
  assert loss_chunk_size(t, cfg, _Device('cpu')) == t.loss_chunk_size  # auto: on for CPU
  assert loss_chunk_size(t, cfg, _Device('gpu')) is None  # auto: GPU keeps the logits path
  t = dataclasses.replace(t, fused_loss='on')
  assert loss_chunk_size(t, cfg, _Device('gpu')) == t.loss_chunk_size
  t = dataclasses.replace(t, fused_loss='off')
  assert loss_chunk_size(t, cfg, _Device('cpu')) is None
  untied = cfg.replace(tie_output=False)
  assert not models.has_fused_head(untied)
  t = dataclasses.replace(t, fused_loss='auto')
  assert loss_chunk_size(t, untied, _Device('cpu')) is None  # untied heads keep logits
  t = dataclasses.replace(t, fused_loss='on')
  with pytest.raises(ValueError, match='fused_loss=on needs a tied token head'):
    loss_chunk_size(t, untied, _Device('cpu'))
  # The knobs themselves are checked when the train section is typed, before any run.
  with pytest.raises(ValueError, match="fused_loss='sometimes' is not one of"):
    loss_chunk_size(dataclasses.replace(t, fused_loss='sometimes'), cfg, _Device('cpu'))
  with pytest.raises(ValueError, match='loss_chunk_size=0 must be a positive integer'):
    loss_chunk_size(
      dataclasses.replace(t, fused_loss='auto', loss_chunk_size=0), cfg, _Device('cpu')
    )


def test_the_initialisation_program_does_not_depend_on_the_seed(tiny_config):
  # The seed is an argument of the compiled init: another seed hits JAX's compile cache.
  runs = []
  for seed in (0, 7):
    config = tiny_config('causal_lm')
    config.seed = seed
    runs.append(Run(config, None, with_data=False))
  text = [r._init_state.lower(r._seed).as_text() for r in runs]
  assert text[0] == text[1]
  a, b = (jax.tree_util.tree_leaves(r.init_state().params) for r in runs)
  assert not np.array_equal(a[0], b[0])  # yet the seeds give different parameters
  config = tiny_config('causal_lm')
  config.seed = 2**32
  with pytest.raises(ValueError, match=r'seed=4294967296 must be an integer in \[0, 2\*\*32\)'):
    Run(config, None, with_data=False)


def test_the_cond_and_the_select_update_alike(monkeypatch, tmp_path, tiny_config):
  # CPU updates under a cond, other backends select between new and old state: both keep the
  # state through a non-finite step and take the same finite one.
  from transformer.training import steps

  config = tiny_config('causal_lm')
  run = Run(config, str(tmp_path))
  batch = next(run.task.train_iterator())
  rng = jax.random.PRNGKey(0)
  results = {}
  for cond in (True, False):
    monkeypatch.setattr(steps, 'update_under_cond', lambda cond=cond: cond)
    step = _step(run, None)
    good, metrics = step(run.init_state(), batch, rng)
    state = run.init_state()
    poisoned = jax.tree_util.tree_map(lambda x: x.at[(0,) * x.ndim].set(np.nan), state.params)
    bad = state.replace(params=poisoned)
    kept = jax.tree_util.tree_map(np.asarray, (bad.params, bad.opt_state))
    after, bad_metrics = step(bad, batch, rng)
    assert float(bad_metrics['skipped']) == 1.0 and int(after.step) == 1
    jax.tree_util.tree_map(np.testing.assert_array_equal, (after.params, after.opt_state), kept)
    assert float(metrics['skipped']) == 0.0
    results[cond] = good.params
  jax.tree_util.tree_map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), *results.values()
  )
  moved = jax.tree_util.tree_map(
    lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(), results[True], run.init_state().params
  )
  assert max(jax.tree_util.tree_leaves(moved)) > 1e-5  # the finite step did update
