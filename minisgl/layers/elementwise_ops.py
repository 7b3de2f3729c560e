"""Which kernels the norms and the activation run on a GPU: ours, or FlashInfer's.

Chapter 19 gave RMSNorm and SiLU-and-mul FlashInfer's fused kernels. FlashInfer compiles
them on first use, and on a fresh machine that took about half a minute of the server's
start-up, paid even by an engine whose attention is our own Triton kernel. So the layers
ask here first: our Triton kernels (`kernels/elementwise.py`, compiled in seconds and
cached) take the work unless FlashInfer is the attention backend, whose JIT is paid at
start-up anyway. MINISGL_FUSED_KERNELS=0 turns both off: the layers' torch code runs.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from minisgl import core
from minisgl.env import ENV


@functools.cache
def _elementwise() -> ModuleType | None:
    try:  # imported when first asked for: triton may be missing, and it is slow to import
        from minisgl.kernels import elementwise
    except ImportError:
        return None
    return elementwise


def flashinfer_attends() -> bool:
    """Whether the running engine's attention backend is FlashInfer. Without an engine (a
    layer run on its own), no."""
    ctx = core._GLOBAL_CTX  # read, not asserted: layers also run without an engine
    return ctx is not None and ctx.attn_backend.name == "fi"


def _half_on_gpu(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def elementwise_ops(x: torch.Tensor) -> ModuleType | None:
    """`minisgl.kernels.elementwise` (rmsnorm, fused_add_rmsnorm, silu_and_mul) where it can
    take `x`, bf16/fp16 on CUDA, and FlashInfer is not the attention backend; else None."""
    if not (_half_on_gpu(x) and ENV.FUSED_KERNELS.value) or flashinfer_attends():
        return None
    return _elementwise()
