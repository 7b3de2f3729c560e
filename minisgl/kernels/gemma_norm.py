"""Gemma's RMSNorm (Gemma 3, Gemma 4, Qwen3.5) in chapter 20's norm kernel.

Llama's norm rounds x / rms(x) to the model dtype and then scales it by the weight; Gemma's
scales by a float32 weight first and rounds once (models/gemma3.GemmaRMSNorm). In torch
that is six to nine small kernels a norm: on Qwen3.5-0.8B's decode step at batch 1, 49
norms cost more device time than its 18 Gated DeltaNet layers' recurrences. Chapter 20's
kernel does it in one pass with `SCALE_FIRST`, and the residual add with it.
"""

from __future__ import annotations

import torch

from minisgl.kernels.elementwise import _check_norm_args, _norm_launch, _rmsnorm_kernel
from minisgl.kernels.pdl import pdl_enabled, pdl_launch


def gemma_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(x / rms(x) * weight) in float32, rounded to x's dtype. x: 2-D, or a 3-D [tokens,
    heads, head_dim] view of a wider tensor (read where it lies)."""
    _check_norm_args(x, weight)
    n = x.size(-1)
    if x.stride(-1) != 1 or x.dim() not in (2, 3):
        x = x.reshape(-1, n).contiguous()
    heads, stride_h = (x.size(1), x.stride(1)) if x.dim() == 3 else (1, 0)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows := y.numel() // max(n, 1):
        _rmsnorm_kernel[(rows,)](
            x, x, weight, y, eps, n, heads, x.stride(0), stride_h, 0, n, ADD=False,
            SCALE_FIRST=True, **_norm_launch(n), **pdl_launch(pdl_enabled(x)),
        )  # fmt: skip
    return y


def gemma_fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual <- x + residual (rounded), x <- gemma_rmsnorm(residual). Returns
    (x, residual). x and residual: [tokens, features], one dtype, rows contiguous."""
    _check_norm_args(x, weight)
    if x.shape != residual.shape or x.dim() != 2 or x.dtype != residual.dtype:
        raise ValueError(
            f"gemma_fused_add_rmsnorm takes x and residual of one 2-D shape and dtype; got "
            f"{tuple(x.shape)} {x.dtype} and {tuple(residual.shape)} {residual.dtype}"
        )
    if x.stride(-1) != 1 or residual.stride(-1) != 1:
        raise ValueError("gemma_fused_add_rmsnorm writes in place: rows must be contiguous")
    rows, n = x.shape
    if rows:
        _rmsnorm_kernel[(rows,)](
            x, residual, weight, x, eps, n, 1, x.stride(0), 0, residual.stride(0), x.stride(0),
            ADD=True, SCALE_FIRST=True, **_norm_launch(n), **pdl_launch(pdl_enabled(x)),
        )  # fmt: skip
    return x, residual
