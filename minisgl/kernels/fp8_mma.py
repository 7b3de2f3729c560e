"""FP8 weights on the tensor cores: a few rows of x against W, x quantised per row too.

`fp8_mma_gemv` is the other way to a few rows than fp8_gemv.py's GEMV: W streamed
through the tensor cores against x's rows padded to 16. Where the GEMV's partial sums do not
fit in registers (a gated projection, several rows) it is the faster; the start-up
measurement (engine/kernel_choice.py) decides per projection and row count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.gemv_mma import MmaBlocks  # its launch: features, K per step, warps, stages


@triton.jit
def _fp8_mma_gemv_kernel(
    XQ, XS, W, S, Y, BIAS, M, N, K, stride_xm, stride_wn, stride_ym,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    # y^T [BLOCK_N, 16] = W [BLOCK_N, K] @ x^T [K, 16]: the rows of x (up to 16) are the narrow
    # side of the product; W is the wide one, read once, as stored. K % BLOCK_K == 0 and
    # N % BLOCK_N == 0 (the host asks), so no load is masked but x's missing rows.
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, 16)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    w_ptrs = W + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    x_ptrs = XQ + rm[None, :] * stride_xm + rk[:, None]
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    if GATED:
        up_ptrs = w_ptrs + N * stride_wn
        acc_up = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        xt = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
        acc = tl.dot(tl.load(w_ptrs), xt, acc)
        if GATED:
            acc_up = tl.dot(tl.load(up_ptrs), xt, acc_up)
            up_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    xs = tl.load(XS + rm, mask=m_mask, other=0.0)[None, :]  # x's scale per row (column here)
    y = acc * tl.load(S + rn)[:, None] * xs
    if HAS_BIAS:
        y += tl.load(BIAS + rn).to(tl.float32)[:, None]
    dtype = Y.dtype.element_ty
    if GATED:  # rounded to the model dtype first, as the unfused matmul's output is
        up = (acc_up * tl.load(S + N + rn)[:, None] * xs).to(dtype).to(tl.float32)
        gate = y.to(dtype).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(Y + rm[None, :] * stride_ym + rn[:, None], y.to(dtype), mask=m_mask[None, :])


MMA_MAX_ROWS = 16  # rows of x the tensor-core GEMV takes (the narrow side of its product)


def fp8_mma_candidates(n: int, k: int) -> list[MmaBlocks]:
    """The launches the start-up measurement tries, from the H200 sweep of Qwen3-8B's
    projections at one row (the best three for gate_up and the LM head); only those whose
    blocks divide the shape."""
    tried = [MmaBlocks(64, 256, 4, 3), MmaBlocks(64, 128, 4, 4), MmaBlocks(32, 256, 2, 3)]
    return [b for b in tried if n % b.block_n == 0 and k % b.block_k == 0]


def fp8_mma_gemv(
    xq: torch.Tensor,
    xs: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    blocks: MmaBlocks,
    dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """(xq [m, k] FP8 with per-row scales xs [m, 1]) @ (weight [n, k] FP8, per-row scales
    scale [n, 1]).T (+ bias) -> [m, n] in dtype; gated as `fp8_gemv`. What the matmul
    library's FP8 path computes (x quantised per row, both scales on the sums), for at most
    MMA_MAX_ROWS rows, in one kernel that streams W through the tensor cores."""
    m, k = xq.shape
    n = weight.size(0) // 2 if gated else weight.size(0)
    assert m <= MMA_MAX_ROWS and weight.size(1) == k and weight.stride(1) == 1
    assert xq.dtype == weight.dtype == torch.float8_e4m3fn and scale.shape == (weight.size(0), 1)
    assert n % blocks.block_n == 0 and k % blocks.block_k == 0 and xs.stride(0) == 1
    assert not (gated and bias is not None)
    y = torch.empty((m, n), dtype=dtype, device=xq.device)
    _fp8_mma_gemv_kernel[(n // blocks.block_n,)](
        xq, xs, weight, scale, y, bias if bias is not None else scale, m, n, k, xq.stride(0),
        weight.stride(0), y.stride(0), BLOCK_N=blocks.block_n, BLOCK_K=blocks.block_k,
        HAS_BIAS=bias is not None, GATED=gated, num_warps=blocks.warps,
        num_stages=blocks.stages,
    )  # fmt: skip
    return y
