"""Tests for transformer/optim.py: schedules against their formulas, the decay mask, clipping."""

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer.config.experiment import OptimConfig
from transformer.training import optim


def _config(steps=110, d_model=64, **overrides):
  """The optimizer of a run of `steps` (train.steps) with a model of width `d_model`."""
  knobs = dict(
    schedule='warmup_cosine',
    learning_rate=2e-3,
    warmup_steps=10,
    end_learning_rate_factor=0.1,
    restart_period=25,
    optimizer='adam',
    b1=0.9,
    b2=0.98,
    eps=1e-9,
    weight_decay=0.0,
    clip_norm=0.0,
  )
  knobs.update(overrides)
  return optim.RunOptim(OptimConfig(**knobs), steps=steps, d_model=d_model)


def _lr(schedule, step):
  return float(schedule(step))


def test_rsqrt_matches_paper_formula():
  lr, d, w = 2.0, 64, 10
  schedule = optim.make_schedule(_config(schedule='rsqrt', learning_rate=lr, warmup_steps=w))
  paper = lambda s: lr * d**-0.5 * min(s**-0.5, s * w**-1.5)
  assert _lr(schedule, 0) == pytest.approx(paper(1), rel=1e-6)  # step 0 is the paper's step 1
  for step in [1, 3, 9, 10, 11, 57, 1000]:
    assert _lr(schedule, step) == pytest.approx(paper(step), rel=1e-6)
  assert _lr(schedule, w) == pytest.approx(lr * d**-0.5 * w**-0.5, rel=1e-6)  # the peak
  steps = jnp.arange(0, 200)
  assert int(jnp.argmax(jax.vmap(schedule)(steps))) == w


def test_warmup_cosine():
  cfg = _config(schedule='warmup_cosine')
  schedule = optim.make_schedule(cfg)
  peak, end = 2e-3, 2e-4
  assert _lr(schedule, 0) == pytest.approx(peak / 10, rel=1e-6)  # the first update learns
  assert _lr(schedule, 4) == pytest.approx(peak * 5 / 10, rel=1e-6)
  assert _lr(schedule, 9) == pytest.approx(peak, rel=1e-6)  # the last warmup update: the peak
  assert _lr(schedule, 10) == pytest.approx(peak, rel=1e-6)
  mid = end + (peak - end) * 0.5 * (1 + math.cos(math.pi * 35 / 100))
  assert _lr(schedule, 45) == pytest.approx(mid, rel=1e-5)
  assert _lr(schedule, 110) == pytest.approx(end, rel=1e-5)
  assert _lr(schedule, 500) == pytest.approx(end, rel=1e-5)


def test_cosine_restarts_returns_to_peak():
  schedule = optim.make_schedule(_config(schedule='cosine_restarts'))
  peak, end, w, period = 2e-3, 2e-4, 10, 25
  assert _lr(schedule, 0) == pytest.approx(peak / w, rel=1e-6)
  assert _lr(schedule, w - 1) == pytest.approx(peak, rel=1e-6)
  assert _lr(schedule, w) == pytest.approx(peak, rel=1e-6)
  for cycle in range(4):
    start = w + cycle * period
    assert _lr(schedule, start) == pytest.approx(peak, rel=1e-6)
    half = end + (peak - end) * 0.5 * (1 + math.cos(math.pi * 10 / period))
    assert _lr(schedule, start + 10) == pytest.approx(half, rel=1e-5)
    last = end + (peak - end) * 0.5 * (1 + math.cos(math.pi * (period - 1) / period))
    assert _lr(schedule, start + period - 1) == pytest.approx(last, rel=1e-5)


def test_constant_with_and_without_warmup():
  with_warmup = optim.make_schedule(_config(schedule='constant', warmup_steps=4))
  want = [5e-4, 1e-3, 2e-3, 2e-3, 2e-3]  # (step + 1) / 4 of the peak, then the peak
  assert [_lr(with_warmup, s) for s in [0, 1, 3, 4, 110]] == pytest.approx(want)
  flat = optim.make_schedule(_config(schedule='constant', warmup_steps=0))
  assert [_lr(flat, s) for s in [0, 1, 1000]] == pytest.approx([2e-3] * 3)


