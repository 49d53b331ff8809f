"""The pure, jitted steps: `train_step(state, batch, rng) -> (state, metrics)` and `eval_step`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from transformer.model import models, objectives
from transformer.training.state import TrainState, model_inputs

Array = jax.Array


def _micro_batches(batch: dict[str, Array], k: int) -> dict[str, Array]:
  """[B, ...] -> [k, B/k, ...]: the gradient-accumulation split."""
  return jax.tree_util.tree_map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)


def train_step(
  state: TrainState,
  batch: dict[str, Array],
  rng: Array,
  *,
  model: Any,
  family: str,
  tx: optax.GradientTransformation,
  schedule: optax.Schedule,
  label_smoothing: float,
  grad_accum_steps: int = 1,
  dynamic_scale: bool = False,
  loss_scale_period: int = 2000,
  loss_chunk_size: int | None = None,
) -> tuple[TrainState, dict[str, Array]]:
  """One optimizer step over `grad_accum_steps` micro-batches; returns the new state and metrics.

  The gradient is that of the summed loss divided by the total weight of the whole batch, so k
  micro-batches give exactly the update of one batch k times larger. With `loss_chunk_size`, the
  tied output head and the loss run fused in vocabulary chunks of that size
  (`objectives.head_cross_entropy`): the same loss and gradients without the [B, T, V] logits.

  A batchnorm model (a BatchNormTrainState) normalises each micro-batch by its own real tokens'
  statistics and moves the running statistics once per micro-batch; a non-finite step keeps
  them as they were, as it keeps the parameters.
  """
  dropout_rng = jax.random.fold_in(rng, state.step)
  stats = getattr(state, 'batch_stats', None)  # running statistics; None without batchnorm
  grads, sums, new_stats = _summed_grads(
    state, stats, batch, dropout_rng, model=model, family=family,
    label_smoothing=label_smoothing, grad_accum_steps=grad_accum_steps,
    loss_chunk_size=loss_chunk_size,
  )  # fmt: skip
  denominator = jnp.maximum(sums['denominator'], 1.0)
  grads = jax.tree_util.tree_map(lambda g: g / denominator, grads)  # gradient of the mean loss
  grad_norm = optax.global_norm(grads)
  # A non-finite step changes neither the parameters nor the optimizer state; the step counter
  # still advances. The loop's train.nonfinite policy decides what follows (skip, halt, rollback).
  finite = jnp.isfinite(grad_norm) & jnp.isfinite(sums['loss'])
  params, opt_state = _update_if_finite(tx, grads, state, finite)
  changes = {}
  if stats is not None:  # small [D] vectors: a select on every backend
    changes['batch_stats'] = jax.tree_util.tree_map(
      lambda new, old: jnp.where(finite, new, old), new_stats, stats
    )
  loss_scale, good_steps = state.loss_scale, state.good_steps
  if dynamic_scale:
    loss_scale, good_steps = _next_loss_scale(loss_scale, good_steps, finite, loss_scale_period)

  metrics = {k: v for k, v in sums.items()}
  metrics.update(
    grad_norm=grad_norm,
    learning_rate=schedule(state.step),
    loss_scale=state.loss_scale,
    skipped=(~finite).astype(jnp.float32),
  )
  new_state = state.replace(
    step=state.step + 1,
    params=params,
    opt_state=opt_state,
    loss_scale=loss_scale,
    good_steps=good_steps,
    **changes,
  )
  return new_state, metrics


def _summed_grads(
  state: TrainState,
  stats: Any,
  batch: dict[str, Array],
  dropout_rng: Array,
  *,
  model: Any,
  family: str,
  label_smoothing: float,
  grad_accum_steps: int,
  loss_chunk_size: int | None,
) -> tuple[Any, dict[str, Array], Any]:
  """The summed-loss gradient, loss sums and running statistics over the batch's micro-batches."""

  def micro_step(params, stats, micro, micro_rng):
    def loss_fn(p):
      sums, new_stats = loss_and_stats(
        model, family, p if stats is None else {'params': p, 'batch_stats': stats}, micro,
        micro_rng, label_smoothing=label_smoothing, loss_chunk_size=loss_chunk_size,
      )  # fmt: skip
      # Normalise by a static size so fp16 gradients stay in range; undone below.
      return sums['loss'] * state.loss_scale / micro['weights'].size, (sums, new_stats)

    grads, (sums, new_stats) = jax.grad(loss_fn, has_aux=True)(params)
    grads = jax.tree_util.tree_map(lambda g: g * (micro['weights'].size / state.loss_scale), grads)
    return grads, sums, new_stats

  if grad_accum_steps == 1:
    return micro_step(state.params, stats, batch, dropout_rng)
  micros = _micro_batches(batch, grad_accum_steps)

  def body(carry, xs):
    totals, stats = carry
    micro, index = xs
    g, s, stats = micro_step(state.params, stats, micro, jax.random.fold_in(dropout_rng, index))
    return (jax.tree_util.tree_map(jnp.add, totals, (g, s)), stats), None

  shapes = jax.eval_shape(micro_step, state.params, stats, batch_slice(micros), dropout_rng)
  zeros = jax.tree_util.tree_map(jnp.zeros_like, shapes[:2])
  ((grads, sums), new_stats), _ = jax.lax.scan(
    body, (zeros, stats), (micros, jnp.arange(grad_accum_steps))
  )
  return grads, sums, new_stats


