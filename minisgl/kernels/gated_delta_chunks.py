"""A Gated DeltaNet prefill in two passes: every chunk's own work at once, then the walk.

`chunked_varlen` (gated_delta.py) gives each (request, value head, block of v) one program
that walks the request's chunks in order and does all of a chunk's work on the way: q and k
normalised, the gates, the chunk's triangular system solved, the products with the state. A
4,096-token prompt of Qwen3.5-0.8B is then 32 programs on a GPU of 132 SMs, each taking 256
steps one after the other, and most of each step does not need the state at all.

What does need it is little: a chunk's tokens write d = u - w S into the state S it starts
from (u and w come from the chunk alone), read o = (q e^c) S + P d, and leave
S e^c_last + (k e^(c_last - c))^T d behind, where c is the running sum of the chunk's log
decays and P the chunk's causal scores q k^T, decayed. So, in two kernels:

1. `_prepare_kernel`, one program per (chunk, value head), all of them at once: the chunk's
   gates and c, the 64 x 64 lower triangular system (I + A) solved by forward substitution,
   and per token w, u, c and its row of P, into scratch tensors (c in float32, the rest in
   the activations' dtype: half the bytes to move on a GPU, float32 in the CPU's tests).
2. `_walk_kernel`, one program per (request, value head, block of v), its chunks in order:
   four matmuls a chunk with the state in registers (in float32; float16 operands on a GPU),
   64 tokens at a step.

The scratch costs (dk + dv + 64) values and a float a token and value head: 85 MB for 8,192
tokens of Qwen3.5-0.8B's 16 heads in bf16, freed when the layer returns. Lengths and slots
are read on the device, as in gated_delta.py: each chunk program finds its request by a
binary search of the requests' first chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from minisgl.kernels.attention import _dot
from minisgl.kernels.gated_delta import SEARCH, varlen_out
from minisgl.models.families import LinearAttention

CHUNK = 64  # tokens a chunk: the walk's steps are this long


@triton.jit
def _mm(a, b, IEEE: tl.constexpr):
    """a @ b with float32 sums: exact float32 products for the CPU's tests, else float16
    operands (the tensor cores' own type, half the registers of a float32 tile, and three
    more bits than bf16 for the state's values, which stay far inside its range)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a.to(tl.float16), b.to(tl.float16))


@triton.jit
def _normed_rows(x):
    """Each row of x [rows, d] over its L2 norm (the reference's epsilon)."""
    return x / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]


