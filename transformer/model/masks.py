"""Structured attention masks: `MaskSpec` (causal, segments, sliding window) and the ALiBi bias.

Only the dense paths materialise a mask; the blocked ones evaluate `visible` per key block.
"""

from __future__ import annotations

import flax
import jax.numpy as jnp
from jax import Array

NEG = -1e30  # logit of a masked entry: finite, so fully masked rows never produce NaN


def visible(causal, window, q_pos, k_pos, q_seg, kv_seg, kv_len=None) -> Array:
  """bool[B or 1, 1, T, C]: may query at q_pos[t] see key at k_pos[c]?"""
  i, j = q_pos[:, None], k_pos[None, :]  # [T, 1], [1, C]
  ok = jnp.ones((q_pos.shape[0], k_pos.shape[0]), bool)  # [T, C]
  if causal:  # top-left aligned: query i sits at position i, like key i
    ok &= j <= i
  if window is not None:
    ok &= (j >= i - window[0]) & (j <= i + window[1])
  if kv_len is not None:  # keys past kv_len are padding added by the chunked path
    ok &= j < kv_len
  ok = ok[None, None]  # [1, 1, T, C]
  if q_seg is not None:
    # Packed examples keep apart (equal ids); segment 0 is padding and sees nothing, not even
    # other padding, so a padded query row is fully masked and attention returns 0 there.
    same = (q_seg[:, :, None] == kv_seg[:, None, :]) & (q_seg[:, :, None] != 0)  # [B, T, C]
    ok = ok & same[:, None]  # [B, 1, T, C]
  return ok


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
    pos_q, pos_k = jnp.arange(T), jnp.arange(S)  # [T], [S]
    return visible(self.causal, self.window, pos_q, pos_k, self.q_segment_ids, self.kv_segment_ids)


def alibi_bias(slopes: Array, K: int, q_pos: Array, k_pos: Array) -> Array:
  """float32[K, G, T, C]: the ALiBi bias -slope[n] * |i - j|, heads split as n = k * G + g."""
  # Symmetric |i - j|, so it also serves bidirectional attention; causal masking hides j > i.
  dist = jnp.abs(q_pos[:, None] - k_pos[None, :]).astype(jnp.float32)  # [T, C]
  return -slopes.astype(jnp.float32).reshape(K, -1)[:, :, None, None] * dist  # [K, G, T, C]
