"""Attention core: `dot_product_attention` (one registry of implementations), the dense path and
the scores every softmax path shares, and `MultiHeadAttention` (self and cross, with a KV cache).

Every attention in sparrow calls `dot_product_attention` with tensors laid out `[B, T, N, H]`, or
the implementation it would pick. The masks live in `transformer.kernels.masks` (`MaskSpec` is
re-exported here); the blocked implementations and the decoding step in
`transformer.model.attention_paths`, the attention kinds in `parts.KINDS`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import Array

from transformer import config
from transformer.config import ModelConfig
from transformer.kernels.masks import NEG, MaskSpec
from transformer.model.layers import HookPoint, constrain, dense
from transformer.model.positions import alibi_bias

_DENSE_MAX_ELEMENTS = 1024 * 1024  # auto-select 'xla' while one head's T * S logits fit this


def registered() -> list[str]:
  """The names `implementation=` accepts (besides None, which picks one for the shapes)."""
  return sorted(_IMPLEMENTATIONS)


def register_implementation(name: str, fn: Callable[..., Array]) -> None:
  """Registers (or replaces) an implementation selectable by `implementation=name`.

  `fn(q, k, v, *, mask, scale, alibi_slopes, chunk_size)` must return out `[B, T, N, H]`
  in q.dtype, with exactly 0 on fully masked query rows; see `dot_product_attention`.
  """
  _IMPLEMENTATIONS[name] = fn
  if name not in config.ATTENTION_IMPLEMENTATIONS:  # so that a config can choose it too
    config.ATTENTION_IMPLEMENTATIONS.append(name)


def select_implementation(T: int, S: int, *, return_probs: bool = False) -> str:
  """Automatic choice: 'xla' when return_probs or T * S <= 1024 * 1024, else 'chunked'.

  Dense logits are fastest while one head's [T, S] float32 block stays at most 4 MiB; longer
  sequences use the memory-efficient 'chunked' path. Never picks 'pallas' or 'cudnn'.
  """
  return 'xla' if return_probs or T * S <= _DENSE_MAX_ELEMENTS else 'chunked'


def default_scale(head_dim: int) -> float:
  """1 / sqrt(H), the logits' default multiplier: it keeps their variance near 1 whatever the
  head size, so softmax does not saturate (Vaswani et al. 2017, section 3.2.1)."""
  return 1.0 / math.sqrt(head_dim)


def scores(
  qg: Array,
  k: Array,
  scale: float,
  bias: Array | None = None,
  *,
  form: str = 'grouped',
  softcap: float | None = None,
) -> Array:
  """The attention logits of every softmax path (dense, chunked, one decoding step): q.k * scale
  in float32 (bfloat16 exp/sum over S keys loses too much), soft-capped to softcap * tanh(. /
  softcap) where `softcap` is set (Gemma 2), plus an additive bias (ALiBi).

  qg: queries grouped by kv head `[B, T, K, G, H]` (query head n = k * G + g, so the G heads
  that share kv head k line up against it without repeating k); k: `[B, S, K, H]`; bias:
  broadcastable to `[B, K, G, T, S]`. form: how the product is written, which XLA:CPU runs at
  different speeds (same values, other rounding): 'grouped', one 5-d einsum; 'merged' (G = 1),
  the heads merged into the batch, a plain batched matmul; 'step' (T = 1), the query axis out
  of the product. Returns float32 `[B, K, G, T, S]`.
  """
  B, T, K, G, H = qg.shape
  S = k.shape[1]
  if form == 'step':
    logits = jnp.einsum('bkgh,bskh->bkgs', qg[:, 0], k, preferred_element_type=jnp.float32)
    logits = (logits * scale)[:, :, :, None]  # [B, K, G, 1, S]
  elif form == 'merged':
    qt = qg.reshape(B, T, K, H).transpose(0, 2, 1, 3).reshape(B * K, T, H)
    kt = k.transpose(0, 2, 1, 3).reshape(B * K, S, H)
    logits = jnp.matmul(qt, kt.transpose(0, 2, 1), preferred_element_type=jnp.float32)
    logits = (logits.reshape(B, K, T, S) * scale)[:, :, None]  # [B, K, G, T, S]
  else:
    logits = jnp.einsum('btkgh,bskh->bkgts', qg, k, preferred_element_type=jnp.float32) * scale
  logits = logits if softcap is None else softcap * jnp.tanh(logits / softcap)  # Gemma 2's cap
  return logits if bias is None else logits + bias


def xla_attention(
  q,
  k,
  v,
  *,
  mask,
  scale,
  alibi_slopes,
  chunk_size=None,
  return_probs=False,
  dropout=None,
  hooks=None,
  softcap=None,
):
  """Reference: dense logits and mask. Returns out, or (out, probs) if return_probs.

  `dropout=(rate, rng)` drops attention probabilities (the returned probs are before dropout).
  `hooks=(on_scores, on_pattern)` see the scores [B, N, T, S] (-inf where masked) and the
  probabilities, and may replace them (masked entries stay masked).
  """
  B, T, N, H = q.shape  # chunk_size is unused: everything is materialised
  S, K = k.shape[1], k.shape[2]
  f32 = jnp.float32
  bias = None
  if alibi_slopes is not None:
    bias = alibi_bias(alibi_slopes, jnp.arange(T), jnp.arange(S)).reshape(K, -1, T, S)
  merged = K == N and not return_probs and dropout is None and hooks is None
  form = 'merged' if merged else 'grouped'
  # [B, K, G, T, S]
  logits = scores(q.reshape(B, T, K, N // K, H), k, scale, bias, form=form, softcap=softcap)
  if merged:  # one kv head per query head: the product with v is a plain batched matmul too
    visible = mask.dense(T, S)  # [B or 1, 1, T, S]
    logits = jnp.where(visible, logits.reshape(B, N, T, S), NEG)
    probs = jnp.where(visible, jax.nn.softmax(logits, axis=-1), 0.0)  # fully masked rows -> 0
    vt = v.transpose(0, 2, 1, 3).reshape(B * N, S, H)
    out = jnp.matmul(probs.reshape(B * N, T, S).astype(v.dtype), vt, preferred_element_type=f32)
    return out.reshape(B, N, T, H).transpose(0, 2, 1, 3).astype(q.dtype)  # [B, T, N, H]
  visible = mask.dense(T, S)[:, :, None]  # [B or 1, 1, 1, T, S]
  if hooks is not None:  # [B, K, G, T, S] <-> [B, N, T, S]: query head n = k * G + g
    on_scores, on_pattern = hooks
    hooked = on_scores(jnp.where(visible, logits, -jnp.inf).reshape(B, N, T, S))
    logits = hooked.reshape(logits.shape)
  logits = jnp.where(visible, logits, NEG)  # [B, K, G, T, S]
  probs = jnp.where(visible, jax.nn.softmax(logits, axis=-1), 0.0)  # fully masked rows -> 0
  if hooks is not None:
    probs = on_pattern(probs.reshape(B, N, T, S)).reshape(probs.shape)
  weights = probs
  if dropout is not None:
    rate, rng = dropout
    keep = jax.random.bernoulli(rng, 1.0 - rate, probs.shape)
    weights = jnp.where(keep, probs / (1.0 - rate), 0.0)  # inverted dropout: same expectation
  # [B, T, K, G, H]
  out = jnp.einsum('bkgts,bskh->btkgh', weights.astype(v.dtype), v, preferred_element_type=f32)
  out = out.reshape(B, T, N, H).astype(q.dtype)  # [B, T, N, H]
  return (out, probs.reshape(B, N, T, S)) if return_probs else out  # probs: [B, N, T, S]


# name -> fn(q, k, v, *, mask, scale, alibi_slopes, chunk_size) returning out [B, T, N, H]: the
# dense path written above; attention_paths.py registers 'chunked', 'pallas' and 'cudnn'.
_IMPLEMENTATIONS: dict[str, Callable[..., Array]] = {'xla': xla_attention}


def _check_inputs(q, k, v, mask, alibi_slopes, chunk_size):
  for name, x in (('q', q), ('k', k), ('v', v)):
    if x.ndim != 4:
      raise ValueError(f'{name} must have rank 4 [B, length, heads, head_dim]; got {x.shape}')
  B, T, N, H = q.shape  # k, v: [B, S, K, H]
  if k.shape != v.shape:
    raise ValueError(f'k and v must have the same shape [B, S, K, H]; got {k.shape} and {v.shape}')
  if k.shape[0] != B or k.shape[3] != H:
    raise ValueError(f'q {q.shape} and k/v {k.shape} must agree in batch (0) and head_dim (3)')
  S, K = k.shape[1], k.shape[2]
  if N % K:
    raise ValueError(f'num_kv_heads={K} does not divide num_heads={N}; choose a divisor of {N}')
  if not isinstance(mask, MaskSpec):
    raise ValueError(f'mask must be a MaskSpec or None; got {type(mask).__name__}')
  if (mask.q_segment_ids is None) != (mask.kv_segment_ids is None):
    raise ValueError(
      'MaskSpec needs both q_segment_ids and kv_segment_ids, or neither; '
      'for self-attention pass the same ids twice'
    )
  if mask.q_segment_ids is not None:
    for name, ids, want in (('q', mask.q_segment_ids, (B, T)), ('kv', mask.kv_segment_ids, (B, S))):
      if tuple(ids.shape) != want:
        raise ValueError(f'{name}_segment_ids must have shape {list(want)}; got {list(ids.shape)}')
  if alibi_slopes is not None and tuple(alibi_slopes.shape) != (N,):
    raise ValueError(f'alibi_slopes must have shape [{N}]; got {list(alibi_slopes.shape)}')
  if not isinstance(chunk_size, int) or chunk_size < 1:
    raise ValueError(f'chunk_size={chunk_size!r} must be a positive int')


def dot_product_attention(
  q: Array,
  k: Array,
  v: Array,
  *,
  mask: MaskSpec | None = MaskSpec(),
  scale: float | None = None,
  implementation: str | None = None,
  return_probs: bool = False,
  alibi_slopes: Array | None = None,
  chunk_size: int = 128,
  dropout_rate: float = 0.0,
  dropout_rng: Array | None = None,
  hooks: tuple[Callable[[Array], Array], Callable[[Array], Array]] | None = None,
  softcap: float | None = None,
) -> Array | tuple[Array, Array]:
  """Multi-head (and grouped-query) scaled dot-product attention.

  Query head n reads kv head n // (N // K). Logits, softmax and logsumexp run in float32;
  fully masked query rows return exactly 0 (and 0 gradient).

  Args:
    q: queries `[B, T, N, H]`.
    k: keys `[B, S, K, H]`, with K dividing N.
    v: values `[B, S, K, H]`.
    mask: which keys each query sees; None means all of them.
    scale: logit multiplier; None means 1 / sqrt(H), 1.0 means no scaling.
    implementation: one of 'xla', 'chunked', 'pallas', 'cudnn' (or a registered name);
      None chooses with `select_implementation`.
    return_probs: also return the attention probabilities (only 'xla').
    alibi_slopes: optional `[N]` slopes; adds -slope[n] * |i - j| to the logits of head n.
    chunk_size: keys per block for 'chunked'.
    dropout_rate: dropout on the attention probabilities (needs 'xla' and `dropout_rng`).
    dropout_rng: PRNG key for that dropout.
    softcap: caps the scaled logits to softcap * tanh(logits / softcap) (Gemma 2), on 'xla' and
      'chunked'.
    hooks: with return_probs, (on_scores, on_pattern): functions of the float32 scores
      [B, N, T, S] (scaled, ALiBi added, -inf where masked) and of the probabilities, each
      returning the values the attention goes on with (the hook points of `MultiHeadAttention`).

  Returns:
    out `[B, T, N, H]` in q.dtype; with return_probs, (out, probs float32[B, N, T, S]).
  """
  mask = MaskSpec() if mask is None else mask
  _check_inputs(q, k, v, mask, alibi_slopes, chunk_size)
  if implementation is None:
    implementation = select_implementation(q.shape[1], k.shape[1], return_probs=return_probs)
  if implementation not in _IMPLEMENTATIONS:
    raise ValueError(
      f'implementation={implementation!r} is not one of '
      f'{sorted(_IMPLEMENTATIONS)} (or None to choose automatically)'
    )
  if return_probs and implementation != 'xla':
    raise ValueError(
      f"return_probs=True needs implementation='xla' (or None); got {implementation!r}"
    )
  if dropout_rate > 0 and (implementation != 'xla' or dropout_rng is None):
    raise ValueError(
      f"dropout_rate={dropout_rate} on attention probabilities needs implementation='xla' and a "
      f'dropout_rng; got implementation={implementation!r}'
    )
  if softcap is not None and (implementation not in ('xla', 'chunked') or alibi_slopes is not None):
    raise ValueError(
      f"softcap={softcap} needs implementation='xla' or 'chunked' (or None) and no ALiBi; got "
      f'implementation={implementation!r}'
    )
  scale = default_scale(q.shape[-1]) if scale is None else scale
  kwargs = dict(mask=mask, scale=scale, alibi_slopes=alibi_slopes, chunk_size=chunk_size)
  if softcap is not None:
    kwargs['softcap'] = softcap
  # Only the dense path materialises the probabilities [B, N, T, S], to return or drop out.
  if return_probs or dropout_rate > 0:
    dropout = (dropout_rate, dropout_rng) if dropout_rate > 0 else None
    return xla_attention(q, k, v, return_probs=return_probs, dropout=dropout, hooks=hooks, **kwargs)
  return _IMPLEMENTATIONS[implementation](q, k, v, **kwargs)  # [B, T, N, H]


# KV cache for decoding ---------------------------------------------------------------------
class CacheMode(NamedTuple):
  """How `MultiHeadAttention` uses its KV cache (the flax collection 'cache') while decoding.

  'prefill' runs a whole prompt through the configured implementation and writes its keys and
  values into a fresh cache: `length` slots for self attention, the encoder's S keys for cross
  attention. 'step' runs one token per row: self attention writes its key/value at the row's
  position (positions double as cache slots) and attends to slots <= that position; cross
  attention reuses the encoder's cached keys/values. Each cache leaf is `[B, L, K, H]` (a scanned
  stack prepends a layer axis).
  """

  phase: str  # 'prefill' | 'step'
  length: int  # L: self-attention slots = longest prompt + tokens to generate


# The attention kinds ---------------------------------------------------------------------------
class Kind(NamedTuple):
  """One kind of attention (`ModelConfig.attention`): three functions of the calling
  `MultiHeadAttention` m, which owns the projections, positions and hook points around them.

  attend(m, q, k, v, mask, alibi_slopes, self_attention, prefill, dropout, return_probs):
    a whole sequence, q [B, T, N, H] over k, v [B, S, K, H] -> out [B, T, N, H], or (out, probs
    [B, N, T, S]) with return_probs. prefill: a prompt being written into a cache.
  cache(m, mode, k, v, self_attention, mask, positions): decoding; writes this call's keys and
    values (or a state) into the 'cache' collection and returns what to attend to.
  step(m, q, k, v, self_attention, mask, positions, alibi_slopes): decoding, one token per row
    q [B, 1, N, H] against what `cache` returned -> [B, 1, N, H].
  """

  attend: Callable
  cache: Callable
  step: Callable


class MultiHeadAttention(nn.Module):
  """Self or cross attention: q/k/v/out projections around `dot_product_attention`, or around
  `linear_attention.linear_attention` (cfg.attention='linear'; its cache is then a fixed-size
  state), or `compressed_attention.compressed_attention` ('compressed', self attention only).

  Positions that act on q and k (RoPE) or on the logits (ALiBi) are applied here, for self
  attention only; absolute positions are added to the embeddings by the model. The hook points
  (`hook_q`, `hook_k`, `hook_v`, `hook_attn_scores`, `hook_pattern`, `hook_z`) follow
  TransformerLens; scores and pattern exist on the dense path only (`return_probs=True`).
  """

  cfg: ModelConfig
  kind: Kind  # the attention kind (`parts.KINDS`): softmax, linear or compressed
  kernel_init: Callable = nn.initializers.xavier_uniform()  # q/k/v projections
  out_init: Callable = nn.initializers.xavier_uniform()  # the output projection
  # RoPE or ALiBi (`parts.RELATIVE_POSITIONS`), in self attention only; None: no relative positions
  relative_positions: Callable | None = None
  qk_norm: Callable | None = None  # Qwen3's norm of queries and keys (`parts.qk_norm`), or None

  @nn.compact
  def __call__(
    self,
    inputs_q: Array,
    inputs_kv: Array | None = None,
    *,
    mask: MaskSpec | None = None,
    positions: Array | None = None,
    deterministic: bool = True,
    return_probs: bool = False,
    cache_mode: CacheMode | None = None,
    per_head: bool = False,
  ):
    """Attends from `inputs_q` [B, T, D] to `inputs_kv` [B, S, D] (None = self attention).

    Args:
      positions: [B, T] integer positions for RoPE/ALiBi in self attention; None = arange(T).
        In the cache's 'step' phase they are required ([B, 1]) and are also the cache slots.
      return_probs: also return the attention probabilities [B, N, T, S] (the 'xla' path).
      cache_mode: decoding with a KV cache (see `CacheMode`); needs mutable=['cache'].
      per_head: also project each head on its own ([B, T, N, D], `hook_result`), at N times the
        memory of the output; only `hooks.run` asks for it.
    Returns:
      [B, T, D], or ([B, T, D], [B, N, T, S]) with return_probs.
    """
    self_attention = inputs_kv is None
    if cache_mode is not None:
      _check_cache(cache_mode, self_attention, mask, positions, return_probs)
    q, k, v = self._project(inputs_q, inputs_q if self_attention else inputs_kv)  # S = T in self
    alibi_slopes = None
    if self.relative_positions is not None:  # RoPE or ALiBi, positions [B or 1, T]
      positions = jnp.arange(q.shape[1])[None] if positions is None else positions
      q, k, alibi_slopes = self.relative_positions(self.cfg, q, k, positions)
    if cache_mode is None:
      dropout = self.cfg.attention_dropout_rate > 0 and not deterministic  # training only
      out = self.kind.attend(self, q, k, v, mask, alibi_slopes, self_attention, False, dropout,
                             return_probs)  # fmt: skip
    else:  # decoding: fill the cache, or add one token to it
      out = self._decode(cache_mode, q, k, v, self_attention, mask, positions, alibi_slopes)
    out, probs = out if return_probs else (out, None)  # probs: [B, N, T, S] or None
    out = HookPoint(name='hook_z')(constrain(out, HEADS))  # [B, T, N, H]
    # The output projection contracts heads and head_dim together: [B, T, N, H] -> [B, T, D].
    cfg, axes = self.cfg, ('heads', 'kv', 'embed')
    project = dense(cfg, cfg.d_model, axes, 'out', self.out_init, cfg.use_bias, (-2, -1), True)
    y = self._per_head(project, out) if per_head else project(out)
    return (y, probs) if return_probs else y

  def _decode(self, mode: CacheMode, q, k, v, self_attention, mask, positions, alibi_slopes):
    """Writes this call's keys and values (or the kind's state) into the cache; then a prompt
    ('prefill') attends as a whole sequence does, and a step ([B, 1, N, H]) against the cache."""
    k, v = self.kind.cache(self, mode, k, v, self_attention, mask, positions)
    if mode.phase == 'step':
      return self.kind.step(self, q, k, v, self_attention, mask, positions, alibi_slopes)
    return self.kind.attend(self, q, k, v, mask, alibi_slopes, self_attention, True, False, False)

  def _per_head(self, project: nn.DenseGeneral, z: Array) -> Array:
    """The output projection [B, T, D] beside hook_result, each head's output projected on its
    own [B, T, N, D] (TransformerLens's, no bias). The output comes from the projection as
    usual, bit for bit, unless a hook hands back other results: then it is their sum plus the
    bias, as in TransformerLens."""
    dtype = self.cfg.compute_dtype
    weights = project.variables['params']  # kernel [N, H, D], bias [D]
    result = jnp.einsum('btnh,nhd->btnd', z, weights['kernel'].astype(dtype))  # [B, T, N, D]
    hooked = HookPoint(name='hook_result')(result)
    if hooked is result:
      return project(z)
    y = hooked.sum(2)  # [B, T, D]
    return y + weights['bias'].astype(dtype) if 'bias' in weights else y

  def _project(self, inputs_q: Array, inputs_kv: Array) -> tuple[Array, Array, Array]:
    """q [B, T, N, H], k and v [B, S, K, H] (GQA: K <= N kv heads, each shared by G = N // K
    query heads; K = N is plain multi-head attention), then Qwen3's q/k norm."""
    cfg, H, init = self.cfg, self.cfg.head_size, self.kernel_init
    bias = cfg.use_bias if cfg.qkv_bias is None else cfg.qkv_bias  # Qwen2: q/k/v biases only
    q = dense(cfg, (cfg.num_heads, H), ('embed', 'heads', 'kv'), 'query', init, bias, matmul=True)
    k = dense(cfg, (cfg.kv_heads, H), ('embed', 'kv_heads', 'kv'), 'key', init, bias, matmul=True)
    v = dense(cfg, (cfg.kv_heads, H), ('embed', 'kv_heads', 'kv'), 'value', init, bias, matmul=True)
    q, k, v = q(inputs_q), k(inputs_kv), v(inputs_kv)  # [B, T, N, H], [B, S, K, H], [B, S, K, H]
    q = HookPoint(name='hook_q')(constrain(q, HEADS))  # [B, T, N, H]
    k = HookPoint(name='hook_k')(constrain(k, KV_HEADS))  # [B, S, K, H]
    v = HookPoint(name='hook_v')(constrain(v, KV_HEADS))  # [B, S, K, H]
    if self.qk_norm is not None:  # per head, over H, before RoPE
      q, k = self.qk_norm(name='query_norm')(q), self.qk_norm(name='key_norm')(k)  # same shapes
    return q, k, v


# The logical axes of q, z [B, T, N, H] and k, v [B, S, K, H] (config.mesh.rules map them to
# mesh axes).
HEADS, KV_HEADS = ('batch', 'length', 'heads', 'kv'), ('batch', 'length', 'kv_heads', 'kv')


@functools.cache
def logit_scale(cfg: ModelConfig) -> float:
  """The logits' multiplier: 1/sqrt(head_size) (Gemma: 1/sqrt(query_pre_attn_scalar)), or 1.0
  for the unscaled ablation."""
  return default_scale(cfg.query_pre_attn_scalar or cfg.head_size) if cfg.attention_scale else 1.0


@functools.cache
def softcap_kwargs(cfg: ModelConfig) -> dict:
  """The implementations' softcap keyword, where the model caps its logits (Gemma 2)."""
  return {} if cfg.attention_softcap is None else {'softcap': cfg.attention_softcap}


def softmax_attend(m, q, k, v, mask, alibi_slopes, self_attention, prefill, dropout,
                   return_probs):  # fmt: skip
  """softmax(q.k * scale) v through the configured implementation (None: by the shapes); the
  dense 'xla' path where the probabilities are returned, hooked or dropped out."""
  cfg, mask = m.cfg, MaskSpec() if mask is None else mask  # the mask says what each query sees
  kwargs = dict(mask=mask, scale=logit_scale(cfg), alibi_slopes=alibi_slopes,
                chunk_size=cfg.attention_chunk_size, **softcap_kwargs(cfg))  # fmt: skip
  if return_probs or dropout:  # the probabilities exist on the dense path only
    hooks = None
    if return_probs:
      hooks = (HookPoint(name='hook_attn_scores'), HookPoint(name='hook_pattern'))
    drop = (cfg.attention_dropout_rate, m.make_rng('dropout')) if dropout else None
    return xla_attention(q, k, v, return_probs=return_probs, dropout=drop, hooks=hooks, **kwargs)
  implementation = cfg.attention_impl or select_implementation(q.shape[1], k.shape[1])
  return _IMPLEMENTATIONS[implementation](q, k, v, **kwargs)  # [B, T, N, H]


def _check_cache(mode: CacheMode, self_attention: bool, mask, positions, return_probs: bool):
  if mode.phase not in ('prefill', 'step'):
    raise ValueError(f"CacheMode.phase={mode.phase!r} must be 'prefill' or 'step'")
  if return_probs:
    raise ValueError('return_probs=True is not available while decoding with a KV cache')
  if mode.phase == 'step' and self_attention and positions is None:
    raise ValueError("CacheMode step needs positions [B, 1]: the slot of each row's token")
  if self_attention and (mask is None or not mask.causal):
    raise ValueError('a KV cache needs causal self attention; pass a MaskSpec with causal=True')
