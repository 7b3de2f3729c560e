"""Matrix-vector products for a decode step of a few tokens: y = x @ W.T, W read once.

At batch 1 a linear layer is a matrix-vector product: every weight is read once and used
once, so the time is the bytes of W over the memory bandwidth. A general matmul library
tiles for reuse that is not there, and at one row of x its kernels move a small layer's
weights at a fraction of what the memory gives. Here each program takes a block of output
features, streams their rows of W (contiguous in memory) through registers, and keeps the
products of each block of K apart until the end, so the loop is loads and fused
multiply-adds with no reduction across threads until the last step.

The blocks are chosen by the shape: enough programs that every SM has several in flight,
rows of W read in long contiguous runs, and no more partial sums per thread than its
registers hold (past that they spill to memory, and a large model's gate_up projection
ran at half the matmul library's speed). Which of a few block shapes is fastest, and
whether any beats the library, is measured on the device at start-up
(`engine/kernel_choice.py`); `gemv_candidates` lists the shapes it tries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.gemv_mma import MMA_ROWS, MmaBlocks, mma_candidates, mma_gemv  # [ch26]

MAX_ROWS = 8  # rows of x (tokens) this kernel takes; beyond it the matmul library wins
# >>> ch26 the CUDA cores take up to FMA_ROWS rows; the tensor cores up to MMA_ROWS
FMA_ROWS = MAX_ROWS
MAX_ROWS = MMA_ROWS
FMA_TRIED = 4  # the most rows at which the start-up measurement tries the CUDA cores' GEMV
# <<< ch26
Blocks = tuple[int, int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps
ACC_PER_THREAD = 64  # fp32 partial sums a thread keeps: more spill out of its registers


@triton.jit
def _gemv_kernel(
    X, W, Y, BIAS, R, R_OUT, NW, eps, M, N, K, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    # GATED: W is [gate; up] (2N rows) and y = silu(x @ gate.T) * (x @ up.T), [M, N].
    # NORM: the input is RMSNorm(x + r) with weight NW; program 0 also writes x + r to R_OUT.
    # The norm's scale is one number per row of x, so it is taken out of the sum: one pass
    # adds up (x + r) * NW * W and the squares of x + r, and the scale multiplies at the end.
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask, n_mask = rm < M, rn < N
    w_ptrs = W + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    x_offs = rm[:, None] * stride_xm + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    squares = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    if GATED:
        up_ptrs = w_ptrs + N * stride_wn
        acc_up = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = rk < K - k
        x_mask = m_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if GATED:
            u = tl.load(up_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
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
        acc += x[:, None, :] * w.to(tl.float32)[None, :, :]
        if GATED:
            acc_up += x[:, None, :] * u.to(tl.float32)[None, :, :]
            up_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        x_offs += BLOCK_K
    dtype = Y.dtype.element_ty
    y = tl.sum(acc, axis=2)
    if GATED:
        y_up = tl.sum(acc_up, axis=2)
    if NORM:
        rstd = tl.rsqrt(tl.sum(squares, axis=1) / K + eps)[:, None]
        y *= rstd
        if GATED:
            y_up *= rstd
    if HAS_BIAS:
        y += tl.load(BIAS + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if GATED:  # rounded to the model dtype first, as the unfused matmul's output is
        gate = y.to(dtype).to(tl.float32)
        up = y_up.to(dtype).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
    y_ptrs = Y + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, y.to(dtype), mask=m_mask[:, None] & n_mask[None, :])


def gemv_blocks(m: int, n: int, k: int, gated: bool = False) -> Blocks:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for x [m, k] @ W[n, k].T (n per half if gated).

    From a sweep on the H200 (tools/bench_gemv.py --sweep) of Qwen3-0.6B's shapes: one warp
    per program, a few rows each, about 1,000-2,000 programs, and K in two or three blocks;
    then K in shorter blocks where the partial sums would not fit in a thread's registers."""
    if m > FMA_ROWS:  # [ch26]
        return mma_candidates(n, k, gated)[0]  # [ch26]
    block_m = triton.next_power_of_2(m)
    block_n = max(1, min(4, triton.next_power_of_2(n // 1536 + 1) // 2))
    block_k = 512 if k <= 1024 else 1024
    return block_m, block_n, _fit(block_m * block_n * (1 + gated), block_k, 1), 1


def gemv_candidates(m: int, n: int, k: int, gated: bool = False) -> list[Blocks]:
    """The block shapes the start-up measurement tries: `gemv_blocks`; one with more bytes
    in flight per program (a whole row of W, up to 4096 values, read by several warps at
    once), which suits narrow projections whose few programs leave SMs waiting; and at one
    row, one of eight rows of W per program, the best of the H200's sweeps of Llama-3.2-1B's
    qkv and gate_up with their norms folded in (6.7 and 21.1 us, against 7.4 and 22.1 for
    the norm kernel and the library's matmul)."""
    # >>> ch26 a few rows on the tensor cores (kernels/gemv_mma.py): at 2 to FMA_TRIED rows
    # with `gemv_blocks`, past that alone. In two H100 tables of four models the GEMV's other
    # shapes never won past one row, nor any of its shapes at 8, and each is a build more on a
    # fresh machine.
    mma = mma_candidates(n, k, gated) if m > 1 else []
    if m > FMA_TRIED:
        return mma
    if mma:
        return [gemv_blocks(m, n, k, gated), *mma]
    # <<< ch26
    block_m = triton.next_power_of_2(m)
    block_k = min(triton.next_power_of_2(k), 4096)
    warps = max(1, min(8, block_m * (1 + gated) * block_k // (32 * 32)))
    wide = (block_m, 1, _fit(block_m * (1 + gated), block_k, warps), warps)
    default = gemv_blocks(m, n, k, gated)
    found = [default] if wide == default else [default, wide]
    if block_m == 1:  # eight rows of W a program share the work on x (a folded norm's)
        tall = (1, 8, min(256 if gated else 1024, block_k), 1 if gated else 4)
        found += [tall] if tall not in found else []
    return found


def _fit(rows: int, block_k: int, warps: int) -> int:
    """The longest BLOCK_K, at most `block_k`, whose `rows` partial-sum rows fit in registers."""
    while block_k > 128 and rows * block_k > ACC_PER_THREAD * 32 * warps:
        block_k //= 2
    return block_k


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    blocks: Blocks | None = None,
    gated: bool = False,
    norm: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """x [m, k] (m <= MAX_ROWS) @ weight [n, k].T (+ bias [n]) -> [m, n], x's dtype.

    gated: weight holds [gate; up] and the result is silu(x @ gate.T) * (x @ up.T), [m, n/2]
    (a merged gate_up projection and the SiLU-and-mul after it, in one kernel).
    norm = (residual, residual_out, norm_weight, eps): the input is RMSNorm(x + residual)
    instead of x (the residual add and the norm before a projection, in the same kernel),
    and x + residual is written to residual_out, a tensor of x's shape apart from both."""
    m, k = x.shape
    n = weight.size(0) // 2 if gated else weight.size(0)
    # >>> ch26 the tensor cores' launches (MmaBlocks) go to their own kernel
    blocks = blocks or gemv_blocks(m, n, k, gated)
    if isinstance(blocks, MmaBlocks):
        return mma_gemv(x, weight, blocks, bias, gated, norm)
    # <<< ch26
    assert m <= MAX_ROWS and weight.size(1) == k and weight.stride(1) == 1 and x.stride(1) == 1
    assert not (gated and bias is not None)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    residual, residual_out, norm_weight, eps = norm or (x, x, x, 0.0)
    if norm is not None:
        assert (
            residual.shape == x.shape and residual.stride() == residual_out.stride() == x.stride()
        )
    block_m, block_n, block_k, warps = blocks or gemv_blocks(m, n, k, gated)
    assert block_m >= m
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, y, bias if bias is not None else weight, residual, residual_out, norm_weight,
        eps, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
        GATED=gated, NORM=norm is not None, num_warps=warps,
    )  # fmt: skip
    return y
