"""FP8 activations: the quantiser that feeds the FP8 matmul of larger batches.

`quantize_groups` is one half of the FP8 matmul that larger batches use (torch's
`_scaled_mm`): it maps each row of activations, or each group of its columns, into FP8's
range with a scale of its own, one program per group (with a residual add and RMSNorm in
front, where a norm was deferred to the projection). `_round_to_e4m3` is the rounding every
kernel that stores FP8 shares (the KV cache's store too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # the largest finite float8_e4m3fn (a constexpr: kernels read it)


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
