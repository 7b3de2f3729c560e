"""Where the layers hand their work to our own Triton kernels (minisgl/kernels/), and when.

On a GPU in bf16/fp16 two kernels replace a chain of layer code. `qk_rope_store` takes
qkv to rotated q, with the keys rotated and the values stored in the KV cache on the way.
`gemv` does a projection of a few tokens at the memory's full speed, with the SiLU-and-mul
after it (a gated MLP) and the residual add and RMSNorm before it folded in where asked.
Each function returns None where its kernel does not apply (the CPU, fp32, more tokens
than MINISGL_GEMV_MAX_ROWS, no triton), and the layer runs its own code instead.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from minisgl.core import get_global_ctx
from minisgl.env import ENV

if TYPE_CHECKING:
    from minisgl.layers.attention import AttentionLayer


@functools.cache
def _triton_kernel(module: str, name: str) -> Callable | None:
    # Imported when first asked for: triton may be missing, and it is slow to import.
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


def rope_store(layer: AttentionLayer, qkv: torch.Tensor) -> torch.Tensor | None:
    """The layer's q, normed and rotated, from its qkv in one kernel that also norms and
    rotates k and stores k and v in the KV cache; None where the kernel does not take qkv."""
    kernel = rope_store_kernel(qkv)
    if kernel is None:
        return None
    ctx = get_global_ctx()
    kv = ctx.attn_backend.kv_cache
    norms = hasattr(layer, "q_norm")
    return kernel(
        qkv,
        ctx.batch.positions,
        layer.rotary.cos_sin,
        layer.q_norm.weight if norms else None,
        layer.k_norm.weight if norms else None,
        layer.q_norm.eps if norms else 0.0,
        kv.k_cache(layer.layer_id),
        kv.v_cache(layer.layer_id),
        ctx.batch.out_loc,
        layer.num_heads,
        layer.num_kv_heads,
        layer.head_dim,
    )


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


def defer_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[NormedInput, torch.Tensor] | None:
    """(RMSNorm(x + residual) left to the projection after it, the tensor that will hold
    x + residual) where the GEMV kernel takes x; else None."""
    if gemv_kernel(x) is None:
        return None
    out = torch.empty_like(residual)
    return NormedInput(x, residual, out, weight, eps), out


def gemv_projection(
    x: torch.Tensor | NormedInput,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gated: bool = False,
) -> torch.Tensor | None:
    """x @ weight.T (+ bias) in the GEMV kernel where it takes x, else None. gated: weight is
    a merged [gate; up] and the result silu(gate) * up. A NormedInput is normed in the same
    kernel (`defer_norm` made it only where the kernel takes it)."""
    if isinstance(x, NormedInput):
        norm = (x.residual, x.residual_out, x.weight, x.eps)
        return gemv_kernel(x.x)(x.x, weight, bias, gated=gated, norm=norm)
    if gemv := gemv_kernel(x):
        return gemv(x, weight, bias, gated=gated)
    return None
