"""Pallas flash-attention kernels (GPU via Triton, TPU via Mosaic) behind one `[B, T, N, H]` API."""

from transformer.kernels.flash_attention import (
  BlockSizes,
  flash_attention,
  flash_attention_reference,
)

__all__ = ['BlockSizes', 'flash_attention', 'flash_attention_reference']
