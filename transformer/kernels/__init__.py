"""Pallas flash-attention kernels behind one `[B, T, N, H]` API, `flash_attention`.

With backend=None the target device picks the kernel: on Hopper and newer NVIDIA GPUs (sm90+: H100,
H200) the Mosaic GPU kernel (`mosaic_gpu.py`) for bf16/fp16 at head dims 64, 128 or 256; on other
GPUs, dtypes and head dims the Triton kernel (`gpu.py`); on TPU the Mosaic TPU kernel (`tpu.py`).
Elsewhere backend=None needs interpret=True, which runs the Triton kernel in the Pallas interpreter.
All of them mask by one rule, `masks.visible`.
"""

from transformer.kernels.flash_attention import BlockSizes, flash_attention

__all__ = ['BlockSizes', 'flash_attention']
