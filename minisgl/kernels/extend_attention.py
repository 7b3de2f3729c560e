"""Paged extend (prefill) attention in Triton: tiled and causal.

One program per (request, query head, block of new tokens): the block's queries walk the
request's keys a block at a time with the online softmax (attention.py), each seeing the
cached prefix and, causally, the new tokens up to its own position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.attention import (
    NO_WINDOW,  # [ch29]
    _attend_block,
    extend_launch,
)
from minisgl.kernels.fp8_attention import _fp16, fp16_dots  # [ch28]
from minisgl.kernels.tile_fit import fit_launch  # [ch29]


@triton.jit
def _extend_kernel(
    Q, K, V, Out, PageTable, Rows, SeqLens, QoIndptr,
    sm_scale,
    v_scale,  # [ch28]
    window,  # [ch29]
    stride_qt, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_pt,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    FP16_DOTS: tl.constexpr = False,  # [ch28]
):  # fmt: skip
    b, head, block_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(QoIndptr + b)
    q_len = tl.load(QoIndptr + b + 1) - q_start
    if block_m * BLOCK_M >= q_len:
        return
    seq_len = tl.load(SeqLens + b)
    prefix = seq_len - q_len  # the new tokens are the last q_len positions
    row = tl.load(Rows + b).to(tl.int64)
    kv_head = head // GROUP

    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    tokens = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        Q + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if FP16_DOTS:  # [ch28]
        q = _fp16(q)  # [ch28]
    q_pos = prefix + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Causal: this block's last query sees positions up to prefix + its index, no further.
    end = tl.minimum(seq_len, prefix + (block_m + 1) * BLOCK_M)
    first = 0
    # >>> ch29 a sliding window: its first query sees back to q_pos - window + 1, no further
    first = tl.maximum(prefix + block_m * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    # <<< ch29
    for n0 in range(first, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        slots = tl.load(PageTable + row * stride_pt + offs_n, mask=n_mask, other=0).to(tl.int64)
        visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        visible &= offs_n[None, :] > q_pos[:, None] - window  # [ch29]
        m_i, l_i, acc = _attend_block(
            q, K, V, slots, kv_head, stride_ks, stride_kh, stride_vs, stride_vh, offs_d,
            n_mask[:, None] & d_mask[None, :], visible, sm_scale, m_i, l_i, acc, IEEE,
        )  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out = out * v_scale  # [ch28]
    tl.store(
        Out + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    window: int | None = None,  # [ch29]
    k_scale: float = 1.0,  # [ch28]
    v_scale: float = 1.0,  # [ch28]
) -> torch.Tensor:
    """q [tokens, q_heads, head_dim]: request i's new tokens are q[qo_indptr[i]:qo_indptr[i+1]],
    the last positions of its `seq_lens[i]`; each sees its cached prefix and, causally, the
    new tokens before it."""
    sm_scale *= k_scale  # [ch28]
    tokens, q_heads, head_dim = q.shape
    kv_heads = k_cache.size(1)
    bs = rows.size(0)
    launch = extend_launch(max_extend_len, k_cache.dtype)
    launch = fit_launch(launch, q_heads // kv_heads, head_dim, q.dtype, k_cache.dtype)  # [ch29]
    out = torch.empty_like(q)
    grid = (bs, q_heads, triton.cdiv(max_extend_len, launch.block_m))
    _extend_kernel[grid](
        q, k_cache, v_cache, out, page_table, rows, seq_lens, qo_indptr,
        sm_scale,
        v_scale,  # [ch28]
        window or NO_WINDOW,  # [ch29]
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1),
        page_table.stride(0),
        GROUP=q_heads // kv_heads, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        IEEE=q.dtype == torch.float32, **launch.options(),
        FP16_DOTS=fp16_dots(q.dtype, k_cache.dtype),  # [ch28]
    )  # fmt: skip
    return out
