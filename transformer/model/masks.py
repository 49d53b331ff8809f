"""Structured attention masks: `MaskSpec` (causal, segments, sliding window).

Only the dense paths materialise a mask; the blocked ones evaluate `visible` per key block. The rule
itself is `transformer.kernels.masks.visible`, which the kernels share.
"""

from __future__ import annotations

import flax
import jax.numpy as jnp
from jax import Array

from transformer.kernels import masks as kernel_masks

NEG = -1e30  # logit of a masked entry: finite, so fully masked rows never produce NaN


def visible(causal, window, q_pos, k_pos, q_seg, kv_seg, kv_len=None) -> Array:
  """bool[B or 1, 1, T, C]: may query at q_pos[t] see key at k_pos[c]? (`kernels.masks.visible`)

  q_pos `[T]`, k_pos `[C]`; q_seg `[B, T]` and kv_seg `[B, C]` (0 = padding) or both None; keys
  from kv_len on are padding added by the chunked path.
  """
  B, T, C = 1 if q_seg is None else q_seg.shape[0], q_pos.shape[0], k_pos.shape[0]
  if q_seg is not None:
    q_seg, kv_seg = q_seg[:, None, :, None], kv_seg[:, None, None, :]  # [B, 1, T, 1], [B, 1, 1, C]
  ok = kernel_masks.visible(
    q_pos[:, None], k_pos[None, :], q_seg, kv_seg, causal=causal, window=window, kv_len=kv_len
  )  # broadcastable to [B, 1, T, C], or None
  return jnp.ones((B, 1, T, C), bool) if ok is None else jnp.broadcast_to(ok, (B, 1, T, C))


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
