"""Float64 NumPy attention with the kernels' masks, forward and gradients: the reference that the
kernel tests and `experiments.gpu_check` compare every implementation against."""

import numpy as np


def visible_float64(T, S, causal, window, q_seg, kv_seg) -> np.ndarray:
  """[B, T, S] bool: which keys each query may see (float64 reference)."""
  i, j = np.arange(T)[:, None], np.arange(S)[None, :]
  ok = np.ones((T, S), bool)
  if causal:
    ok &= j <= i
  if window is not None:
    ok &= (j >= i - window[0]) & (j <= i + window[1])
  ok = np.broadcast_to(ok, (1, T, S))
  if q_seg is not None:
    ok = ok & (q_seg[:, :, None] == kv_seg[:, None, :]) & (q_seg[:, :, None] != 0)
  return ok


def attention_float64(
  q, k, v, g, *, causal=False, window=None, q_seg=None, kv_seg=None, scale=None
):
  """Float64 forward and gradients (given output cotangent g) of masked softmax attention."""
  q, k, v, g = (np.asarray(x, np.float64) for x in (q, k, v, g))
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  scale = 1 / np.sqrt(H) if scale is None else scale
  ke, ve = np.repeat(k, N // K, axis=2), np.repeat(v, N // K, axis=2)  # [B, S, N, H]
  ok = visible_float64(T, S, causal, window, q_seg, kv_seg)[:, None]  # [B, 1, T, S]
  s = np.einsum('btnh,bsnh->bnts', q, ke) * scale
  s = np.where(ok, s, -np.inf)
  m = s.max(-1, keepdims=True)
  p = np.exp(s - np.where(np.isfinite(m), m, 0))
  p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)  # [B, N, T, S]; empty rows stay 0
  out = np.einsum('bnts,bsnh->btnh', p, ve)
  dv = np.einsum('bnts,btnh->bsnh', p, g)
  dp = np.einsum('btnh,bsnh->bnts', g, ve)
  ds = p * (dp - (dp * p).sum(-1, keepdims=True))
  dq = np.einsum('bnts,bsnh->btnh', ds, ke) * scale
  dk = np.einsum('bnts,btnh->bsnh', ds, q) * scale

  def fold(x):  # sum the query heads of each kv group: [B, S, N, H] -> [B, S, K, H]
    return x.reshape(B, S, K, N // K, H).sum(3)

  return out, (dq, fold(dk), fold(dv))
