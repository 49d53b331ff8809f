"""Learning-rate schedules and the optax optimizer, both built from the experiment config.

The train step (steps.py) reports the learning rate of each update as `schedule(state.step)`,
from the same schedule the optimizer uses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from absl import logging

from transformer.config.experiment import OPTIMIZERS, SCHEDULES, Config, OptimConfig  # noqa: F401

NO_DECAY_NAMES = ('bias', 'scale')  # flax biases and LayerNorm/RMSNorm scales


@dataclasses.dataclass(frozen=True)
class RunOptim:
  """The optimizer of one run: `config.optim` (checked by OptimConfig) with what its schedule
  needs from the rest of the experiment."""

  optim: OptimConfig
  steps: int | None = None  # train.steps, the run length; None = a schedule without one
  d_model: int | None = None  # model.d_model, which scales 'rsqrt'


def _warmup(peak: float, warmup_steps: int, after: optax.Schedule) -> optax.Schedule:
  """A linear warmup from peak / warmup_steps at update 0 (never 0: the first update learns) to
  peak at update warmup_steps - 1, then `after`, counted from 0 at update warmup_steps."""
  if warmup_steps == 0:
    return after
  # peak / warmup_steps, multiplied by warmup_steps at update warmup_steps - 1. optax computes it
  # as start + (end - start) * fraction, so the small first values keep their float32 digits;
  # linear_schedule's (start - end) * (1 - fraction) + end cancels (2e-4 relative error at
  # update 0 of a 4000-step warmup).
  ramp = optax.piecewise_interpolate_schedule(
    'linear', peak / warmup_steps, {warmup_steps - 1: warmup_steps}
  )
  return optax.join_schedules([ramp, after], [warmup_steps])


def _decay(shape: str, peak: float, end_factor: float, steps: int) -> optax.Schedule:
  """A 'cosine' (half a cosine) or 'linear' decay from peak at 0 to peak * end_factor at
  `steps`, held there after."""
  # Held exactly: jitted on CPU, linear_schedule(peak, 0, steps) stays at -1e-10 after `steps`
  # (XLA computes its 1 - step / steps as fma(-step, 1 / steps, 1)).
  return optax.piecewise_interpolate_schedule(shape, peak, {steps: end_factor})


def _float32(schedule: optax.Schedule) -> optax.Schedule:
  """The schedule as a float32 array, for a Python int step as for a traced one."""
  return lambda step: jnp.asarray(schedule(step), jnp.float32)


def fit_warmup(warmup_steps: int, steps: int | None) -> int:
  """The warmup cut to the run, with one warning line naming both numbers when it is cut.

  The updates of a run are steps 0 .. steps - 1, and a warmup peaks at update
  warmup_steps - 1, so a warmup longer than the run is cut to steps: the learning rate
  ramps up over the whole run and its last update is at the peak (a 1-step run: the peak at
  once). `steps=None` (a schedule with no run length) cuts nothing.
  """
  if steps is None or warmup_steps <= steps:
    return warmup_steps
  logging.warning(
    'warmup_steps=%d is longer than the run (total_steps=%d, train.steps): the warmup is cut to '
    '%d steps, so the learning rate ramps up over the whole run and peaks at its last step',
    warmup_steps,
    steps,
    steps,
  )
  return steps


def make_schedule(cfg: RunOptim) -> optax.Schedule:
  """Learning rate as a function of the optimizer step (0 for the first update).

  Schedules (peak = optim.learning_rate, end = peak * optim.end_learning_rate_factor, where
  optim = cfg.optim and the run length steps = cfg.steps, train.steps):
    'rsqrt':           the paper's lr * d_model^-0.5 * min(s^-0.5, s * warmup^-1.5), with the
                       paper's step s = max(step, 1), so step 0 and step 1 both use s = 1 and the
                       peak lr * (d_model * warmup)^-0.5 is at step == warmup_steps.
    The other schedules warm up linearly from peak / warmup_steps at update 0 (never 0: the
    first update learns) to the peak at update warmup_steps - 1.
    'warmup_cosine':   linear warmup, then a cosine from peak to end at step == steps.
    'cosine_restarts': linear warmup, then cosine cycles of restart_period steps from peak to end,
                       each cycle restarting at peak (SGDR).
    'constant':        peak, after a linear warmup when warmup_steps > 0.
    'linear':          linear warmup, then a straight line from peak to end at steps.
  After steps, 'warmup_cosine' and 'linear' stay at end. A warmup as long as the run or longer is
  cut to it (`fit_warmup`); 'rsqrt' then still peaks at lr * (d_model * warmup_steps)^-0.5, at the
  last step. 'cosine_restarts' runs one cosine on the step modulo restart_period
  (`optax.sgdr_schedule` wants a finite list of cycles). Any step, a Python int or a traced
  array, gives a float32 array.
  """
  optim = cfg.optim  # its knobs were checked by OptimConfig
  steps = cfg.steps
  if steps is not None and int(steps) < 1:
    raise ValueError(f'total_steps={steps} must be >= 1 (the run length, train.steps)')
  warmup = fit_warmup(int(optim.warmup_steps), None if steps is None else int(steps))
  return SCHEDULE_BUILDERS[optim.schedule](cfg, warmup)


# Each schedule: build(cfg, warmup) -> optax schedule, with the warmup already cut to the run.
# A new schedule is one function and one line in SCHEDULE_BUILDERS (and its name in
# config.experiment.SCHEDULES, which a test keeps equal to these keys).
def _rsqrt(cfg: RunOptim, warmup: int) -> optax.Schedule:
  peak, configured, steps = float(cfg.optim.learning_rate), int(cfg.optim.warmup_steps), cfg.steps
  d_model = int(cfg.d_model)
  if d_model <= 0:
    raise ValueError(f'd_model={d_model} must be > 0 for the rsqrt schedule')
  if steps is not None and configured >= steps:  # cut: the configured peak at the last step
    top = peak * (d_model * configured) ** -0.5
    return _float32(_warmup(top, int(steps), optax.constant_schedule(top)))

  def rsqrt(step):
    s = jnp.maximum(jnp.asarray(step, jnp.float32), 1.0)  # the paper counts steps from 1
    ramp = s * warmup**-1.5 if warmup > 0 else s**-0.5
    return peak * d_model**-0.5 * jnp.minimum(s**-0.5, ramp)

  return rsqrt


def _constant(cfg: RunOptim, warmup: int) -> optax.Schedule:
  peak = float(cfg.optim.learning_rate)
  return _float32(_warmup(peak, warmup, optax.constant_schedule(peak)))


def _cosine_restarts(cfg: RunOptim, warmup: int) -> optax.Schedule:
  optim = cfg.optim
  peak, period = float(optim.learning_rate), int(optim.restart_period)
  cycle = _decay('cosine', peak, float(optim.end_learning_rate_factor), period)
  return _float32(_warmup(peak, warmup, lambda step: cycle(step % period)))


def _decaying(shape: str) -> Callable[[RunOptim, int], optax.Schedule]:
  """'warmup_cosine' and 'linear': warmup, then a decay that ends at the run's last step."""

  def build(cfg: RunOptim, warmup: int) -> optax.Schedule:
    optim = cfg.optim
    if cfg.steps is None:
      raise ValueError(f'schedule={optim.schedule} needs total_steps (the run length)')
    peak = float(optim.learning_rate)
    # A warmup cut to the run leaves 1 decay step: update steps is at peak, then end.
    steps = max(int(cfg.steps) - warmup, 1)
    decay = _decay(shape, peak, float(optim.end_learning_rate_factor), steps)
    return _float32(_warmup(peak, warmup, decay))

  return build


