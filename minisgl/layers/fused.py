"""FlashInfer's fused CUDA kernels for the small element-wise steps of a decoder layer.

At batch 1 a decode step is hundreds of tiny kernels, and a CUDA graph removes their
launch cost but not their count. RMSNorm in plain torch is five kernels, residual add
plus RMSNorm six, SiLU-and-mul three, rotary a dozen: FlashInfer does each in one. The
kernel plan (layers/kernel_plan.py) installs these on the layers at start-up, where the
model runs in bf16/fp16 on a GPU and flashinfer is installed; elsewhere the layers keep
their plain torch code (the reference, and the only path on CPU).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch


@functools.cache
def flashinfer() -> ModuleType | None:
    try:
        import flashinfer
    except ImportError:
        return None
    return flashinfer


def rope(fi: ModuleType):
    """RotaryEmbedding.rotate in FlashInfer's kernel (in place), to install on one."""
    apply = fi.rope.apply_rope_with_cos_sin_cache_inplace

    def rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        apply(positions, q, k, q.size(-1), self.cos_sin, is_neox=True)
        return q, k

    return rotate