@triton.jit(do_not_specialize=["num_reqs"])
def _prepare_kernel(
    Mixed, A, Bp, ALog, DtBias, Offsets, ChunkOffsets, Wt, U, P, Cs,
    num_reqs, scale,
    stride_m, stride_a, stride_b,
    KEY_DIM: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    PER_KEY: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    CHUNK: tl.constexpr, SEARCH: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    p, hv = tl.program_id(0), tl.program_id(1)
    h = hv // PER_KEY
    # The chunk's request: how many requests' chunks all come before chunk p.
    lo = p * 0
    hi = lo + num_reqs
    for _ in tl.static_range(SEARCH):
        mid = (lo + hi) // 2
        done = tl.load(ChunkOffsets + 1 + tl.minimum(mid, num_reqs - 1))
        lo = tl.where((lo < hi) & (done <= p), mid + 1, lo)
        hi = tl.where((lo < hi) & (done > p), mid, hi)
    r = tl.minimum(lo, num_reqs - 1)
    first = tl.load(ChunkOffsets + r)
    t0 = tl.load(Offsets + r) + (p - first) * CHUNK
    end = tl.load(Offsets + r + 1)
    rows = tl.arange(0, CHUNK)
    t = t0 + rows
    mt = (t < end) & (lo + 0 * rows < num_reqs)  # past the last chunk: nothing to do (a
    # vector: the interpreter takes no scalar in a mask)
    offs_k = tl.arange(0, BLOCK_DK)
    mk = offs_k < DK
    offs_v = tl.arange(0, BLOCK_DV)
    mv = offs_v < DV
    x = Mixed + t[:, None].to(tl.int64) * stride_m
    qk_mask = mt[:, None] & mk[None, :]
    k = tl.load(x + KEY_DIM + h * DK + offs_k[None, :], mask=qk_mask, other=0.0).to(tl.float32)
    k = _normed_rows(k)
    a = tl.load(A + t * stride_a + hv, mask=mt, other=0.0).to(tl.float32)
    a += tl.load(DtBias + hv).to(tl.float32)
    decay_rate = -tl.exp(tl.load(ALog + hv).to(tl.float32))
    g = tl.where(mt, decay_rate * tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a))), 0.0)
    b = tl.load(Bp + t * stride_b + hv, mask=mt, other=0.0).to(tl.float32)
    beta = tl.where(mt, 1.0 / (1.0 + tl.exp(-b)), 0.0)
    c = tl.cumsum(g, axis=0)
    lower = rows[:, None] >= rows[None, :]
    decay = tl.where(lower, tl.exp(tl.where(lower, c[:, None] - c[None, :], 0.0)), 0.0)
    strict = rows[:, None] > rows[None, :]
    a_mat = tl.where(strict, beta[:, None] * decay * _dot(k, tl.trans(k), IEEE), 0.0)
    # (I + A)^-1 by forward substitution: row i is e_i minus A's row i times the rows above
    inv = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for i in range(1, CHUNK):
        a_row = tl.sum(tl.where(rows[:, None] == i, a_mat, 0.0), axis=0)
        above = tl.sum(a_row[:, None] * inv, axis=0)
        inv = tl.where(rows[:, None] == i, inv - above[None, :], inv)
    head = t[:, None].to(tl.int64) * HV + hv  # row of the scratch tensors
    w = _dot(inv, (beta * tl.exp(c))[:, None] * k, IEEE)
    tl.store(Wt + head * DK + offs_k[None, :], w.to(Wt.dtype.element_ty), mask=qk_mask)
    v_mask = mt[:, None] & mv[None, :]
    v = tl.load(x + 2 * KEY_DIM + hv * DV + offs_v[None, :], mask=v_mask, other=0.0)
    u = _dot(inv, beta[:, None] * v.to(tl.float32), IEEE)
    tl.store(U + head * DV + offs_v[None, :], u.to(U.dtype.element_ty), mask=v_mask)
    q = tl.load(x + h * DK + offs_k[None, :], mask=qk_mask, other=0.0).to(tl.float32)
    q = _normed_rows(q) * scale
    scores = _dot(q, tl.trans(k), IEEE) * decay
    tl.store(P + head * CHUNK + rows[None, :], scores.to(P.dtype.element_ty), mask=mt[:, None])
    tl.store(Cs + t.to(tl.int64) * HV + hv, c, mask=mt)


@triton.jit
def _walk_kernel(
    Mixed, Wt, U, P, Cs, SSM, Slots, Offsets, Out,
    scale,
    stride_m, stride_ss, stride_sh, stride_ot, stride_oh,
    KEY_DIM: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    PER_KEY: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_V: tl.constexpr,
    CHUNK: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    r, hv = tl.program_id(0), tl.program_id(1)
    h = hv // PER_KEY
    start, end = tl.load(Offsets + r), tl.load(Offsets + r + 1)
    slot = tl.load(Slots + r).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_DK)
    mk = offs_k < DK
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mv = offs_v < DV
    s_ptrs = SSM + slot * stride_ss + hv * stride_sh + offs_k[:, None] * DV + offs_v[None, :]
    smask = mk[:, None] & mv[None, :]
    S = tl.load(s_ptrs, mask=smask, other=0.0)
    rows = tl.arange(0, CHUNK)
    for c0 in range(start, end, CHUNK):
        t = c0 + rows
        mt = t < end  # the last chunk's rows past the request: zeros, no change
        x = Mixed + t[:, None].to(tl.int64) * stride_m
        qk_mask, v_mask = mt[:, None] & mk[None, :], mt[:, None] & mv[None, :]
        q = tl.load(x + h * DK + offs_k[None, :], mask=qk_mask, other=0.0).to(tl.float32)
        k = tl.load(x + KEY_DIM + h * DK + offs_k[None, :], mask=qk_mask, other=0.0).to(tl.float32)
        head = t[:, None].to(tl.int64) * HV + hv
        c = tl.load(Cs + t.to(tl.int64) * HV + hv, mask=mt, other=0.0)
        c_last = tl.min(tl.where(mt, c, float("inf")), axis=0)  # c only falls: the last row's
        w = tl.load(Wt + head * DK + offs_k[None, :], mask=qk_mask, other=0.0)
        u = tl.load(U + head * DV + offs_v[None, :], mask=v_mask, other=0.0).to(tl.float32)
        scores = tl.load(P + head * CHUNK + rows[None, :], mask=mt[:, None], other=0.0)
        d = u - _mm(w, S, IEEE)  # what each token writes
        q = _normed_rows(q) * scale * tl.exp(c)[:, None]
        o = _mm(q, S, IEEE) + _mm(scores, d, IEEE)
        tl.store(Out + t[:, None] * stride_ot + hv * stride_oh + offs_v[None, :], o, mask=v_mask)
        k = _normed_rows(k) * tl.exp(c_last - c)[:, None]
        S = S * tl.exp(c_last) + _mm(tl.trans(k), d, IEEE)
    tl.store(s_ptrs, S, mask=smask & (end + 0 * offs_v > start)[None, :])  # an empty one: no


