"""Which kernels the norms and the activation run on a GPU: ours, or FlashInfer's.

Chapter 19 gave RMSNorm and SiLU-and-mul FlashInfer's fused kernels. FlashInfer compiles
them on first use, and on a fresh machine that took about half a minute of the server's
start-up, paid even by an engine whose attention is our own Triton kernel. So our Triton
kernels (`kernels/elementwise.py`, compiled in seconds and cached) take the work unless
FlashInfer is the attention backend, whose JIT is paid at start-up anyway: the kernel plan
(layers/kernel_plan.py) asks `elementwise_ops` once, at start-up, and installs the answer.
MINISGL_FUSED_KERNELS=0 turns both off: the layers' torch code runs.
"""

from __future__ import annotations

import functools
from types import ModuleType


@functools.cache
def _elementwise() -> ModuleType | None:
    try:  # imported when first asked for: triton may be missing, and it is slow to import
        from minisgl.kernels import elementwise
    except ImportError:
        return None
    return elementwise


def elementwise_ops(fused: bool, attention: str) -> ModuleType | None:
    """`minisgl.kernels.elementwise` (rmsnorm, fused_add_rmsnorm, silu_and_mul) where fused
    kernels may run (bf16/fp16 on CUDA, MINISGL_FUSED_KERNELS on) and FlashInfer is not the
    attention backend (`attention`, the backend's name); else None."""
    return _elementwise() if fused and attention != "fi" else None
