"""FlashInfer's fused CUDA kernels for the small element-wise steps of a decoder layer.

At batch 1 a decode step is hundreds of tiny kernels, and a CUDA graph removes their
launch cost but not their count. RMSNorm in plain torch is five kernels, residual add
plus RMSNorm six, SiLU-and-mul three, rotary a dozen: FlashInfer does each in one. The
layers ask `fused_ops(x)` and fall back to their plain torch code (the reference, and the
only path on CPU) when it returns None.
"""

from __future__ import annotations

import functools
import importlib  # [ch20]
from collections.abc import Callable  # [ch20]
from dataclasses import dataclass  # [ch20]
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


# >>> ch20 our own Triton kernels, imported when first asked for (triton may be missing)
@functools.cache
def _triton_kernel(module: str, name: str) -> Callable | None:
    try:
        return getattr(importlib.import_module(f"minisgl.kernels.{module}"), name)
    except ImportError:  # no triton
        return None


def _on_gpu_in_half(x: torch.Tensor) -> bool:
    """bf16/fp16 on CUDA, with the fused kernels allowed: where our kernels take over."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and ENV.FUSED_KERNELS.value


def rope_store_kernel(x: torch.Tensor) -> Callable | None:
    """`kernels.rope_store.qk_rope_store` (q/k head norms, rotary and the KV store in one)
    when it can take `x` (bf16/fp16 on CUDA), else None."""
    return _triton_kernel("rope_store", "qk_rope_store") if _on_gpu_in_half(x) else None


def gemv_kernel(x: torch.Tensor) -> Callable | None:
    """`kernels.gemv.gemv` when `x` is a few rows (at most MINISGL_GEMV_MAX_ROWS) of bf16/fp16
    activations on CUDA: a decode step of a small batch, where the matmul library moves the
    weights at a fraction of the memory's speed. Else None."""
    if not (_on_gpu_in_half(x) and x.dim() == 2 and x.size(0) <= ENV.GEMV_MAX_ROWS.value):
        return None
    if x.stride(1) != 1:  # the kernel reads each row of x contiguously
        return None
    return _triton_kernel("gemv", "gemv")


@dataclass
class NormedInput:
    """RMSNorm(x + residual), not computed yet: the projection it feeds does the add and the
    norm in its own GEMV kernel (`RMSNorm.forward_add` hands this out where that projection
    can take it), which saves a kernel and a pass over memory per norm. `residual_out`
    receives x + residual, the residual stream after the add."""

    x: torch.Tensor
    residual: torch.Tensor
    residual_out: torch.Tensor
    weight: torch.Tensor
    eps: float

    def gemv_args(self) -> dict:
        return dict(norm=(self.residual, self.residual_out, self.weight, self.eps))


# <<< ch20