def test_linear_decay():
  schedule = optim.make_schedule(_config(schedule='linear', end_learning_rate_factor=0.0))
  assert _lr(schedule, 0) == pytest.approx(2e-4, rel=1e-6)
  assert _lr(schedule, 10) == pytest.approx(2e-3, rel=1e-6)
  assert _lr(schedule, 35) == pytest.approx(2e-3 * (1 - 25 / 100), rel=1e-6)
  assert _lr(schedule, 110) == pytest.approx(0.0, abs=1e-12)


def test_schedules_jit():
  for name in optim.SCHEDULES:
    schedule = optim.make_schedule(_config(schedule=name))
    assert float(jax.jit(schedule)(jnp.int32(37))) == pytest.approx(_lr(schedule, 37), rel=1e-6)


def _reference(name, peak, warmup, total, end_factor, period, d_model, steps):
  """The documented schedules in float64 NumPy, written from the docstring of make_schedule."""
  s = np.asarray(steps, np.float64)
  if name == 'rsqrt':
    if total is not None and warmup >= total:  # cut: ramp to the configured peak at total - 1
      return peak * (d_model * warmup) ** -0.5 * np.minimum((s + 1) / total, 1.0)
    paper = np.maximum(s, 1.0)  # the paper's step counts from 1
    ramp = paper * warmup**-1.5 if warmup else paper**-0.5
    return peak * d_model**-0.5 * np.minimum(paper**-0.5, ramp)
  warmup = warmup if total is None else min(warmup, total)
  end = peak * end_factor
  if name == 'constant':
    after = np.full_like(s, peak)
  elif name == 'cosine_restarts':
    in_cycle = np.mod(s - warmup, period) / period
    after = end + (peak - end) * (1 + np.cos(np.pi * in_cycle)) / 2
  else:
    done = np.clip((s - warmup) / max(total - warmup, 1), 0.0, 1.0)
    if name == 'warmup_cosine':
      after = end + (peak - end) * (1 + np.cos(np.pi * done)) / 2
    else:
      after = peak + (end - peak) * done
  return np.where(s < warmup, peak * (s + 1) / max(warmup, 1), after)


@pytest.mark.parametrize('name', optim.SCHEDULES)
@pytest.mark.parametrize(
  'warmup,total,end_factor,period',
  [
    (0, 37, 0.0, 7),
    (1, 1, 0.0, 1),
    (1, 2, 0.1, 1),
    (7, 7, 0.0, 3),  # a warmup as long as the run
    (13, 5, 0.1, 4),  # one longer: cut to the run
    (13, 101, 0.0, 9),
    (13, 101, 0.37, 13),
    (300, 1000, 0.0, 333),
    (4000, 5003, 0.0, 997),  # a long warmup: its first updates are tiny and must stay exact
  ],
)
def test_schedules_match_a_float64_formula(name, warmup, total, end_factor, period):
  peak, d_model = (0.7, 48) if name == 'rsqrt' else (3e-3, 48)
  cfg = _config(
    schedule=name,
    learning_rate=peak,
    warmup_steps=warmup,
    steps=total,
    end_learning_rate_factor=end_factor,
    restart_period=period,
    d_model=d_model,
  )
  schedule = optim.make_schedule(cfg)
  steps = np.arange(total + 2 * period + 5)  # past the run and two restarts
  want = _reference(name, peak, warmup, total, end_factor, period, d_model, steps)
  got = np.asarray(jax.jit(jax.vmap(schedule))(jnp.asarray(steps, jnp.int32)), np.float64)
  top = want.max()
  # float32 carries about 1e-7 of the peak: decays to 0 lose their relative digits near the end.
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * top)
  ramp = steps < min(warmup, total)  # the warmup keeps every digit, also at peak / 4000
  np.testing.assert_allclose(got[ramp], want[ramp], rtol=1e-6, atol=0)
  # After the run, warmup_cosine and linear hold end: exactly 0 for a decay to 0, never below.
  held = steps >= (total + 1 if warmup >= total else total)  # a cut warmup: total is at peak
  if name not in ('warmup_cosine', 'linear'):
    held[:] = False
  np.testing.assert_allclose(got[held], peak * end_factor, rtol=1e-6, atol=0)
  # A Python int and a traced int32 scalar, at awkward steps, give float32 values that match.
  awkward = sorted({0, 1, warmup - 1, warmup, warmup + 1, total - 1, total, total + period} - {-1})
  for step in awkward:
    for lr in (schedule(step), jax.jit(schedule)(jnp.int32(step))):
      assert lr.dtype == jnp.float32 and float(lr) >= 0
      if held[step]:
        np.testing.assert_allclose(float(lr), peak * end_factor, rtol=1e-6, atol=0)
      np.testing.assert_allclose(float(lr), want[step], rtol=1e-6, atol=1e-6 * top)
  assert np.all(got >= 0)


