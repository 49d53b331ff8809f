"""Linear attention (Katharopoulos et al. 2020): softmax(q.k) becomes phi(q).phi(k), so the keys
fold into a state sum_s phi(k_s) v_s^T of size [H, H] and attention costs O(T), not O(T * S).

out_t = phi(q_t)^T sum_s phi(k_s) v_s^T / phi(q_t)^T sum_s phi(k_s), over the keys t may see.
Two forms give the same numbers: `linear_attention` (global sums, or a chunked scan that carries
a prefix state) and `quadratic` (the masked [T, S] form); KV-cache decoding runs the recurrence,
one token at a time, with `state` and `readout`. Tensors are [B, T, N, H] as in attention.py.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import Array

from transformer.kernels.masks import MaskSpec

# name -> phi, applied elementwise to q and k over head_dim; must be >= 0 so denominators are.
FEATURE_MAPS: dict[str, Callable[[Array], Array]] = {
  'elu': lambda x: jax.nn.elu(x) + 1.0,  # the paper's elu(x) + 1: positive and smooth
  'relu': jax.nn.relu,
  'softplus': jax.nn.softplus,
}
_F32 = jnp.float32


def features(x: Array, feature_map: str) -> Array:
  """phi(x) in float32, whatever the input dtype (the sums over T need float32)."""
  if feature_map not in FEATURE_MAPS:
    raise ValueError(f'feature_map={feature_map!r} is not one of {sorted(FEATURE_MAPS)}')
  return FEATURE_MAPS[feature_map](x.astype(_F32))


def _check(q, k, v, mask):
  for name, x in (('q', q), ('k', k), ('v', v)):
    if x.ndim != 4:
      raise ValueError(f'{name} must have rank 4 [B, length, heads, head_dim]; got {x.shape}')
  if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
    raise ValueError(f'k/v {k.shape} must be [B, S, K, H] with q {q.shape} = [B, T, N, H]')
  if q.shape[2] % k.shape[2]:
    raise ValueError(f'num_kv_heads={k.shape[2]} does not divide num_heads={q.shape[2]}')
  if mask.window is not None:
    raise ValueError(
      f'window={mask.window} does not apply to linear attention, which folds every visible key '
      "into one state; use attention='softmax' for a sliding window"
    )
  if mask.causal and q.shape[1] != k.shape[1]:
    raise ValueError(f'causal linear attention needs T == S; got T={q.shape[1]}, S={k.shape[1]}')


def _divide(num: Array, den: Array, dtype) -> Array:
  """num [B, T, K, G, H] / den [B, T, K, G]: exactly 0 (and 0 gradient) where no key is seen."""
  seen = den > 0
  out = num / jnp.where(seen, den, 1.0)[..., None]
  out = jnp.where(seen[..., None], out, 0.0)
  B, T, K, G, H = out.shape
  return out.reshape(B, T, K * G, H).astype(dtype)  # [B, T, N, H]


def _group(q: Array, K: int) -> Array:
  """[B, T, N, H] -> [B, T, K, G, H]: query head n = k * G + g reads kv head k (GQA)."""
  B, T, N, H = q.shape
  return q.reshape(B, T, K, N // K, H)


def linear_attention(
  q: Array,
  k: Array,
  v: Array,
  *,
  mask: MaskSpec | None = None,
  feature_map: str = 'elu',
  chunk_size: int = 128,
  self_attention: bool = True,
) -> Array:
  """Linear attention with O(T) memory: global sums (bidirectional) or a chunked causal scan.

  Segment ids reset the state at document boundaries and padding (id 0) contributes nothing.
  The scans assume each non-zero segment id occupies one contiguous run of positions, as packing
  and padding make them; cross attention (`self_attention=False`) with segment ids sums per id
  instead (any order, ids in [0, S]). Logits are not scaled: phi(q).phi(k) is normalised anyway.

  Args:
    q: `[B, T, N, H]`; k, v: `[B, S, K, H]`, K dividing N.
    mask: causal and/or segment ids (a window is an error); None = every key.
    feature_map: a name in FEATURE_MAPS.
    chunk_size: C, positions per block of the causal scan (memory O(T * C + T / C * H^2)).
    self_attention: whether q and k index the same sequence (then q/kv segment ids are equal).
  Returns:
    `[B, T, N, H]` in q.dtype, exactly 0 on rows that see no key.
  """
  mask = MaskSpec() if mask is None else mask
  _check(q, k, v, mask)
  fq = _group(features(q, feature_map), k.shape[2])  # [B, T, K, G, H]
  fk, vf = features(k, feature_map), v.astype(_F32)  # [B, S, K, H]
  q_seg, kv_seg = mask.q_segment_ids, mask.kv_segment_ids
  if mask.causal:
    num, den = _scan(fq, fk, vf, q_seg, kv_seg, chunk_size, strict=False)
  elif q_seg is None:  # every query sees every key: one global state
    state = jnp.einsum('bskh,bske->bkhe', fk, vf)  # [B, K, H, H]
    num = jnp.einsum('btkgh,bkhe->btkge', fq, state)  # [B, T, K, G, H]
    den = jnp.einsum('btkgh,bkh->btkg', fq, fk.sum(1))  # [B, T, K, G]
  elif self_attention:  # keys before t (inclusive) + keys after t, each a scan over T
    num, den = _scan(fq, fk, vf, q_seg, kv_seg, chunk_size, strict=False)
    flip = lambda x: None if x is None else jnp.flip(x, 1)
    after = _scan(flip(fq), flip(fk), flip(vf), flip(q_seg), flip(kv_seg), chunk_size, strict=True)
    num, den = num + flip(after[0]), den + flip(after[1])
  else:
    num, den = _per_segment(fq, fk, vf, q_seg, kv_seg)
  return _divide(num, den, q.dtype)


def _per_segment(fq, fk, v, q_seg, kv_seg):
  """Cross attention with segments: one state per id ([B, S + 1, K, H, H]), gathered per query."""
  n = fk.shape[1] + 1  # ids 0..S
  seg_sum = jax.vmap(lambda x, ids: jax.ops.segment_sum(x, ids, num_segments=n))
  state = seg_sum(jnp.einsum('bskh,bske->bskhe', fk, v), kv_seg)  # [B, n, K, H, H]
  z = seg_sum(fk, kv_seg)  # [B, n, K, H]
  real = (q_seg != 0)[:, :, None, None]  # [B, T, 1, 1]: padded queries see nothing
  state_q = jnp.take_along_axis(state, q_seg[:, :, None, None, None], axis=1)  # [B, T, K, H, H]
  z_q = jnp.take_along_axis(z, q_seg[:, :, None, None], axis=1) * real  # [B, T, K, H]
  num = jnp.einsum('btkgh,btkhe->btkge', fq, state_q) * real[..., None]  # [B, T, K, G, H]
  return num, jnp.einsum('btkgh,btkh->btkg', fq, z_q)  # den [B, T, K, G]


def _scan(fq, fk, v, q_seg, kv_seg, chunk_size, strict):
  """Causal sums over key blocks of C positions: within a block the masked [C, C] form, across
  blocks a carried state (state [B, K, H, H], z [B, K, H], and the segment it belongs to).

  `strict` excludes the key at the query's own position (the 'after' half of a bidirectional
  sum). Returns num `[B, T, K, G, H]` and den `[B, T, K, G]`.
  """
  B, T, K, G, H = fq.shape
  C = min(chunk_size, T)
  if q_seg is None:  # one segment; the block padding below gets id 0
    q_seg = kv_seg = jnp.ones((B, T), jnp.int32)

  def blocks(x):  # [B, T, ...] -> [nC, B, C, ...], zero-padded to nC * C positions
    x = jnp.pad(x, [(0, 0), (0, -T % C)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(B, -1, C, *x.shape[2:]), 1, 0)

  below = jnp.tril(jnp.ones((C, C), bool), -1 if strict else 0)  # [C, C]: key d <= query c

  def step(carry, x):
    state, z, seg = carry  # [B, K, H, H], [B, K, H], [B]: the sums of segment `seg` so far
    fq_c, fk_c, v_c, qs, ks = x  # [B, C, K, G, H], [B, C, K, H] x 2, [B, C] x 2
    # Earlier blocks: only a query of the carried (non-padding) segment reads the state.
    carried = ((qs == seg[:, None]) & (qs != 0)).astype(_F32)  # [B, C]
    num = jnp.einsum('bckgh,bkhe->bckge', fq_c, state) * carried[:, :, None, None, None]
    den = jnp.einsum('bckgh,bkh->bckg', fq_c, z) * carried[:, :, None, None]
    # This block: the masked [C, C] scores, as in the quadratic form.
    visible = below & (qs[:, :, None] == ks[:, None, :]) & (qs[:, :, None] != 0)  # [B, C, C]
    a = jnp.einsum('bckgh,bdkh->bkgcd', fq_c, fk_c) * visible[:, None, None].astype(_F32)
    num = num + jnp.einsum('bkgcd,bdke->bckge', a, v_c)  # [B, C, K, G, H]
    den = den + jnp.einsum('bkgcd->bckg', a)  # [B, C, K, G]
    # The state goes on with the segment of the block's last key; with contiguous segments, the
    # old state belongs to it only if that segment did not change.
    last = ks[:, -1]  # [B]
    fk_last = fk_c * ((ks == last[:, None]) & (ks != 0)).astype(_F32)[:, :, None, None]
    same = (seg == last)[:, None, None]  # [B, 1, 1]
    state = jnp.where(same[..., None], state, 0.0) + jnp.einsum('bckh,bcke->bkhe', fk_last, v_c)
    z = jnp.where(same, z, 0.0) + fk_last.sum(1)
    return (state, z, last), (num, den)

  init = (jnp.zeros((B, K, H, H), _F32), jnp.zeros((B, K, H), _F32), jnp.zeros((B,), jnp.int32))
  xs = tuple(blocks(x) for x in (fq, fk, v, q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)))
  _, (num, den) = jax.lax.scan(step, init, xs)  # [nC, B, C, ...]
  unblock = lambda x: jnp.moveaxis(x, 0, 1).reshape(B, -1, *x.shape[3:])[:, :T]
  return unblock(num), unblock(den)


# The other form, and decoding's state -------------------------------------------------------------
def quadratic(q: Array, k: Array, v: Array, *, mask=None, feature_map: str = 'elu') -> Array:
  """The parallel form: masked scores phi(q) phi(k)^T [B, K, G, T, S], then normalised rows.

  O(T * S) memory; any mask without a window (segments in any order). For tests and short rows.
  """
  mask = MaskSpec() if mask is None else mask
  _check(q, k, v, mask)
  fq = _group(features(q, feature_map), k.shape[2])  # [B, T, K, G, H]
  fk = features(k, feature_map)  # [B, S, K, H]
  visible = mask.dense(q.shape[1], k.shape[1]).astype(_F32)  # [B or 1, 1, T, S]
  a = jnp.einsum('btkgh,bskh->bkgts', fq, fk) * visible[:, :, None]  # [B, K, G, T, S]
  num = jnp.einsum('bkgts,bske->btkge', a, v.astype(_F32))  # [B, T, K, G, H]
  return _divide(num, jnp.einsum('bkgts->btkg', a), q.dtype)


def state(k: Array, v: Array, kv_segment_ids: Array | None, feature_map: str):
  """Decoding's state of keys k, v [B, S, K, H]: (sum phi(k) v^T [B, K, H, H], sum phi(k)
  [B, K, 1, H]) over the non-padding keys (decoding holds one segment per row)."""
  fk = features(k, feature_map)  # [B, S, K, H]
  if kv_segment_ids is not None:
    fk = fk * (kv_segment_ids != 0).astype(_F32)[:, :, None, None]
  kv = jnp.einsum('bskh,bske->bkhe', fk, v.astype(_F32))  # [B, K, H, H]
  return kv, fk.sum(1)[:, :, None, :]  # [B, K, H, H], [B, K, 1, H]


def readout(q: Array, kv: Array, z: Array, feature_map: str) -> Array:
  """q [B, T, N, H] against a state (kv [B, K, H, H], z [B, K, 1, H]): [B, T, N, H]."""
  fq = _group(features(q, feature_map), kv.shape[1])  # [B, T, K, G, H]
  num = jnp.einsum('btkgh,bkhe->btkge', fq, kv)  # [B, T, K, G, H]
  return _divide(num, jnp.einsum('btkgh,bkh->btkg', fq, z[:, :, 0]), q.dtype)


# As a kind of attention.Kind: the functions MultiHeadAttention m calls ---------------------------
def attend(m, q, k, v, mask, alibi_slopes, self_attention, prefill, dropout, return_probs):
  """A whole sequence through `linear_attention` (no probabilities, no bias, no dropout)."""
  del alibi_slopes, prefill, dropout  # config validation refuses ALiBi and dropout here
  if return_probs:
    raise ValueError("return_probs=True needs kind='softmax': linear attention has no probs")
  cfg = m.cfg
  return linear_attention(
    q,
    k,
    v,
    mask=mask,
    feature_map=cfg.linear_feature_map,
    chunk_size=cfg.attention_chunk_size,
    self_attention=self_attention,
  )  # [B, T, N, H]


def cache(m, mode, k, v, self_attention, mask, positions):
  """A state of fixed size instead of a growing cache (leaves [B, K, H, H] and [B, K, 1, H], see
  `state`). prefill returns k, v [B, T, K, H] to attend to; step returns the state after this
  token (self) or the encoder's (cross)."""
  del positions
  kv_segments = None if mask is None else mask.kv_segment_ids
  if mode.phase == 'prefill':
    kv, z = state(k, v, kv_segments, m.cfg.linear_feature_map)
    m.variable('cache', 'linear_state', jnp.zeros, kv.shape, kv.dtype).value = kv
    m.variable('cache', 'linear_normalizer', jnp.zeros, z.shape, z.dtype).value = z
    return k, v
  if not m.has_variable('cache', 'linear_state'):
    raise ValueError("CacheMode 'step' needs the state that a 'prefill' call filled")
  kv, z = m.variable('cache', 'linear_state'), m.variable('cache', 'linear_normalizer')
  if self_attention:
    if k.shape[1] != 1:
      raise ValueError(f'CacheMode step takes one token per row; got {k.shape[1]}')
    kv_t, z_t = state(k, v, None, m.cfg.linear_feature_map)  # the new token is real
    kv.value, z.value = kv.value + kv_t, z.value + z_t
  return kv.value, z.value


def step(m, q, kv, z, self_attention, mask, positions, alibi_slopes):
  """q [B, 1, N, H] against the state (kv, z) = ([B, K, H, H], [B, K, 1, H])."""
  del self_attention, mask, positions, alibi_slopes
  return readout(q, kv, z, m.cfg.linear_feature_map)
