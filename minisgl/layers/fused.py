"""FlashInfer's fused CUDA kernels for the small element-wise steps of a decoder layer.

At batch 1 a decode step is hundreds of tiny kernels, and a CUDA graph removes their
launch cost but not their count. RMSNorm in plain torch is five kernels, residual add
plus RMSNorm six, SiLU-and-mul three, rotary a dozen: FlashInfer does each in one. The
layers ask `fused_ops(x)` and fall back to their plain torch code (the reference, and the
only path on CPU) when it returns None.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from minisgl.env import ENV


@functools.cache
def _flashinfer() -> ModuleType | None:
    try:
        import flashinfer
    except ImportError:
        return None
    return flashinfer


def fused_ops(x: torch.Tensor) -> ModuleType | None:
    """The flashinfer module when it can take `x` (a bf16/fp16 CUDA tensor), else None."""
    if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)):
        return None
    if not ENV.FUSED_KERNELS.value:
        return None
    return _flashinfer()
