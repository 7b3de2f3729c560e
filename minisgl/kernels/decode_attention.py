"""Paged decode attention in Triton: split-KV ("flash-decoding"), then a merge.

Decode has one query per request, too little work for a GPU if each (request, head) is
one program. So the keys of each request are cut into `num_splits` ranges handled in
parallel, each writing a partial output and its log-sum-exp; a second small kernel merges
them. All query heads that share a KV head are handled by one program, so each key is
loaded once per group (grouped-query attention).

Lengths are read on the device, and the number of splits depends only on the batch size,
so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.attention import (
    NO_WINDOW,  # [ch29]
    _attend_range,
    decode_launch,
    decode_num_splits,
)
from minisgl.kernels.fp8_attention import _fp16, fp16_dots  # [ch28]
from minisgl.kernels.tile_fit import fit_launch  # [ch29]


@triton.jit
def _decode_split_kernel(
    Q, K, V, PageTable, Rows, SeqLens, OutPartial, LsePartial,
    sm_scale,
    v_scale,  # an FP8 cache's values: stored * v_scale (k_scale is in sm_scale)  # [ch28]
    window,  # keys older than the last `window` positions are not attended  # [ch29]
    stride_qb, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_pt,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr,
    FP16_DOTS: tl.constexpr = False,  # [ch28]
):  # fmt: skip
    b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    row = tl.load(Rows + b).to(tl.int64)
    first = 0
    first = tl.maximum(seq_len - window, 0)  # [ch29]
    per_split = tl.cdiv(seq_len - first, NUM_SPLITS)
    start = first + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_h
    h_mask = offs_h < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if FP16_DOTS:  # [ch28]
        q = _fp16(q)  # [ch28]

    m_i, l_i, acc = _attend_range(
        q, K, V, PageTable + row * stride_pt, start, end, kv_head, stride_ks, stride_kh,
        stride_vs, stride_vh, offs_d, d_mask, sm_scale, BLOCK_H, BLOCK_N, BLOCK_D, IEEE,
    )  # fmt: skip

    # A split past the end of the keys (each covers cdiv(seq_len, NUM_SPLITS) of them, so
    # the last ones can be empty) weighs nothing in the merge.
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    out = out * v_scale  # the weights sum to 1: scaling the sum scales every value  # [ch28]
    lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    tl.store(
        OutPartial + b * stride_ob + heads[:, None] * stride_oh + split * stride_os
        + offs_d[None, :],
        out,
        mask=h_mask[:, None] & d_mask[None, :],
    )  # fmt: skip
    tl.store(LsePartial + b * stride_lb + heads * stride_lh + split, lse, mask=h_mask)


@triton.jit
def _decode_merge_kernel(
    OutPartial, LsePartial, Out,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_b, stride_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    b, head = tl.program_id(0), tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(LsePartial + b * stride_lb + head * stride_lh + offs_s)
    weights = tl.exp(lse - tl.max(lse, 0))  # exp(-inf) = 0 for empty splits
    partial = tl.load(
        OutPartial + b * stride_ob + head * stride_oh + offs_s[:, None] * stride_os
        + offs_d[None, :],
        mask=d_mask[None, :],
        other=0.0,
    )  # fmt: skip
    out = tl.sum(partial * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(Out + b * stride_b + head * stride_h + offs_d, out, mask=d_mask)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    window: int | None = None,  # [ch29]
    k_scale: float = 1.0,  # an FP8 cache's keys and values are stored * these  # [ch28]
    v_scale: float = 1.0,  # [ch28]
) -> torch.Tensor:
    """q [bs, q_heads, head_dim]; k/v_cache [slots, kv_heads, head_dim]; rows, seq_lens [bs];
    window: attend to the last `window` positions only."""
    sm_scale *= k_scale  # q . (k * k_scale) = (q . k) * k_scale: no work per key  # [ch28]
    bs, q_heads, head_dim = q.shape
    kv_heads = k_cache.size(1)
    group = q_heads // kv_heads
    splits = decode_num_splits(bs, kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    partial = torch.empty(bs, q_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(bs, q_heads, splits, dtype=torch.float32, device=q.device)
    launch = decode_launch(bs, k_cache.dtype)
    launch = fit_launch(launch, group, head_dim, q.dtype, k_cache.dtype)  # [ch29]
    _decode_split_kernel[(bs, kv_heads, splits)](
        q, k_cache, v_cache, page_table, rows, seq_lens, partial, lse,
        sm_scale,
        v_scale,  # [ch28]
        window or NO_WINDOW,  # [ch29]
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        page_table.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=launch.block_n,
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits, IEEE=q.dtype == torch.float32,
        FP16_DOTS=fp16_dots(q.dtype, k_cache.dtype),  # [ch28]
        **launch.options(),
    )  # fmt: skip
    out = torch.empty_like(q)
    _decode_merge_kernel[(bs, q_heads)](
        partial, lse, out,
        partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits,
    )  # fmt: skip
    return out
