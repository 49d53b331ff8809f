"""The attention mask rule, written once: which keys a query may see. Every kernel and the model's
attention paths (`transformer.model.masks`) call it with positions laid out for their own tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

Array = jax.Array


def visible(
  q_pos: Array | None,
  k_pos: Array | None,
  q_seg: Array | None,
  kv_seg: Array | None,
  *,
  causal: bool,
  window: tuple[int, int] | None,
  kv_len: int | None = None,
) -> Array | None:
  """Boolean mask of which keys each query may see, or None (at trace time) when none is hidden.

  The query at q_pos sees the key at k_pos iff every given condition holds: k_pos < kv_len (keys
  from kv_len on are padding), causal (k_pos <= q_pos, top-left aligned), window=(left, right)
  (q_pos - left <= k_pos <= q_pos + right), and equal segment ids that are not 0. Segment 0 is
  padding and sees nothing, not even other padding, so a padded query row is fully masked.

  The arguments are compared elementwise with broadcasting, so each caller lays them out for its
  tile (e.g. q_pos `[T, 1]` against k_pos `[1, S]`) and gets the mask in that broadcast shape.
  Positions are read only when kv_len, causal or window asks for them; segment ids only when
  q_seg is not None (kv_seg then comes with it).
  """
  conds = []
  if kv_len is not None:
    conds.append(k_pos < kv_len)  # the padded tail of the keys
  if causal:
    conds.append(k_pos <= q_pos)
  if window is not None:
    left, right = window
    conds.append(k_pos >= q_pos - left)
    conds.append(k_pos <= q_pos + right)
  if q_seg is not None:
    conds.append((q_seg == kv_seg) & (q_seg != 0))  # 0 = padding
  # None when no condition applies: callers then skip their where().
  return functools.reduce(jnp.logical_and, conds) if conds else None
