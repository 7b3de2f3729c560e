"""FP8 weights on the GPU: a matrix-vector product that reads them as stored.

A decode step of a few tokens reads every weight once and uses it once, so its time is the
bytes of the weights over the memory's bandwidth: half the bytes, half the time, but only
if the weights cross the memory bus as FP8. This kernel loads one byte per weight, turns
it into fp32 in registers and scales it there, in the shape of chapter 20's GEMV (a block
of output rows per program, products of each block of K kept apart until the end).

Scales come in two layouts. One per output row (what `--quantization fp8` makes): it
multiplies the finished sum of its row, once. One per block of SCALE_N rows x SCALE_K
columns (a Hugging Face FP8 checkpoint): every row of a program lies in one block row
(the host picks BLOCK_N so), so the scale of a column block is the same for all of the
program's rows, and the kernel multiplies x by it instead of W: the same product, with one
load of a scale per column rather than per weight.

`quantize_groups` (fp8_quantize.py) and `fp8_mma_gemv` (fp8_mma.py) are the other ways FP8
weights are used; they are imported here too, so that quant/fp8.py finds every FP8 kernel
in one module.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.fp8_mma import (  # noqa: F401 (quant/fp8.py's one module of FP8 kernels)
    MMA_MAX_ROWS,
    MmaBlocks,
    fp8_mma_candidates,
    fp8_mma_gemv,
)
from minisgl.kernels.fp8_quantize import quantize_groups  # noqa: F401

MAX_ROWS = 8  # rows of x (tokens) the kernel takes


@triton.jit
def _fp8_gemv_kernel(
    X, W, S, Y, BIAS, R, R_OUT, NW, eps, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_SCALES: tl.constexpr,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    # GATED: W is [gate; up] (2N rows) and y = silu(x @ gate.T) * (x @ up.T), [M, N].
    # NORM: the input is RMSNorm(x + r) with weight NW; program 0 also writes x + r to R_OUT.
    # The norm's 1/rms is one number per row of x: it multiplies the finished sums.
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask, n_mask = rm < M, rn < N
    w_ptrs = W + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    x_offs = rm[:, None] * stride_xm + rk[None, :]
    s_row = S + (pid * BLOCK_N // SCALE_N) * stride_sn  # block scales: this program's row
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    squares = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    if GATED:
        up_ptrs = w_ptrs + N * stride_wn
        up_s_row = S + ((N + pid * BLOCK_N) // SCALE_N) * stride_sn
        acc_up = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = rk < K - k
        w_mask = n_mask[:, None] & k_mask[None, :]
        x_mask = m_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        x = tl.load(X + x_offs, mask=x_mask, other=0.0)
        if NORM:  # x + r, rounded to the model dtype as the unfused add is
            x = x.to(tl.float32) + tl.load(R + x_offs, mask=x_mask, other=0.0).to(tl.float32)
            x = x.to(X.dtype.element_ty)
            if pid == 0:
                tl.store(R_OUT + x_offs, x, mask=x_mask)
            x = x.to(tl.float32)
            squares += x * x
            x = x * tl.load(NW + k + rk, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        x = x.to(tl.float32)
        xs = x
        if not ROW_SCALES:
            xs = x * tl.load(s_row + (k + rk) // SCALE_K, mask=k_mask, other=0.0)[None, :]
        acc += xs[:, None, :] * w[None, :, :]
        if GATED:
            u = tl.load(up_ptrs, mask=w_mask, other=0.0).to(tl.float32)
            if not ROW_SCALES:
                xs = x * tl.load(up_s_row + (k + rk) // SCALE_K, mask=k_mask, other=0.0)[None, :]
            acc_up += xs[:, None, :] * u[None, :, :]
            up_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        x_offs += BLOCK_K
    y = tl.sum(acc, axis=2)
    if ROW_SCALES:
        y *= tl.load(S + rn * stride_sn, mask=n_mask, other=0.0)[None, :]
    if GATED:
        y_up = tl.sum(acc_up, axis=2)
        if ROW_SCALES:
            y_up *= tl.load(S + (N + rn) * stride_sn, mask=n_mask, other=0.0)[None, :]
    if NORM:
        rstd = tl.rsqrt(tl.sum(squares, axis=1) / K + eps)[:, None]
        y *= rstd
        if GATED:
            y_up *= rstd
    if HAS_BIAS:
        y += tl.load(BIAS + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    dtype = Y.dtype.element_ty
    if GATED:  # rounded to the model dtype first, as the unfused matmul's output is
        gate = y.to(dtype).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * y_up.to(dtype).to(tl.float32)
    y_ptrs = Y + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, y.to(dtype), mask=m_mask[:, None] & n_mask[None, :])


def fp8_gemv_blocks(
    m: int, n: int, k: int, scale_rows: int = 1, gated: bool = False, on_gpu: bool = True
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for x [m, k] @ W[n, k].T where nothing was
    measured: the first of `fp8_gemv_candidates`. Triton's interpreter (on a CPU) pays per
    program, not per weight: there, fewer and wider programs."""
    if not on_gpu:
        block_n = 32 if scale_rows == 1 else min(32, scale_rows & -scale_rows)
        return triton.next_power_of_2(m), block_n, min(1024, max(16, triton.next_power_of_2(k))), 1
    return fp8_gemv_candidates(m, n, k, scale_rows, gated)[0]