def _update_if_finite(
  tx: optax.GradientTransformation, grads: Any, state: TrainState, finite: Array
) -> tuple[Any, Any]:
  """The optimizer's new parameters and state, or the old ones where the step is not finite."""

  def update(grads, params, opt_state):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  if update_under_cond():
    # On CPU a cond: XLA:CPU copies every donated parameter and moment to keep the old values
    # for a select (3-5% of char_lm's step). On GPU the cond holds every gradient until it ends
    # (llama_7b over 8 GPUs: 4.4 GiB more per device), so there the select stays.
    return jax.lax.cond(
      finite, update, lambda g, p, o: (p, o), grads, state.params, state.opt_state
    )
  new_params, new_opt_state = update(grads, state.params, state.opt_state)
  keep = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(finite, a, b), new, old)
  return keep(new_params, state.params), keep(new_opt_state, state.opt_state)


def _next_loss_scale(
  loss_scale: Array, good_steps: Array, finite: Array, loss_scale_period: int
) -> tuple[Array, Array]:
  """The float16 loss scale: halved after a non-finite step, doubled after a period of good ones."""
  grow = good_steps + 1 >= loss_scale_period
  loss_scale = jnp.where(finite, jnp.where(grow, loss_scale * 2, loss_scale), loss_scale / 2)
  loss_scale = jnp.clip(loss_scale, 1.0, 2.0**24)
  good_steps = jnp.where(finite & ~grow, good_steps + 1, 0)
  return loss_scale, good_steps


def update_under_cond() -> bool:
  """Whether a step's update runs under a cond on finiteness (CPU) or is selected (elsewhere)."""
  return jax.default_backend() == 'cpu'


def loss_sums(
  model: Any,
  family: str,
  params: Any,
  batch: dict[str, Array],
  rng: Array,
  *,
  label_smoothing: float,
  loss_chunk_size: int | None,
) -> dict[str, Array]:
  """The summed training loss of one batch in training mode (dropout from `rng`), with the fused
  head and loss when `loss_chunk_size` is set: what `train_step` differentiates."""
  return loss_and_stats(
    model, family, params, batch, rng, label_smoothing=label_smoothing,
    loss_chunk_size=loss_chunk_size,
  )[0]  # fmt: skip


def loss_and_stats(
  model: Any,
  family: str,
  weights: Any,
  batch: dict[str, Array],
  rng: Array,
  *,
  label_smoothing: float,
  loss_chunk_size: int | None,
) -> tuple[dict[str, Array], Any]:
  """`loss_sums`, plus the running statistics after this batch when `weights` are a batchnorm
  model's variables {'params': ..., 'batch_stats': ...} (None otherwise)."""
  variables = models.variables(weights)
  mutable = ['batch_stats'] if 'batch_stats' in variables else False
  out = model.apply(
    variables,
    **model_inputs(family, batch),
    deterministic=False,
    rngs={'dropout': rng},
    mutable=mutable,
    **({'head_inputs': True} if loss_chunk_size else {}),
  )
  out, updated = out if mutable else (out, {})
  stats = updated.get('batch_stats')
  if loss_chunk_size:  # out: HeadInputs(hidden [B, T, D], table [V, D], bias [V] | None)
    sums = objectives.head_cross_entropy(
      *out, batch['targets'], batch['weights'], label_smoothing, loss_chunk_size
    )
    return sums, stats
  sums = objectives.compute_metrics(  # out: logits [B, T, V]
    out, batch['targets'], batch['weights'], label_smoothing, accuracy=False
  )
  return sums, stats


def batch_slice(micros: dict[str, Array]) -> dict[str, Array]:
  """The first micro-batch of a [k, B/k, ...] split."""
  return jax.tree_util.tree_map(lambda x: x[0], micros)


def eval_step(params: Any, batch: dict[str, Array], *, model: Any, family: str) -> dict:
  """Summed loss, nll, correct and denominator over one eval batch (no label smoothing).

  `params`: `state.weights(state)` (a batchnorm model's include its running statistics).
  """
  variables = models.variables(params)
  logits = model.apply(variables, **model_inputs(family, batch), deterministic=True)
  return objectives.compute_metrics(logits, batch['targets'], batch['weights'])


def token_nll(model, params, inputs, targets):
  """Per-token negative log-likelihood [B, T] of `targets` given `inputs`."""
  logits = model.apply(models.variables(params), inputs).astype(jnp.float32)  # [B, T, V]
  logp = jax.nn.log_softmax(logits)
  return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]  # [B, T]