def chunks_varlen(
    mixed: torch.Tensor,  # [T, conv_dim]: q, k and v after the conv
    a: torch.Tensor,  # [T, value heads]
    b: torch.Tensor,  # [T, value heads]
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,  # [slots, value heads, dk, dv] float32, updated in place
    slots: torch.Tensor,  # [B]
    offsets: torch.Tensor,  # [B + 1]
    shape: LinearAttention,
    block_v: int = 32,
) -> torch.Tensor:
    """`chunked_varlen`'s result, in two passes: every chunk's own work at once, then each
    request's chunks in order against its state. The output [T, value heads, dv] in float32."""
    s = shape
    out = varlen_out(mixed, ssm_state, s)
    tokens, reqs = mixed.size(0), slots.size(0)
    if reqs >= 2**SEARCH:
        raise ValueError(f"{reqs} requests in one prefill; it takes at most {2**SEARCH - 1}")
    hv, dk, dv = s.num_value_heads, s.key_head_dim, s.value_head_dim
    w, u = mixed.new_empty(tokens, hv, dk), mixed.new_empty(tokens, hv, dv)
    scores = mixed.new_empty(tokens, hv, CHUNK)
    cs = mixed.new_empty(tokens, hv, dtype=torch.float32)
    common = dict(
        KEY_DIM=s.num_key_heads * dk, HV=hv, DK=dk, DV=dv,
        PER_KEY=hv // s.num_key_heads, BLOCK_DK=max(16, triton.next_power_of_2(dk)),
        CHUNK=CHUNK, IEEE=mixed.dtype == torch.float32,
    )  # fmt: skip
    if tokens:
        lengths = offsets[1:] - offsets[:-1]
        chunk_offsets = F.pad(torch.div(lengths + CHUNK - 1, CHUNK, rounding_mode="floor"), (1, 0))
        chunk_offsets = chunk_offsets.cumsum(0).to(torch.int32)  # each request's first chunk
        most = tokens // CHUNK + reqs  # chunks there can be: each request's last may be short
        _prepare_kernel[(most, hv)](
            mixed, a, b, A_log, dt_bias, offsets, chunk_offsets, w, u, scores, cs,
            reqs, dk**-0.5, mixed.stride(0), a.stride(0), b.stride(0),
            BLOCK_DV=max(16, triton.next_power_of_2(dv)), SEARCH=SEARCH, num_warps=8, **common,
        )  # fmt: skip
    block_v = max(16, min(block_v, triton.next_power_of_2(dv)))
    _walk_kernel[(reqs, hv, triton.cdiv(dv, block_v))](
        mixed, w, u, scores, cs, ssm_state, slots, offsets, out, dk**-0.5,
        mixed.stride(0), ssm_state.stride(0), ssm_state.stride(1), out.stride(0), out.stride(1),
        BLOCK_V=block_v, num_warps=8, num_stages=2, **common,
    )  # fmt: skip
    return out
