"""Gemma's RMSNorm (Gemma 3, Gemma 4, Qwen3.5) in chapter 20's norm kernel.

Llama's norm rounds x / rms(x) to the model dtype and then scales it by the weight; Gemma's
scales by a float32 weight first and rounds once (models/gemma3.GemmaRMSNorm). In torch
that is six to nine small kernels a norm: on Qwen3.5-0.8B's decode step at batch 1, 49
norms cost more device time than its 18 Gated DeltaNet layers' recurrences. Chapter 20's
kernel does it in one pass with `SCALE_FIRST`, and the residual add with it.

Gemma 4 normalises each block's output before it joins the residual stream, then (after
attention) normalises the sum again for the MLP, and scales the stream by a per-layer
number at the end of the layer: `gemma_norm_add` does a norm, the add, the scale and the
next norm in one pass, where torch ran three to five kernels. Gemma's gate is GELU (tanh)
where Llama's is SiLU: `gelu_and_mul` is it and the product in one kernel (the MLP's, and
Gemma 4's per-layer embedding gate), where torch ran two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.elementwise import _check_norm_args, _norm_launch, _rmsnorm_kernel


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
            SCALE_FIRST=True, **_norm_launch(n),
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
            ADD=True, SCALE_FIRST=True, **_norm_launch(n),
        )  # fmt: skip
    return x, residual


# `scaled` and `then` are arguments, not constants: one build serves a layer's three block
# ends (each a Triton build, a second or so of a fresh machine's start-up)
@triton.jit(do_not_specialize=["scaled", "then"])
def _norm_add_kernel(
    Y, X, W, S, W2, X_OUT, N_OUT, eps, N, scaled, then,
    stride_y, stride_x, stride_xo, stride_no, BLOCK: tl.constexpr,
):  # fmt: skip
    # One program per row, each step rounded to the model dtype as torch's would be:
    # X_OUT = (X + norm(Y) * W) [* S if scaled]; if then, N_OUT = norm(X_OUT) * W2.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dtype = X.dtype.element_ty
    y = tl.load(Y + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    normed = (y * tl.math.rsqrt(tl.sum(y * y, axis=0) / N + eps) * w).to(dtype)
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    s = (x.to(tl.float32) + normed.to(tl.float32)).to(dtype)
    scale = tl.where(scaled != 0, tl.load(S).to(tl.float32), 1.0)  # times 1: exact
    s = (s.to(tl.float32) * scale).to(dtype)
    tl.store(X_OUT + row * stride_xo + cols, s, mask=mask)
    if then != 0:
        s32 = s.to(tl.float32)
        w2 = tl.load(W2 + cols, mask=mask, other=0.0).to(tl.float32)
        out = s32 * tl.math.rsqrt(tl.sum(s32 * s32, axis=0) / N + eps) * w2
        tl.store(N_OUT + row * stride_no + cols, out.to(dtype), mask=mask)


def gemma_norm_add(
    y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    scale: torch.Tensor | None = None,
    next_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x + gemma_rmsnorm(y, weight)) times `scale` (one number) if given, and with
    `next_weight` that sum's gemma_rmsnorm by it (the next block's input), else None.
    y and x: [tokens, features] of one dtype; x is not written."""
    _check_norm_args(y, weight)
    if x.shape != y.shape or x.dim() != 2 or x.dtype != y.dtype:
        raise ValueError(
            f"gemma_norm_add takes y and x of one 2-D shape and dtype; got "
            f"{tuple(y.shape)} {y.dtype} and {tuple(x.shape)} {x.dtype}"
        )
    if scale is not None and scale.numel() != 1:
        raise ValueError(f"gemma_norm_add scales by one number; got {scale.numel()}")
    if next_weight is not None:
        _check_norm_args(y, next_weight)
    y, x = (t if t.stride(-1) == 1 else t.contiguous() for t in (y, x))
    rows, n = x.shape
    out = torch.empty_like(x)
    normed = torch.empty_like(x) if next_weight is not None else None
    if rows:
        _norm_add_kernel[(rows,)](
            y, x, weight, scale if scale is not None else weight,
            next_weight if next_weight is not None else weight, out,
            normed if normed is not None else out, eps, n, int(scale is not None),
            int(next_weight is not None), y.stride(0), x.stride(0), out.stride(0),
            out.stride(0), **_norm_launch(n),
        )  # fmt: skip
    return out, normed


GELU_BLOCK = 1024  # columns a program of `gelu_and_mul`


@triton.jit
def _gelu_and_mul_kernel(G, U, Y, N, stride_g, stride_u, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    # 0.5 g (1 + tanh(z)), z = sqrt(2 / pi) (g + 0.044715 g^3); 1 + tanh(z) = 2 / (1 + e^-2z),
    # which does not cancel where tanh(z) is near -1
    z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    gelu = (g / (1.0 + tl.exp(tl.minimum(-2.0 * z, 80.0)))).to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (gelu * u).to(Y.dtype.element_ty), mask=mask)


def gelu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GELU (tanh approximation) of gate, times up: [tokens, n] each, one dtype; either may
    be a view of a wider tensor (the halves of a gate_up, one layer's slice of the per-layer
    inputs)."""
    if gate.shape != up.shape or gate.dim() != 2 or gate.dtype != up.dtype:
        raise ValueError(
            f"gelu_and_mul takes gate and up of one 2-D shape and dtype; got "
            f"{tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}"
        )
    gate, up = (t if t.stride(-1) == 1 else t.contiguous() for t in (gate, up))
    rows, n = gate.shape
    y = torch.empty(rows, n, dtype=gate.dtype, device=gate.device)
    if rows and n:
        grid = (rows, triton.cdiv(n, GELU_BLOCK))
        _gelu_and_mul_kernel[grid](
            gate, up, y, n, gate.stride(0), up.stride(0), y.stride(0), BLOCK=GELU_BLOCK,
            num_warps=4,
        )  # fmt: skip
    return y
