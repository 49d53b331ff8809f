"""TransformerLens's weight processing: fold the norms into the next matrices, centre what writes
the residual stream and the unembedding, fold the value biases into the output bias, and (off by
default, as there) refactor each head's QK and OV products into an even, orthogonal factorisation.

The processed model gives the same log-probabilities; its logits move by one constant per
position (`center_unembed`), and its residual stream has mean zero over d_model, so each part of a
decomposition is what the final norm sees. It applies to pre-LN LayerNorm models with biases, as
GPT-2; the norms keep scale 1 and bias 0, which compute what TransformerLens's LayerNormPre does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from transformer.config import ModelConfig
from transformer.model import scan


def process_weights(
  cfg: ModelConfig,
  params: Any,
  *,
  fold_ln: bool = True,
  center_writing_weights: bool = True,
  center_unembed: bool = True,
  fold_value_biases: bool = True,
  refactor_factored_attn_matrices: bool = False,
) -> tuple[ModelConfig, dict]:
  """(config, parameters) of the processed model, with TransformerLens's defaults: the first four
  on, the refactoring off.

  The output projection is untied from the embedding (centring one must not move the other) and
  gets a bias, TransformerLens's b_U, which holds the final norm's folded bias.
  `refactor_factored_attn_matrices` keeps each head's W_Q W_K^T (biases included) and W_V W_O
  and chooses their factors as TransformerLens does (`_refactor`): the logits stay the same, and
  hook_q, hook_k, hook_v and hook_z hold the new factorisation's values.
  """
  _check(cfg)
  if refactor_factored_attn_matrices and cfg.position == 'rope':
    raise ValueError(
      "refactor_factored_attn_matrices cannot keep the QK product with position='rope', which "
      'rotates queries and keys by their positions; load without it'
    )
  p = _numpy(scan.unscan_params(cfg, params))
  stack, layers = p['decoder']['stack'], [f'layer_{i}' for i in range(cfg.num_layers)]
  head = {'kernel': p['embedding']['embedding'].T.copy(), 'bias': np.zeros(cfg.vocab_size)}
  for layer in layers:
    block = stack[layer]
    if fold_ln:
      attn = block['self_attention']
      _fold(block['self_attention_norm'], [attn['query'], attn['key'], attn['value']])
      _fold(block['mlp_norm'], [block['mlp']['wi']])
    if center_writing_weights:  # what each sub-layer adds to the stream gets mean 0 over D
      for dense in (block['self_attention']['out'], block['mlp']['wo']):
        dense['kernel'] -= dense['kernel'].mean(-1, keepdims=True)
        dense['bias'] -= dense['bias'].mean()
    if fold_value_biases:  # each attention row sums to 1, so b_V reaches the stream as b_V W_O
      attn = block['self_attention']
      attn['out']['bias'] += np.einsum('nh,nhd->d', attn['value']['bias'], attn['out']['kernel'])
      attn['value']['bias'] = np.zeros_like(attn['value']['bias'])
    if refactor_factored_attn_matrices:
      _refactor(block['self_attention'])
  if fold_ln:
    _fold(stack['final_norm'], [head])
  if center_writing_weights:
    for table in _embedding_tables(cfg, p):
      table -= table.mean(-1, keepdims=True)
  if center_unembed:  # a constant over the vocabulary does not change the softmax
    head['kernel'] -= head['kernel'].mean(-1, keepdims=True)
    head['bias'] -= head['bias'].mean()
  p['head'] = {'logits': head}
  p = _cast(p, np.dtype(cfg.param_dtype))
  return cfg.replace(tie_output=False, output_bias=True, scan_layers=False), p


def _check(cfg: ModelConfig) -> None:
  ok = cfg.family == 'causal_lm' and cfg.norm_placement == 'pre' and cfg.norm == 'layernorm'
  ok = ok and cfg.use_bias and cfg.norm_bias and cfg.qkv_bias is not False and not cfg.qk_norm
  ok = ok and cfg.num_kv_heads in (None, cfg.num_heads)  # one value bias per head
  if not ok or cfg.activation == 'swiglu' or not cfg.d_ff:
    raise ValueError(
      "process_weights needs a pre-LN causal_lm with norm='layernorm', biases everywhere and a "
      f'two-matrix MLP (GPT-2); this one has family={cfg.family!r}, norm={cfg.norm!r}, '
      f'norm_placement={cfg.norm_placement!r}, use_bias={cfg.use_bias}, '
      f'activation={cfg.activation!r}, d_ff={cfg.d_ff}, num_kv_heads={cfg.num_kv_heads}'
    )


def _fold(norm: dict, denses: list[dict]) -> None:
  """Folds a LayerNorm's weight w and bias b into the projections that read it: x W + c of
  (x_hat w + b) is x_hat (w W) + (b W + c); then each column of W is centred over the input
  axis, which x_hat (mean 0) cannot see. The norm keeps w = 1 and b = 0."""
  w, b = norm['scale'], norm['bias']
  for dense in denses:
    kernel = dense['kernel']  # [D, ...]
    dense['bias'] = dense['bias'] + np.tensordot(b, kernel, axes=1)
    kernel = kernel * w.reshape(-1, *[1] * (kernel.ndim - 1))
    dense['kernel'] = kernel - kernel.mean(0, keepdims=True)
  norm['scale'], norm['bias'] = np.ones_like(w), np.zeros_like(b)


def _refactor(attn: dict) -> None:
  """TransformerLens's refactoring of one layer's heads. QK: with the biases as one more input
  row (an input whose last coordinate is 1), W_Q W_K^T = U S V^T gives W_Q = U sqrt(S) and
  W_K = V sqrt(S). OV: b_V moves into b_O (each attention row sums to 1), then W_V W_O = U S V^T
  gives W_V = U S and W_O = V^T, a rotation. U, S and V come from TransformerLens's
  FactoredMatrix.svd steps (`_svd`, which also fixes each pair's sign)."""
  q, k, v, o = attn['query'], attn['key'], attn['value'], attn['out']

  def with_bias(dense):  # [D, N, H] kernel and [N, H] bias -> [N, D + 1, H]
    return np.concatenate([dense['kernel'].transpose(1, 0, 2), dense['bias'][:, None]], axis=1)

  u, s, vv = _svd(with_bias(q), with_bias(k).transpose(0, 2, 1))
  for dense, factor in ((q, u * np.sqrt(s)[:, None]), (k, vv * np.sqrt(s)[:, None])):
    dense['kernel'], dense['bias'] = factor[:, :-1].transpose(1, 0, 2), factor[:, -1]
  o['bias'] = o['bias'] + np.einsum('nh,nhd->d', v['bias'], o['kernel'])
  v['bias'] = np.zeros_like(v['bias'])
  u, s, vv = _svd(v['kernel'].transpose(1, 0, 2), o['kernel'])  # [N, D, H] @ [N, H, D]
  v['kernel'], o['kernel'] = (u * s[:, None]).transpose(1, 0, 2), vv.transpose(0, 2, 1)


def _svd(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(U, S, V) with a @ b = U diag(S) V^T, per head, from the factors' own SVDs and that of the
  small product between them, as TransformerLens's FactoredMatrix computes it.

  A singular pair's sign is arbitrary, and LAPACK builds choose differently (torch's MKL and
  NumPy's OpenBLAS disagree on most columns of the same matrix), so TransformerLens's signs
  depend on its machine. Here each pair is flipped so that the largest entry of U's column is
  positive: the same factors on every machine, equal to TransformerLens's up to each pair's sign.
  """
  ua, sa, vha = np.linalg.svd(a, full_matrices=False)
  ub, sb, vhb = np.linalg.svd(b, full_matrices=False)
  middle = sa[..., :, None] * vha @ ub * sb[..., None, :]
  um, sm, vhm = np.linalg.svd(middle, full_matrices=False)
  u, v = ua @ um, vhb.transpose(0, 2, 1) @ vhm.transpose(0, 2, 1)
  largest = np.take_along_axis(u, np.abs(u).argmax(-2)[..., None, :], axis=-2)  # [N, 1, H]
  signs = np.where(largest < 0, -1.0, 1.0)
  return u * signs, sm, v * signs


def _embedding_tables(cfg: ModelConfig, p: dict) -> list[np.ndarray]:
  """The tables the embeddings add to the stream: the tokens' and learned positions'."""
  tables = [p['embedding']['embedding']]
  if cfg.position == 'learned':
    tables.append(p['decoder']['embedder']['positions']['positions']['embedding'])
  return tables


def _numpy(tree: Any) -> Any:
  """A float64 NumPy copy of a parameter tree, so the arithmetic above adds no rounding."""
  if isinstance(tree, dict):
    return {k: _numpy(v) for k, v in tree.items()}
  return np.array(tree, np.float64)


def _cast(tree: Any, dtype: np.dtype) -> Any:
  if isinstance(tree, dict):
    return {k: _cast(v, dtype) for k, v in tree.items()}
  return tree.astype(dtype)