@pytest.mark.parametrize('warmup,total', [(1, 1), (1, 50), (7, 3), (100, 1000), (4000, 100)])
@pytest.mark.parametrize('name', optim.SCHEDULES)
def test_the_first_update_learns(name, warmup, total):
  cfg = _config(schedule=name, warmup_steps=warmup, steps=total, restart_period=5)
  schedule = optim.make_schedule(cfg)
  assert float(schedule(0)) > 0 and float(jax.jit(schedule)(jnp.int32(0))) > 0


@pytest.mark.parametrize(
  'overrides,match',
  [
    (dict(schedule='noam'), "'noam'.*'rsqrt'"),
    (dict(warmup_steps=-1), 'warmup_steps=-1'),
    (dict(steps=0), r'total_steps=0 must be >= 1 \(the run length, train.steps\)'),
    (dict(schedule='cosine_restarts', restart_period=0), 'restart_period=0'),
    (dict(end_learning_rate_factor=1.5), 'end_learning_rate_factor=1.5'),
    (dict(learning_rate=-1.0), 'learning_rate=-1.0'),
  ],
)
def test_bad_schedule_config_raises(overrides, match):
  with pytest.raises(ValueError, match=match):
    optim.make_schedule(_config(**overrides))


# A warmup as long as the run, or longer, is cut to the run -----------------------------------
def _warnings(caplog):
  return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize('total', [1, 2, 7, 50])
@pytest.mark.parametrize('name', optim.SCHEDULES)
def test_a_warmup_longer_than_the_run_is_cut_to_it(name, total, caplog):
  cfg = _config(schedule=name, warmup_steps=100, steps=total, restart_period=3)
  with caplog.at_level(logging.WARNING):
    schedule = optim.make_schedule(cfg)
  (warning,) = _warnings(caplog)
  assert f'warmup_steps=100 is longer than the run (total_steps={total}' in warning
  assert f'cut to {total} steps' in warning
  # Reference: a straight ramp from peak / total at update 0 to the configured peak, reached by
  # the run's last update (step total - 1); rsqrt's peak is that of warmup_steps=100.
  steps = np.arange(total, dtype=np.float64)
  top = 2e-3 * (64 * 100) ** -0.5 if name == 'rsqrt' else 2e-3
  want = top * (steps + 1) / total
  got = np.array([_lr(schedule, s) for s in range(total)])
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12)
  assert got[-1] == pytest.approx(want.max(), rel=1e-6) and np.all(np.isfinite(got))
  jitted = jax.jit(schedule)
  assert float(jitted(jnp.int32(total - 1))) == pytest.approx(want[-1], rel=1e-6)


@pytest.mark.parametrize('name', optim.SCHEDULES)
def test_a_warmup_longer_than_the_run_is_cut_and_one_as_long_is_kept(name, caplog):
  with caplog.at_level(logging.WARNING):
    cut = optim.make_schedule(_config(schedule=name, warmup_steps=21, steps=20))
  assert len(_warnings(caplog)) == 1 and 'warmup_steps=21' in _warnings(caplog)[0]
  peak = 2e-3 * (64 * 21) ** -0.5 if name == 'rsqrt' else 2e-3  # rsqrt: the peak of warmup 21
  assert _lr(cut, 19) == pytest.approx(peak, rel=1e-6)  # the peak at the last update
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    kept = optim.make_schedule(_config(schedule=name, warmup_steps=20, steps=20))
    if name not in ('warmup_cosine', 'linear'):  # these two need the run length
      optim.make_schedule(_config(schedule=name, warmup_steps=500, steps=None))
  assert _warnings(caplog) == []
  if name != 'rsqrt':
    assert _lr(kept, 19) == pytest.approx(_lr(cut, 19), rel=1e-6)