SCHEDULE_BUILDERS: dict[str, Callable[[RunOptim, int], optax.Schedule]] = {
  'rsqrt': _rsqrt,
  'warmup_cosine': _decaying('cosine'),
  'cosine_restarts': _cosine_restarts,
  'constant': _constant,
  'linear': _decaying('linear'),
}


def decay_mask(params: Any) -> Any:
  """True for leaves that get weight decay: matrices (ndim >= 2) not named 'bias' or 'scale'.

  Biases, LayerNorm/RMSNorm scales and any other vector or scalar are excluded. Works on a
  params pytree of arrays or of `jax.ShapeDtypeStruct`s, including boxed (partitioned) leaves.
  """

  def leaf_name(path) -> str:
    names = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
    return names[-1] if names else ''

  return jax.tree_util.tree_map_with_path(
    lambda path, leaf: len(leaf.shape) >= 2 and leaf_name(path) not in NO_DECAY_NAMES, params
  )


def make_optimizer(
  cfg: RunOptim, schedule: optax.Schedule | None = None
) -> optax.GradientTransformation:
  """clip_by_global_norm (if clip_norm) -> Adam or AdamW (decay masked by `decay_mask`).

  Knobs of cfg.optim: optimizer, b1, b2, eps (paper: 0.9, 0.98, 1e-9), weight_decay, clip_norm
  (0 = no clipping), plus the schedule knobs of `make_schedule`, unless `schedule` (the one
  `make_schedule(cfg)` gave) is passed. AdamW follows optax: the decay is multiplied by the
  scheduled learning rate.
  """
  optim = cfg.optim  # its knobs were checked by OptimConfig
  name = optim.optimizer
  weight_decay = float(optim.weight_decay)
  clip_norm = float(optim.clip_norm)

  schedule = make_schedule(cfg) if schedule is None else schedule
  adam_args = dict(b1=float(optim.b1), b2=float(optim.b2))
  adam_args['eps'] = float(optim.eps)
  if name == 'adamw':
    optimizer = optax.adamw(schedule, weight_decay=weight_decay, mask=decay_mask, **adam_args)
  else:
    optimizer = optax.adam(schedule, **adam_args)
  if clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(clip_norm), optimizer)
  return optimizer


def for_run(experiment: Config) -> tuple[optax.Schedule, optax.GradientTransformation]:
  """The schedule and optimizer of `experiment`, whose model is the run's (its d_model scales
  'rsqrt'); the optimizer follows that schedule, so a cut warmup warns once, not twice."""
  cfg = RunOptim(experiment.optim, steps=experiment.train.steps, d_model=experiment.model.d_model)
  schedule = make_schedule(cfg)
  return schedule, make_optimizer(cfg, schedule)
