"""QK and OV circuits of attention-only causal LMs, and how their heads compose (Elhage et al.
2021, "A Mathematical Framework for Transformer Circuits").

In an attention-only model every path from the embeddings to the logits runs through heads, so a
head's weights say, for every pair of tokens, how much a query token attends to a key token (the
QK circuit) and what attending to a token writes into the logits (the OV circuit):

  QK[i, j] = (norm(e_i) W_Q^h + b_Q) . (norm(e_j) W_K^h + b_K) * scale     [V, V] (query, key)
  OV[j, :] = (norm(e_j) W_V^h + b_V) W_O^h  C diag(g_final) W_U            [V, V] (source, logit)

`e` are the embedding rows as the first layer sees them (x sqrt(D) where the model scales them)
and `norm` is the layer's own norm, so for the first layer of a model without absolute positions
QK is exactly its attention score between two tokens. Later layers' circuits are the direct
path: what the head would do to the embeddings alone. In OV, C centres (LayerNorm) and g_final
is the final norm's gain; the final norm's division by the RMS, a positive scalar per token, is
left out, as direct logit attribution caches it instead. `source='positions'` puts absolute
position rows in place of the tokens.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer.config import ModelConfig
from transformer.model import models, norms, scan
from transformer.model import positions as positions_lib
from transformer.model.attention import logit_scale
from transformer.model.parts import parts

SOURCES = ('tokens', 'positions')


def check(cfg: ModelConfig) -> None:
  """One ValueError when the circuits do not describe `cfg`'s model."""
  if cfg.family != 'causal_lm' or cfg.d_ff or cfg.norm_placement != 'pre' or not cfg.residual:
    raise ValueError(
      'QK and OV circuits are defined here for attention-only pre-LN causal_lm models '
      f'(model.d_ff=0) with residual connections; this one has family={cfg.family!r}, '
      f'd_ff={cfg.d_ff}, norm_placement={cfg.norm_placement!r}, residual={cfg.residual}'
    )
  if cfg.position == 'rope' or cfg.qk_norm or cfg.attention != 'softmax' or cfg.short_conv:
    raise ValueError(
      'a QK circuit over token pairs needs scores that depend on the two tokens alone; '
      f'position={cfg.position!r}, qk_norm={cfg.qk_norm}, attention={cfg.attention!r} and '
      f'short_conv={cfg.short_conv} must be none of rope, True, linear/compressed or > 0'
    )


def _layer(cfg: ModelConfig, params: Any, layer: int) -> dict:
  if not 0 <= layer < cfg.num_layers:
    raise ValueError(f'layer={layer} is out of range: the model has {cfg.num_layers} layers')
  return scan.unscan_params(cfg, nn.meta.unbox(params))['decoder']['stack'][f'layer_{layer}']


def _rows(cfg: ModelConfig, params: Any, source: str) -> np.ndarray:
  """The residual stream's rows before any layer: token embeddings or absolute positions."""
  if source not in SOURCES:
    raise ValueError(f'source={source!r} is not valid; choose one of {", ".join(SOURCES)}')
  params = nn.meta.unbox(params)
  if source == 'tokens':
    e = np.asarray(params['embedding']['embedding'], np.float64)  # [V, D]
    return e * math.sqrt(cfg.d_model) if cfg.scale_embeddings else e
  if cfg.position == 'learned':
    table = params['decoder']['embedder']['positions']['positions']['embedding']
    return np.asarray(table, np.float64)  # [P, D]
  if cfg.position == 'sinusoidal':
    return np.asarray(positions_lib.sinusoidal(jnp.arange(cfg.max_length)[None], cfg.d_model)[0])
  raise ValueError(
    f"source='positions' needs learned or sinusoidal positions, not {cfg.position!r}"
  )


def _normed(cfg: ModelConfig, norm_params: dict, rows: np.ndarray) -> np.ndarray:
  norm = parts(cfg.replace(dtype='float32')).norm()  # the model's own norm, in float32
  return np.asarray(norm.apply({'params': norm_params}, jnp.asarray(rows, jnp.float32)), np.float64)


def head_weights(cfg: ModelConfig, params: Any, layer: int, head: int) -> dict[str, np.ndarray]:
  """W_Q, W_K, W_V [D, H], their biases b_Q, b_K, b_V [H] (zeros without) and W_O [H, D] of one
  head; under GQA its key and value are those of the shared key/value head."""
  check(cfg)
  if not 0 <= head < cfg.num_heads:
    raise ValueError(f'head={head} is out of range: the model has {cfg.num_heads} heads')
  attn = _layer(cfg, params, layer)['self_attention']
  kv = head // (cfg.num_heads // cfg.kv_heads)
  out = {'W_O': np.asarray(attn['out']['kernel'], np.float64)[head]}  # [H, D]
  for name, key, h in (('Q', 'query', head), ('K', 'key', kv), ('V', 'value', kv)):
    out[f'W_{name}'] = np.asarray(attn[key]['kernel'], np.float64)[:, h]  # [D, H]
    bias = attn[key].get('bias')
    out[f'b_{name}'] = np.zeros(cfg.head_size) if bias is None else np.asarray(bias)[h]
  return out


