"""Beam search over the KV cache: the W best hypotheses of each example, by GNMT's length penalty.

The search keeps `[B * W]` cache rows (example-major) and gathers them by parent beam after every
step; `decode.beam_search` and `decode.translate` / `decode.generate` with beam_size > 1 run it.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from transformer.data import PAD_ID
from transformer.model.prefill import Knobs, Options, next_logits, prefill

Array = jax.Array
_NEG_INF = -1.0e9  # score of an impossible hypothesis: finite, so sums never become NaN


def _batch_axis(x: Array) -> int:
  """Cache leaves are [B, L, K, H], with a leading layer axis under scan_layers."""
  return x.ndim - 4


def _gather_rows(cache: Any, rows: Array) -> Any:
  """Reorders self-attention cache rows; cross-attention rows are equal within an example."""

  def gather(path, x):
    if 'cross_attention' in jax.tree_util.keystr(path):  # the same source for every beam
      return x
    return jnp.take(x, rows, axis=_batch_axis(x))

  return jax.tree_util.tree_map_with_path(gather, cache)


class _Beams(NamedTuple):
  alive: Array  # int32[B, W, length] tokens of the live hypotheses, PAD_ID past the last one
  alive_logp: Array  # float32[B, W] summed log-probabilities
  finished: Array  # int32[B, W, length] the best finished hypotheses
  scores: Array  # float32[B, W] their length-penalised scores, best first
  num_finished: Array  # int32[B] hypotheses finished so far (the example is done at W)


def length_penalty(length: Array | int, alpha: float) -> Array:
  """GNMT length penalty ((5 + length) / 6) ** alpha; length counts eos."""
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def _expand(beams: _Beams, logp: Array, i: Array, length: int, alpha: Array, eos_id: int):
  """Extends every live beam by token i. logp: float32[B, W, V] of that token.

  Returns the new beams, and for each new live beam its parent beam [B, W] and token [B, W].
  """
  B, W, V = logp.shape
  scores = (beams.alive_logp[:, :, None] + logp).reshape(B, W * V)  # [B, W * V]
  # 2W candidates: even if W of them end in eos, W remain to stay alive.
  top, index = lax.top_k(scores, 2 * W)  # [B, 2W], ranked by summed log-probability
  parent, token = index // V, (index % V).astype(jnp.int32)  # [B, 2W] each
  seqs = jnp.take_along_axis(beams.alive, parent[:, :, None], axis=1)  # [B, 2W, length]
  seqs = lax.dynamic_update_slice(seqs, token[:, :, None], (0, 0, i))  # seqs[:, :, i] = token
  eos = token == eos_id  # [B, 2W]

  # Candidates ranked among the first W finish when they end in eos or reach the length.
  ends = (eos | (i == length - 1)) & (jnp.arange(2 * W) < W)
  ends &= (beams.num_finished < W)[:, None]  # a done example takes no more
  new_scores = jnp.where(ends, top / length_penalty(i + 1, alpha), _NEG_INF)
  pool_scores = jnp.concatenate([beams.scores, new_scores], axis=1)  # [B, 3W]
  pool = jnp.concatenate([beams.finished, seqs], axis=1)  # [B, 3W, length]
  scores, keep = lax.top_k(pool_scores, W)  # [B, W]
  finished = jnp.take_along_axis(pool, keep[:, :, None], axis=1)  # [B, W, length]

  # The W best candidates without eos stay alive (2W candidates hold at most W eos).
  alive_logp, keep = lax.top_k(jnp.where(eos, _NEG_INF, top), W)  # [B, W]
  beams = _Beams(
    jnp.take_along_axis(seqs, keep[:, :, None], axis=1),  # [B, W, length]
    alive_logp,
    finished,
    scores,
    beams.num_finished + ends.sum(axis=1, dtype=jnp.int32),
  )
  return beams, jnp.take_along_axis(parent, keep, 1), jnp.take_along_axis(token, keep, 1)


@functools.partial(jax.jit, static_argnums=(0, 4))
def search(model, params, tokens, knobs: Knobs, opts: Options) -> tuple[Array, Array]:
  """(sequences int32[B, W, length], scores float32[B, W]), best first."""
  W, length = opts.beam_size, opts.length
  first, cache, step, start = prefill(model, params, tokens, length, W)
  B, V = first.shape
  start = jnp.repeat(start, W)  # [B * W]
  empty = jnp.full((B, W, length), PAD_ID, jnp.int32)
  alive_logp = jnp.full((B, W), _NEG_INF).at[:, 0].set(0.0)  # W copies of one empty hypothesis
  beams = _Beams(empty, alive_logp, empty, jnp.full((B, W), _NEG_INF), jnp.zeros((B,), jnp.int32))
  first = jnp.repeat(first, W, axis=0)  # [B * W, V]
  cache = jax.tree.map(lambda x: jnp.repeat(x, W, axis=_batch_axis(x)), cache)  # [B * W] rows

  def cond(state):
    i, beams, _, _ = state
    return (i < length) & jnp.any(beams.num_finished < W)

  def body(state):
    i, beams, token, cache = state
    logits, cache = next_logits(i, first, step, token, start + i - 1, cache)  # [B * W, V]
    logp = jax.nn.log_softmax(logits).reshape(B, W, V)  # rows are example-major: b * W + w
    beams, parent, token = _expand(beams, logp, i, length, knobs.alpha, opts.eos_id)
    rows = (jnp.arange(B)[:, None] * W + parent).reshape(-1)  # [B * W] parent rows
    # Each surviving beam continues its parent's cache: copy the parent's rows into its slot.
    return i + 1, beams, token.reshape(-1), _gather_rows(cache, rows)

  state = (jnp.int32(0), beams, jnp.zeros((B * W,), jnp.int32), cache)
  _, beams, _, _ = lax.while_loop(cond, body, state)
  return beams.finished, beams.scores
