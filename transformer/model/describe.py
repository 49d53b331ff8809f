"""A readable summary of a model: its architecture, parameters per module and FLOPs per token."""

from __future__ import annotations

import math

import jax

from transformer.config import ModelConfig
from transformer.model import models


def param_table(cfg: ModelConfig, depth: int = 2) -> list[tuple[str, int]]:
  """Parameter counts grouped by the first `depth` levels of the parameter tree."""
  counts: dict[str, int] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(models.param_shapes(cfg))[0]:
    key = '/'.join(str(getattr(p, 'key', p)) for p in path[:depth])
    counts[key] = counts.get(key, 0) + math.prod(leaf.shape)
  return sorted(counts.items())


def describe(cfg: ModelConfig, seq_len: int | None = None) -> str:
  """A readable summary: the architecture, parameters per module, exact total and FLOPs/token."""
  seq_len = seq_len or cfg.max_length
  layers = f'{cfg.num_layers}'
  if cfg.family == 'encoder_decoder':
    layers = f'{cfg.num_layers} encoder + {cfg.decoder_layers} decoder'
  lines = [
    f'model: {cfg.family}',
    f'  layers {layers}, d_model {cfg.d_model}, d_ff {cfg.d_ff or "0 (attention only)"}, '
    f'heads {cfg.num_heads} (kv {cfg.kv_heads}, head_dim {cfg.head_size}), vocab {cfg.vocab_size}',
    f'  positions {cfg.position} (max_length {cfg.max_length}), {cfg.norm_placement}-{cfg.norm} '
    f'eps {cfg.norm_eps:g}, activation {cfg.activation}, dropout {cfg.dropout_rate:g}',
    f'  attention {cfg.attention_impl or "auto"}, scaled {cfg.attention_scale}, '
    f'window {cfg.window}, dtype {cfg.dtype} (params {cfg.param_dtype}), remat {cfg.remat}, '
    f'scan {cfg.scan_layers}',
    'parameters by module:',
  ]
  total = 0
  for name, count in param_table(cfg):
    lines.append(f'  {name:<40} {count:>14,}')
    total += count
  flops = models.flops_per_token(cfg, seq_len)
  lines += [
    f'parameters: {total}',
    f'training FLOPs per token: {flops["train"]:.4g} (forward {flops["forward"]:.4g}, '
    f'seq_len {seq_len}, matmul parameters {flops["matmul_params"]:,})',
  ]
  return '\n'.join(lines)
