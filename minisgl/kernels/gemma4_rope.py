"""Gemma 4's head norms and rotary in one kernel a tensor.

Between its projections and attention a Gemma 4 layer normalises every query, key and value
head (the value norm has no weight), then turns queries and keys by position. In torch that
is a norm kernel per tensor and, for the rotary, a gather of the angle table's rows, casts,
products, a negation, a concatenation and a sum for each of q and k: about 17 kernels a
layer that stores keys, 10 for a KV-shared one (queries alone), each a microsecond or two
over a few kilobytes at batch 1. Here one program takes one head of one token: it loads the
row once, normalises it (Gemma's way: scaled by the float32 weight, then rounded) and turns
its channel pairs (i with i + head_dim / 2, "neox") by the table row at the token's
position, rounding each product and the sum where torch rounds them, so the result is
torch's (layers/rotary.py, models/gemma4.py) to the last place or near it.

The table holds, per position, the cosines of the pairs and then their sines (the fused
rotary kernels' layout, `RotaryEmbedding.cos_sin`); Gemma 4's global layers turn only a
share of the pairs (proportional RoPE), whose table rows hold zero angles for the rest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rope_kernel(
    X, Y, W, COS_SIN, POS, eps, heads, stride_xt, stride_xh, stride_yt, stride_yh, stride_cs,
    HALF: tl.constexpr, BLOCK: tl.constexpr, ROTATE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    t, h = row // heads, row % heads
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    dtype = Y.dtype.element_ty
    x = X + t * stride_xt + h * stride_xh
    x1 = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
    n1 = (x1 * rstd * tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    n2 = (x2 * rstd * tl.load(W + HALF + offs, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    if ROTATE:  # q * cos + rotate_half(q) * sin, the table cast to the model dtype first
        at = COS_SIN + tl.load(POS + t).to(tl.int64) * stride_cs
        cos = tl.load(at + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
        sin = tl.load(at + HALF + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
        a1, a2 = n1.to(tl.float32), n2.to(tl.float32)
        n1 = ((a1 * cos).to(dtype).to(tl.float32) + (-a2 * sin).to(dtype).to(tl.float32)).to(dtype)
        n2 = ((a2 * cos).to(dtype).to(tl.float32) + (a1 * sin).to(dtype).to(tl.float32)).to(dtype)
    y = Y + t * stride_yt + h * stride_yh
    tl.store(y + offs, n1, mask=mask)
    tl.store(y + HALF + offs, n2, mask=mask)


def norm_rope(
    x: torch.Tensor,  # [tokens, heads, head_dim]: may be a view of a wider qkv
    weight: torch.Tensor,  # [head_dim] float32: the norm's (ones for the value norm)
    eps: float,
    cos_sin: torch.Tensor | None = None,  # [positions, head_dim]: cos of each pair | sin
    positions: torch.Tensor | None = None,  # [tokens]; with cos_sin, the heads are turned
) -> torch.Tensor:
    """Each head normalised (Gemma's norm) and, given the table, turned by its token's
    position: a new contiguous [tokens, heads, head_dim] tensor."""
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"norm_rope takes [tokens, heads, head_dim] rows; got {tuple(x.shape)}")
    tokens, heads, dim = x.shape
    if dim % 2 or weight.shape != (dim,):
        raise ValueError(f"norm_rope: head_dim {dim} must be even and the weight's; got "
                         f"{tuple(weight.shape)}")  # fmt: skip
    rotate = cos_sin is not None
    if rotate and (positions is None or cos_sin.size(-1) != dim):
        raise ValueError(
            "norm_rope turns every channel pair: it needs positions and a table as wide as "
            f"the head ({dim}); got {None if cos_sin is None else cos_sin.size(-1)}"
        )
    y = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    if tokens * heads:
        table = cos_sin if rotate else weight
        pos = positions if rotate else weight
        _norm_rope_kernel[(tokens * heads,)](
            x, y, weight, table, pos, eps, heads, x.stride(0), x.stride(1), y.stride(0),
            y.stride(1), table.stride(0) if rotate else 0, HALF=dim // 2,
            BLOCK=triton.next_power_of_2(dim // 2), ROTATE=rotate,
            num_warps=max(1, min(4, dim // 128)),
        )  # fmt: skip
    return y
