"""A few rows of x against W on the tensor cores: the GEMV for 2 to 16 tokens.

kernels/gemv.py's GEMV multiplies on the CUDA cores and keeps a partial sum per row of x,
output feature and element of its K block in registers. At one row that is the fastest way
through W; at four rows its sums no longer fit, its K blocks shrink, and it ran a gated
projection at half the matmul library's speed. Yet a decode step of a few requests, or a
verify step of a request and its drafts, still reads every weight once for few rows: the
time should be the bytes of W, as at one row.

Here the rows of x, padded to 16, are the narrow side of a tensor-core product: each
program takes BLOCK_N rows of W and multiplies them, BLOCK_K at a time, against x^T
[BLOCK_K, 16], so the partial sums are one [BLOCK_N, 16] tile whatever the rows. Triton
pipelines the loads of W (`stages` blocks in flight). The norm before the projection and
the SiLU-and-mul after it fold in as in the GEMV: x + r is added, squared and summed as it
streams past, scaled by the norm's weight before the product, and the one number per row
of the norm's scale multiplies the sums at the end.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

MMA_ROWS = 16  # rows of x this kernel takes: the narrow side of the tensor cores' product


class MmaBlocks(NamedTuple):
    """A launch of `mma_gemv`: output features per program, K per step, warps, and the steps
    of W in flight (Triton's software pipeline). A NamedTuple, so the GEMV's table can hold
    it beside the GEMV's own blocks and `gemv` tells them apart."""

    block_n: int
    block_k: int
    warps: int
    stages: int


@triton.jit(do_not_specialize=["M"])  # one build serves every row count
def _mma_gemv_kernel(
    X, W, Y, BIAS, R, R_OUT, NW, eps, M, N, K, stride_xm, stride_wn, stride_ym,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
    NORM: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # y^T [BLOCK_N, 16] = W [BLOCK_N, K] @ x^T [K, 16]. Rows of W past N are read as row 0
    # (never stored), so only K's tail, where K % BLOCK_K != 0, masks the loads of W.
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, 16)
    rk = tl.arange(0, BLOCK_K)
    m_mask, n_mask = rm < M, rn < N
    w_ptrs = W + tl.where(n_mask, rn, 0)[:, None].to(tl.int64) * stride_wn + rk[None, :]
    x_offs = rm[None, :] * stride_xm + rk[:, None]  # x^T: K down, rows of x across
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    squares = tl.zeros((16,), dtype=tl.float32)
    if GATED:
        up_ptrs = w_ptrs + N * stride_wn
        acc_up = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x_mask = m_mask[None, :]
            w = tl.load(w_ptrs)
        else:
            k_mask = rk < K - k
            x_mask = m_mask[None, :] & k_mask[:, None]
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
        xt = tl.load(X + x_offs, mask=x_mask, other=0.0)
        if NORM:  # x + r, rounded to the model dtype as the unfused add is
            xt = xt.to(tl.float32) + tl.load(R + x_offs, mask=x_mask, other=0.0).to(tl.float32)
            xt = xt.to(X.dtype.element_ty)
            if pid == 0:
                tl.store(R_OUT + x_offs, xt, mask=x_mask)
            s = xt.to(tl.float32)
            squares += tl.sum(s * s, axis=0)
            nw = tl.load(NW + k + rk, mask=rk < K - k, other=0.0).to(tl.float32)
            xt = (s * nw[:, None]).to(X.dtype.element_ty)
        acc = tl.dot(w, xt, acc, input_precision=PRECISION)
        if GATED:
            if EVEN_K:  # noqa: SIM108 - a constexpr branch
                u = tl.load(up_ptrs)
            else:
                u = tl.load(up_ptrs, mask=k_mask[None, :], other=0.0)
            acc_up = tl.dot(u, xt, acc_up, input_precision=PRECISION)
            up_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        x_offs += BLOCK_K
    dtype = Y.dtype.element_ty
    y = acc
    if NORM:
        rstd = tl.rsqrt(squares / K + eps)[None, :]
        y *= rstd
        if GATED:
            acc_up *= rstd
    if HAS_BIAS:
        y += tl.load(BIAS + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    if GATED:  # rounded to the model dtype first, as the unfused matmul's output is
        gate = y.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
    y_ptrs = Y + rm[None, :] * stride_ym + rn[:, None]
    tl.store(y_ptrs, y.to(dtype), mask=m_mask[None, :] & n_mask[:, None])


def mma_candidates(n: int, k: int, gated: bool = False) -> list[MmaBlocks]:
    """The launches the start-up measurement tries, the best of an H100 sweep of 88 tiles
    at 16 rows on SmolLM2-135M's, Qwen3-0.6B's and Qwen3-8B's projections and of the
    per-projection tables at 2-16 rows: 16 features by 256 of K for o, down and the LM head
    (16 by 512 was as fast on down); 64 by 256, three deep, for qkv; for gate_up (twice the
    weights a program) 64 by 64 four deep on the small models and 64 by 256 unpipelined on
    the 8B. Taking all of a short K in one step was tried and lost, a gated one by 20x."""
    if gated:
        return [MmaBlocks(64, 64, 4, 4), MmaBlocks(64, 256, 4, 1)]
    return [MmaBlocks(16, 256, 2, 4), MmaBlocks(64, 256, 4, 3)]


def mma_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    blocks: MmaBlocks,
    bias: torch.Tensor | None = None,
    gated: bool = False,
    norm: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """x [m, k] (m <= MMA_ROWS) @ weight [n, k].T (+ bias [n]) -> [m, n] on the tensor
    cores; gated and norm as kernels.gemv.gemv, whose arguments these are."""
    m, k = x.shape
    n = weight.size(0) // 2 if gated else weight.size(0)
    assert m <= MMA_ROWS and weight.size(1) == k and weight.stride(1) == 1 and x.stride(1) == 1
    assert not (gated and bias is not None) and weight.dtype == x.dtype
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    residual, residual_out, norm_weight, eps = norm or (x, x, x, 0.0)
    if norm is not None:
        assert (
            residual.shape == x.shape and residual.stride() == residual_out.stride() == x.stride()
        )
    _mma_gemv_kernel[(triton.cdiv(n, blocks.block_n),)](
        x, weight, y, bias if bias is not None else weight, residual, residual_out, norm_weight,
        eps, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_N=blocks.block_n, BLOCK_K=blocks.block_k, HAS_BIAS=bias is not None,
        GATED=gated, NORM=norm is not None, EVEN_K=k % blocks.block_k == 0,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=blocks.warps, num_stages=blocks.stages,
    )  # fmt: skip
    return y
