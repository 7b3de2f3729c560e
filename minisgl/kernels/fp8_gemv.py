"""FP8 weights on the GPU: a matrix-vector product that reads them as stored, and the
quantiser that feeds activations to the FP8 matmul of larger batches.

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

`quantize_groups` is one half of the FP8 matmul that larger batches use (torch's
`_scaled_mm`): it maps each row of activations, or each group of its columns, into FP8's
range with a scale of its own, one program per group (with a residual add and RMSNorm in
front, where a norm was deferred to the projection).

`fp8_mma_gemv` is the other way to a few rows: x quantised per row too, then W streamed
through the tensor cores against x's rows padded to 16. Where the GEMV's partial sums do not
fit in registers (a gated projection, several rows) it is the faster; the start-up
measurement (engine/kernel_choice.py) decides per projection and row count.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

MAX_ROWS = 8  # rows of x (tokens) the kernel takes
FP8_MAX = tl.constexpr(448.0)  # the largest finite float8_e4m3fn (a constexpr: kernels read it)


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


@triton.jit
def _round_to_e4m3(x):
    """x (fp32, |x| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, still
    in fp32: 3 mantissa bits, and below 2^-6 (the subnormals) steps of 2^-9. The cast that
    follows is then exact, so every GPU and Triton's interpreter (whose own fp32-to-FP8
    conversion misrounds where the mantissa carries, 124.7 to 64) store the same bytes."""
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(exponent, -6) - 3  # the step is 2^e; both powers of two are exact
    step = ((e + 127) << 23).to(tl.float32, bitcast=True)
    per_step = ((127 - e) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23: adding and taking it away rounds to an integer, ties even
    return ((x * per_step + magic) - magic) * step


@triton.jit
def _quantize_kernel(
    X, Q, S, R, R_OUT, NW, eps, K, stride_xm, stride_qm, stride_sm, stride_sg,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    # NORM (one group per row): x is RMSNorm(x + r) with weight NW, and x + r goes to R_OUT
    row, group = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    cols = group * GROUP + offs
    mask = (offs < GROUP) & (cols < K)
    x = tl.load(X + row * stride_xm + cols, mask=mask, other=0.0)
    if NORM:  # as RMSNorm computes it: the sum in the model dtype, the norm in fp32
        x = (x.to(tl.float32) + tl.load(R + row * stride_xm + cols, mask=mask, other=0.0)).to(
            X.dtype.element_ty
        )
        tl.store(R_OUT + row * stride_xm + cols, x, mask=mask)
        x = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
        x = (x * rstd).to(X.dtype.element_ty) * tl.load(NW + cols, mask=mask, other=0.0)
    x = x.to(tl.float32)
    # divisions rounded as IEEE (and torch) round them: a GPU's default may be 2 ulp off
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12), FP8_MAX)
    q = _round_to_e4m3(tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX))
    tl.store(Q + row * stride_qm + cols, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + row * stride_sm + group * stride_sg, scale)


def quantize_groups(
    x: torch.Tensor,
    group: int,
    norm: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] -> (q [m, k] float8_e4m3fn, scales [m, ceil(k / group)] fp32), x ≈ q * scale
    group by group. Several groups' scales are laid out column by column (strides (1, m)),
    as the block-scaled matmul reads them; one group's are the per-row scales [m, 1].
    norm = (residual, residual_out, norm_weight, eps), one group per row: what is quantised
    is RMSNorm(x + residual), and x + residual is written to residual_out."""
    m, k = x.shape
    assert x.stride(1) == 1 and (norm is None or group >= k)
    groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    if groups > 1:  # column-major: the layout of cuBLAS's 1x128 recipe
        scales = torch.empty((groups, m), dtype=torch.float32, device=x.device).t()
    else:
        scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    residual, residual_out, norm_weight, eps = norm or (x, x, x, 0.0)
    if norm is not None:
        assert residual.stride() == residual_out.stride() == x.stride()
    block = triton.next_power_of_2(group)
    _quantize_kernel[(m, groups)](
        x, q, scales, residual, residual_out, norm_weight, eps, k, x.stride(0), q.stride(0),
        scales.stride(0), scales.stride(1), GROUP=group, BLOCK=block, NORM=norm is not None,
        num_warps=min(8, max(1, block // 1024)),
    )  # fmt: skip
    return q, scales


# ---- a few rows on the tensor cores: x in FP8 too --------------------------------------


class MmaBlocks(NamedTuple):
    """The launch of `fp8_mma_gemv`: output features per program, K per step, warps, and
    the steps of W in flight (stages of Triton's software pipeline)."""

    block_n: int
    block_k: int
    warps: int
    stages: int


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
