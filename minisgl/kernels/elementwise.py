"""RMSNorm, residual add + RMSNorm and SiLU-and-mul: the small steps between projections.

Each is one pass over memory in one kernel where plain torch takes three to six. They do
what FlashInfer's kernels of the same names do (chapter 19), and exist for one reason:
FlashInfer compiles its kernels on first use, and on a fresh machine that took half a
minute of the server's start-up, paid even by an engine whose attention is ours. Triton
compiles these in a second or two, and its cache keeps them.

The rounding follows the layers' torch references step by step, so that bf16 results equal
theirs to the last bit (or one unit in the last place, where an fp32 sum is taken in
another order): the residual sum is rounded to the model dtype before its statistics are
taken, the normed value is rounded before it is scaled by the weight, and silu(gate) is
rounded before it multiplies up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_NORM_WIDTH = 65536  # one program holds a whole row in registers
SILU_BLOCK = 1024  # columns of the output per program: an MLP's width is up to ~25K


@triton.jit
def _rmsnorm_kernel(
    X, R, W, Y, eps, N, heads, stride_xt, stride_xh, stride_rt, stride_yt,
    BLOCK: tl.constexpr, ADD: tl.constexpr,
    SCALE_FIRST: tl.constexpr = False,  # [ch29]
):  # fmt: skip
    # One program per row. Rows of X are addressed as (token, head) so that a [tokens,
    # heads, head_dim] view of a wider qkv needs no copy; a 2-D X has heads == 1.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x_ptrs = X + (row // heads) * stride_xt + (row % heads) * stride_xh + cols
    s = tl.load(x_ptrs, mask=mask, other=0.0)
    if ADD:  # x + residual, rounded to the model dtype and written back as the new residual
        r_ptrs = R + row * stride_rt + cols
        s = (s.to(tl.float32) + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(
            X.dtype.element_ty
        )
        tl.store(r_ptrs, s, mask=mask)
    s = s.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(s * s, axis=0) / N + eps)
    normed = (s * rstd).to(X.dtype.element_ty).to(tl.float32)
    if SCALE_FIRST:  # Gemma's norms: a float32 weight scales before the one rounding  # [ch29]
        normed = s * rstd  # [ch29]
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_yt + cols, (normed * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(X, Y, N, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (silu * up).to(Y.dtype.element_ty), mask=mask)


def _norm_launch(n: int) -> dict:
    if n > MAX_NORM_WIDTH:
        raise ValueError(f"RMSNorm over {n} features; this kernel takes at most {MAX_NORM_WIDTH}")
    block = triton.next_power_of_2(n)
    return dict(BLOCK=block, num_warps=max(1, min(16, block // 256)))


def _check_norm_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or x.size(-1) != weight.size(0):
        raise ValueError(
            f"RMSNorm weight of shape {tuple(weight.shape)} does not fit rows of "
            f"{x.size(-1)} features"
        )
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device}, the RMSNorm weight on {weight.device}")


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dimension, in a new tensor of x's shape. x: 2-D or
    3-D (a [tokens, heads, head_dim] view of a wider tensor is read where it lies)."""
    _check_norm_args(x, weight)
    shape, n = x.shape, x.size(-1)
    if x.stride(-1) != 1 or x.dim() not in (2, 3):
        x = x.reshape(-1, n).contiguous()
    heads = x.size(1) if x.dim() == 3 else 1
    stride_h = x.stride(1) if x.dim() == 3 else 0
    y = torch.empty(shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rows = y.numel() // n if n else 0
    if rows:
        _rmsnorm_kernel[(rows,)](
            x, x, weight, y, eps, n, heads, x.stride(0), stride_h, 0, n, ADD=False,
            **_norm_launch(n),
        )  # fmt: skip
    return y


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place, as FlashInfer's: residual <- x + residual, then x <- RMSNorm(residual).
    x and residual: [tokens, features] of the same dtype, each row contiguous."""
    _check_norm_args(x, weight)
    if x.shape != residual.shape or x.dim() != 2 or x.dtype != residual.dtype:
        raise ValueError(
            f"fused_add_rmsnorm takes x and residual of one 2-D shape and dtype; got "
            f"{tuple(x.shape)} {x.dtype} and {tuple(residual.shape)} {residual.dtype}"
        )
    if x.stride(-1) != 1 or residual.stride(-1) != 1:
        raise ValueError("fused_add_rmsnorm writes in place: rows must be contiguous")
    rows, n = x.shape
    if rows:
        _rmsnorm_kernel[(rows,)](
            x, residual, weight, x, eps, n, 1, x.stride(0), 0, residual.stride(0), x.stride(0),
            ADD=True, **_norm_launch(n),
        )  # fmt: skip


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] on the last dimension: [..., 2n] -> [..., n]."""
    if gate_up.size(-1) % 2:
        raise ValueError(f"silu_and_mul takes [gate | up], an even width; got {gate_up.size(-1)}")
    n = gate_up.size(-1) // 2
    x = gate_up.reshape(-1, 2 * n)
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(x.size(0), n, dtype=gate_up.dtype, device=gate_up.device)
    if y.numel():
        grid = (x.size(0), triton.cdiv(n, SILU_BLOCK))
        _silu_and_mul_kernel[grid](x, y, n, x.stride(0), n, BLOCK=SILU_BLOCK, num_warps=4)
    return y.reshape(*gate_up.shape[:-1], n)