def unembed(cfg: ModelConfig, params: Any) -> np.ndarray:
  """W_U [D, V]: the output head without its bias."""
  module, params = models.build(cfg.replace(dtype='float32')), nn.meta.unbox(params)
  head = lambda x: module.apply({'params': params}, x, method=lambda m, x: m.head(x))[0]
  eye = jnp.eye(cfg.d_model)[None]
  return np.asarray(head(eye), np.float64) - np.asarray(head(jnp.zeros_like(eye)), np.float64)


def qk_circuit(
  cfg: ModelConfig, params: Any, layer: int, head: int, source: str = 'tokens'
) -> np.ndarray:
  """[S, S]: the attention score of query row i on key row j (tokens or positions)."""
  w = head_weights(cfg, params, layer, head)
  x = _normed(cfg, _layer(cfg, params, layer)['self_attention_norm'], _rows(cfg, params, source))
  scale = logit_scale(cfg)  # the model's own rule
  return (x @ w['W_Q'] + w['b_Q']) @ (x @ w['W_K'] + w['b_K']).T * scale


def _ov_factors(cfg: ModelConfig, params: Any, layer: int, head: int):
  """(A [V, D], B [D, V]) with OV = A B: what the head writes per token, and the readout."""
  w = head_weights(cfg, params, layer, head)
  x = _normed(cfg, _layer(cfg, params, layer)['self_attention_norm'], _rows(cfg, params, 'tokens'))
  return (x @ w['W_V'] + w['b_V']) @ w['W_O'], _readout(cfg, params)


def ov_circuit(cfg: ModelConfig, params: Any, layer: int, head: int) -> np.ndarray:
  """[V, V]: the logits that attending to token j writes (before the final norm's RMS)."""
  a, b = _ov_factors(cfg, params, layer, head)
  return a @ b


def _readout(cfg: ModelConfig, params: Any) -> np.ndarray:
  """[D, V]: centring (LayerNorm), the final norm's gain, then the unembedding."""
  D, params = cfg.d_model, nn.meta.unbox(params)
  centre = np.eye(D) - (1.0 / D if norms.reapplied(cfg.norm, 'the OV readout') else 0.0)
  gain = norms.gain(
    cfg.norm, np.asarray(params['decoder']['stack']['final_norm']['scale'], np.float64)
  )
  return centre @ (gain[:, None] * unembed(cfg, params))


def copying_score(cfg: ModelConfig, params: Any, layer: int, head: int) -> float:
  """sum(eigenvalues) / sum(|eigenvalues|) of the OV circuit, in [-1, 1]: near 1 for a head that
  raises the logits of the tokens it attends to (copying), near -1 for one that suppresses them.
  The non-zero eigenvalues of OV = A B are those of B A, a [D, D] matrix."""
  a, b = _ov_factors(cfg, params, layer, head)  # [V, D], [D, V]
  eig = np.linalg.eigvals(b @ a)
  return float(eig.sum().real / max(np.abs(eig).sum(), 1e-30))


def composition_scores(cfg: ModelConfig, params: Any) -> dict[str, np.ndarray]:
  """Q-, K- and V-composition of every head of an earlier layer (writer) with every head of a
  later one (reader): ||W_OV^w M^r|| / (||W_OV^w|| ||M^r||) in Frobenius norms, with M^r the
  reader's W_QK (Q), its transpose (K) or its W_OV (V), each with the reader's norm gain folded
  in (biases, which carry no input, are left out). {kind: [L, N, L, N]}, writer layer and head
  first; zero unless the writer's layer comes before the reader's."""
  check(cfg)
  L, N = cfg.num_layers, cfg.num_heads
  gains = [
    norms.gain(
      cfg.norm, np.asarray(_layer(cfg, params, layer)['self_attention_norm']['scale'], np.float64)
    )
    for layer in range(L)
  ]
  ov, qk = {}, {}
  for layer in range(L):
    for head in range(N):
      w = head_weights(cfg, params, layer, head)
      g = gains[layer][:, None]
      ov[layer, head] = (g * w['W_V']) @ w['W_O']  # [D, D]
      qk[layer, head] = (g * w['W_Q']) @ (g * w['W_K']).T  # [D, D]
  fro = lambda m: np.linalg.norm(m)
  out = {kind: np.zeros((L, N, L, N)) for kind in ('q', 'k', 'v')}
  for (lw, hw), a in ov.items():
    for (lr, hr), m in qk.items():
      if lw >= lr:
        continue
      out['q'][lw, hw, lr, hr] = fro(a @ m) / (fro(a) * fro(m))
      out['k'][lw, hw, lr, hr] = fro(a @ m.T) / (fro(a) * fro(m))
      out['v'][lw, hw, lr, hr] = fro(a @ ov[lr, hr]) / (fro(a) * fro(ov[lr, hr]))
  return out


def summary(cfg: ModelConfig, params: Any) -> dict[str, Any]:
  """Per head: the copying score, and how much of each query token's QK row falls on the token
  itself (the diagonal's softmax mass, averaged over tokens). {name: [L, N]}."""
  check(cfg)
  L, N = cfg.num_layers, cfg.num_heads
  copying, self_attention = np.zeros((L, N)), np.zeros((L, N))
  for layer in range(L):
    for head in range(N):
      copying[layer, head] = copying_score(cfg, params, layer, head)
      probs = jax.nn.softmax(jnp.asarray(qk_circuit(cfg, params, layer, head)), axis=-1)
      self_attention[layer, head] = float(jnp.diagonal(probs).mean())
  return {'copying': copying, 'self_attention': self_attention}