def fp8_gemv_candidates(
    m: int, n: int, k: int, scale_rows: int = 1, gated: bool = False
) -> list[tuple[int, int, int, int]]:
    """The block shapes the start-up measurement tries (engine/kernel_choice.py). From a
    sweep on the H200 of Qwen3-8B's projections at one row (docs/benchmarks.md): programs
    of 4 rows x 512 columns were fastest for the wide projections (qkv, gate_up, the LM head),
    2 or 8 rows x 1,024 for the narrow ones with long rows (o, down); each with the warps
    that keep 64 partial sums per thread (more spill). scale_rows: rows that share a block
    scale (1 for per-row scales); BLOCK_N must divide it."""
    block_m, out = triton.next_power_of_2(m), []
    for block_n, block_k in ((4, 512), (2, 1024), (8, 1024)):
        if scale_rows > 1 and scale_rows % block_n:
            continue
        block_k = min(block_k, max(16, triton.next_power_of_2(k)))
        warps = max(1, block_m * block_n * block_k * (1 + gated) // (32 * 64))
        while warps > 8:
            block_k, warps = block_k // 2, warps // 2
        if (choice := (block_m, block_n, block_k, warps)) not in out:
            out.append(choice)
    return out or [(block_m, 1, min(512, max(16, triton.next_power_of_2(k))), 1)]


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
    gated: bool = False,
    norm: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None,
    blocks: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """x [m, k] (m <= MAX_ROWS) @ (weight [n, k] float8_e4m3fn, dequantised by `scale`).T
    (+ bias) -> [m, n] in x's dtype. `block`: (rows, columns) that share one scale; (1, k)
    is one per row, `scale` [n, 1]; else `scale` is [ceil(n / rows), ceil(k / columns)].

    gated: weight holds [gate; up] and the result is silu(x @ gate.T) * (x @ up.T), [m, n/2].
    norm = (residual, residual_out, norm_weight, eps): the input is RMSNorm(x + residual),
    and x + residual is written to residual_out (as chapter 20's GEMV does)."""
    m, k = x.shape
    n = weight.size(0) // 2 if gated else weight.size(0)
    assert m <= MAX_ROWS and weight.size(1) == k and weight.stride(1) == 1 and x.stride(1) == 1
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert not (gated and bias is not None)
    row_scales = block[0] == 1 and block[1] >= k
    scale_rows, scale_cols = (1, 1) if row_scales else block
    choice = blocks or fp8_gemv_blocks(m, n, k, scale_rows, gated, x.is_cuda)
    block_m, block_n, block_k, warps = choice
    # every program's rows (and its up rows) must lie in one block row of the scales
    assert row_scales or (scale_rows % block_n == 0 and (not gated or n % block_n == 0))
    assert scale.size(1) == 1 or scale.stride(1) == 1
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    residual, residual_out, norm_weight, eps = norm or (x, x, x, 0.0)
    if norm is not None:
        assert (
            residual.shape == x.shape and residual.stride() == residual_out.stride() == x.stride()
        )
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, scale, y, bias if bias is not None else x, residual, residual_out,
        norm_weight, eps, m, n, k, x.stride(0), weight.stride(0), scale.stride(0), y.stride(0),
        SCALE_N=scale_rows, SCALE_K=scale_cols, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, ROW_SCALES=row_scales, HAS_BIAS=bias is not None, GATED=gated,
        NORM=norm is not None, num_warps=warps,
    )  # fmt: skip
    return y
