"""The attention mask, written once: the rule of which keys a query may see (`visible`) and the
structured mask that the model passes around (`MaskSpec`: causal, segments, sliding window). Every
kernel and the model's attention paths call `visible` with positions laid out for their own tiles;
only the dense paths materialise a mask (`MaskSpec.dense`).
"""

from __future__ import annotations

import functools

import flax
import jax
import jax.numpy as jnp

Array = jax.Array

NEG = -1e30  # logit of a masked entry: finite, so fully masked rows never produce NaN


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


@flax.struct.dataclass
class MaskSpec:
  """Which keys each query may see; a pytree (segment ids are leaves, causal/window static).

  Query i sits at position i and key j at position j (top-left alignment). Query i sees key j
  iff every given condition holds: causal (j <= i), same non-zero segment id (0 = padding), and
  window=(left, right) (i - left <= j <= i + right).
  """

  causal: bool = flax.struct.field(pytree_node=False, default=False)
  q_segment_ids: Array | None = None  # [B, T] int; 0 = padding
  kv_segment_ids: Array | None = None  # [B, S] int; 0 = padding
  window: tuple[int, int] | None = flax.struct.field(pytree_node=False, default=None)

  def __post_init__(self):
    w = self.window
    if w is not None:
      ok = isinstance(w, tuple | list) and len(w) == 2
      if not (ok and all(isinstance(x, int) and not isinstance(x, bool) for x in w)):
        raise ValueError(f'window={w!r} must be a pair of ints (left, right)')
      if min(w) < 0:
        raise ValueError(f'window={w!r} must have non-negative entries (left, right)')
      object.__setattr__(self, 'window', tuple(w))  # a list would not be hashable

  def dense(self, T: int, S: int) -> Array:
    """Materialises the mask as bool[B or 1, 1, T, S] (True = visible)."""
    q_seg, kv_seg = self.q_segment_ids, self.kv_segment_ids  # [B, T], [B, S] or None
    B = 1 if q_seg is None else q_seg.shape[0]
    if q_seg is not None:  # [B, 1, T, 1], [B, 1, 1, S]
      q_seg, kv_seg = q_seg[:, None, :, None], kv_seg[:, None, None, :]
    ok = visible(jnp.arange(T)[:, None], jnp.arange(S)[None], q_seg, kv_seg, causal=self.causal,
                 window=self.window)  # fmt: skip
    return jnp.ones((B, 1, T, S), bool) if ok is None else jnp.broadcast_to(ok, (B, 1, T, S))