def test_make_optimizer_reuses_the_given_schedule(caplog):
  cfg = _config(schedule='warmup_cosine', warmup_steps=100, steps=5)
  with caplog.at_level(logging.WARNING):
    schedule = optim.make_schedule(cfg)
    tx = optim.make_optimizer(cfg, schedule)
  assert len(_warnings(caplog)) == 1  # one warning for the run, not one per builder
  params = {'w': jnp.ones((3,))}
  updates, _ = tx.update({'w': jnp.ones((3,))}, tx.init(params), params)
  # Update 0 of the warmup (cut to the 5-step run) already learns: lr = 1e-3 * 1 / 5, and Adam's
  # first step moves every weight by about lr against the gradient.
  np.testing.assert_allclose(np.asarray(updates['w']), -cfg.optim.learning_rate / 5, rtol=1e-4)


def _params():
  return {
    'encoder': {
      'layer_0': {
        'attention': {'kernel': jnp.ones((4, 2, 3)), 'bias': jnp.ones((2, 3))},
        'norm': {'scale': jnp.ones((4,)), 'bias': jnp.ones((4,))},
      },
      'embedding': jnp.ones((7, 4)),
    },
    'head': {'kernel': jnp.ones((4, 5)), 'bias': jnp.ones((5,))},
    'temperature': jnp.ones(()),
  }


def test_decay_mask():
  mask = optim.decay_mask(_params())
  assert mask == {
    'encoder': {
      'layer_0': {
        'attention': {'kernel': True, 'bias': False},  # a 2-D bias is still a bias
        'norm': {'scale': False, 'bias': False},
      },
      'embedding': True,
    },
    'head': {'kernel': True, 'bias': False},
    'temperature': False,
  }
  abstract = jax.eval_shape(lambda: _params())
  assert optim.decay_mask(abstract) == mask


def test_adamw_decays_only_matrices():
  cfg = _config(
    optimizer='adamw', schedule='constant', warmup_steps=0, learning_rate=0.1, weight_decay=0.5
  )
  tx = optim.make_optimizer(cfg)
  params = _params()
  updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  new = optax.apply_updates(params, updates)
  mask = optim.decay_mask(params)
  for decayed, value in zip(jax.tree.leaves(mask), jax.tree.leaves(new)):
    expected = 1 - 0.1 * 0.5 if decayed else 1.0  # p - lr * wd * p with zero gradients
    np.testing.assert_allclose(np.asarray(value), expected, rtol=1e-6)


def test_clipping_caps_global_norm():
  grads = {'a': jnp.array([30.0, -40.0]), 'b': jnp.array([[0.0, 0.0]])}  # global norm 50
  params = jax.tree.map(jnp.zeros_like, grads)
  common = dict(schedule='constant', warmup_steps=0, learning_rate=1.0, eps=1.0)

  def first_update(g, clip_norm):
    tx = optim.make_optimizer(_config(clip_norm=clip_norm, **common))
    return tx.update(g, tx.init(params), params)[0]

  scaled = jax.tree.map(lambda g: g / 50.0, grads)  # the same direction with norm 1
  clipped = first_update(grads, 1.0)
  unclipped = first_update(grads, 0.0)
  reference = first_update(scaled, 0.0)
  for c, r in zip(jax.tree.leaves(clipped), jax.tree.leaves(reference)):
    np.testing.assert_allclose(np.asarray(c), np.asarray(r), rtol=1e-5)
  # with eps=1 Adam is not scale invariant, so the test would notice if clipping did nothing
  assert not np.allclose(np.asarray(unclipped['a']), np.asarray(reference['a']), rtol=1e-2)
  below = first_update(scaled, 10.0)  # under the cap nothing changes
  for b, r in zip(jax.tree.leaves(below), jax.tree.leaves(reference)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(r), rtol=1e-6)


@pytest.mark.parametrize(
  'overrides,match',
  [
    (dict(optimizer='sgd'), "'sgd'.*'adamw'"),
    (dict(optimizer='adam', weight_decay=0.1), "weight_decay=0.1 needs optimizer='adamw'"),
    (dict(optimizer='adamw', weight_decay=-0.1), 'weight_decay=-0.1'),
    (dict(clip_norm=-1.0), 'clip_norm=-1.0'),
  ],
)
def test_bad_optimizer_config_raises(overrides, match):
  with pytest.raises(ValueError, match=match):
    optim.make_optimizer(_config(**overrides))
