"""Decode attention from qkv in one kernel: head norms, rotary, the KV store, split-KV
attention and the merge of the splits.

At batch 1 the work between the qkv projection and o_proj is a few kilobytes: one query
row per head and a few hundred keys. Done as three kernels (`rope_store`, the split-KV
pass, the merge) it costs three launches' fixed time, several microseconds each, for
almost no bytes. Here each (request, KV head, split) program does all of it:

- it reads its query heads straight from qkv and normalises (Qwen3) and rotates them in
  registers; channel d's partner in the "neox" rotation is d + head_dim / 2 (mod
  head_dim), so a head is rotated as q * cos + sign * q[partner] * sin, with no halves;
- the one program whose range of keys holds the new token rotates its key and stores it
  and its value in the KV pool, then reads them back with the rest (a barrier between
  the store and the loads makes the block see its own writes);
- every program writes its partial output and log-sum-exp, then adds one to a counter of
  its (request, KV head); the program that finds it was the last merges the partials of
  all splits and resets the counter for the next step. No second kernel waits for the
  first to finish.

Splits hold at least MIN_SPLIT_KEYS keys, so a short context uses a few of them (the
others return at once) and one of at most that many keys is a single split that writes
the output itself, with no partials, count or merge. Numbers follow the three-kernel path
(the same roundings to the model dtype); only the split boundaries, and so the order of
fp32 sums, differ.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.attention import (
    DECODE_BLOCK_N,
    _attend_range,
    decode_launch,
    decode_num_splits,
)
from minisgl.kernels.fp8_attention import _fp16, fp16_dots  # [ch28]
from minisgl.kernels.rope_store import _cached


@triton.jit
def _rotated_heads(
    heads, mask, offs_d, partner, sign, cos, sin, weight, eps,
    HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr,
):  # fmt: skip
    """Heads of qkv (`heads`: a pointer to each row's head; masked rows zero), normed and
    rotated by cos and sin (one row for all, or one a row), in the model dtype, rounded
    between the steps as the unfused layers round."""
    x = tl.load(heads + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(heads + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    dtype = heads.dtype.element_ty
    if QK_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
        w = tl.load(weight + offs_d, mask=offs_d < HEAD_DIM, other=0.0).to(tl.float32)
        wp = tl.load(weight + partner, mask=offs_d < HEAD_DIM, other=0.0).to(tl.float32)
        x = ((x * rstd).to(dtype).to(tl.float32) * w[None, :]).to(dtype).to(tl.float32)
        xp = ((xp * rstd).to(dtype).to(tl.float32) * wp[None, :]).to(dtype).to(tl.float32)
    return (x * cos + sign[None, :] * xp * sin).to(dtype)


@triton.jit
def _load_cg(ptrs, mask):
    """Another program's writes, read past this SM's L1 (which may hold stale lines)."""
    return tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")


@triton.jit
def _store_or_merge(
    out, m_i, l_i, out_ptrs, partial, lse_ptrs, counter, split, used, stride_ps, mask, r_mask,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One range of keys' rows done: alone, they are the output; else they are stored as a
    partial with their log-sum-exp, and the last range to finish (the counter says which)
    merges every range's partial into the output and resets the counter."""
    if used == 1:
        tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=mask)
    else:
        has_keys = l_i > 0
        lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(partial + split * stride_ps, out, mask=mask)
        tl.store(lse_ptrs + split, lse, mask=r_mask)
        tl.debug_barrier()  # every thread's partial is written before the count says so
        if tl.atomic_add(counter, 1, sem="acq_rel") == used - 1:  # the last one
            top = tl.full([BLOCK_R], float("-inf"), tl.float32)
            for s in range(0, used):
                top = tl.maximum(top, _load_cg(lse_ptrs + s, r_mask))
            # A masked row (or one that sees no key) is -inf everywhere: keep it finite.
            top = tl.where(top == float("-inf"), 0.0, top)
            total = tl.zeros([BLOCK_R], tl.float32)
            merged = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
            for s in range(0, used):
                w = tl.exp(_load_cg(lse_ptrs + s, r_mask) - top)
                merged += _load_cg(partial + s * stride_ps, mask) * w[:, None]
                total += w
            total = tl.where(total > 0, total, 1.0)
            tl.store(out_ptrs, (merged / total[:, None]).to(out_ptrs.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter, 0)  # ready for the next step (and the next graph replay)


@triton.jit
def _decode_qkv_kernel(
    QKV, K, V, Out, PageTable, Rows, SeqLens, Positions, OutLoc, CosSin, QW, KW, eps,
    OutPartial, LsePartial, Counters, sm_scale,
    k_inv, v_inv, v_scale,  # an FP8 cache: k * k_inv stored, stored * v_scale read  # [ch28]
    stride_t, stride_ks, stride_kh, stride_vs, stride_vh, stride_pt, stride_cs,
    stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr, QK_NORM: tl.constexpr,
    IEEE: tl.constexpr,
    FP16_DOTS: tl.constexpr = False,  # [ch28]
):  # fmt: skip
    b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    row = tl.load(Rows + b).to(tl.int64)
    per_split = tl.maximum(tl.cdiv(seq_len, NUM_SPLITS), MIN_SPLIT)
    used = tl.cdiv(seq_len, per_split)  # splits that hold keys; the rest have nothing to do
    if split >= used:
        return
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    half: tl.constexpr = HEAD_DIM // 2
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    partner = (offs_d + half) % HEAD_DIM
    sign = tl.where(offs_d < half, -1.0, 1.0)
    pos = tl.load(Positions + b).to(tl.int64)
    cos = tl.load(CosSin + pos * stride_cs + offs_d % half, mask=d_mask, other=0.0)
    sin = tl.load(CosSin + pos * stride_cs + half + offs_d % half, mask=d_mask, other=0.0)
    qkv = QKV + b * stride_t
    offs_h = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_h
    h_mask = offs_h < GROUP
    q = _rotated_heads(
        qkv + heads[:, None] * HEAD_DIM, h_mask[:, None] & d_mask[None, :], offs_d, partner,
        sign, cos[None, :], sin[None, :], QW, eps, HEAD_DIM, QK_NORM,
    )  # fmt: skip

    if seq_len == end:  # the new token's key is in this range
        first = offs_h == 0
        store = first[:, None] & d_mask[None, :]
        k = _rotated_heads(
            qkv + (Q_HEADS + kv_head + 0 * offs_h[:, None]) * HEAD_DIM, store, offs_d, partner,
            sign, cos[None, :], sin[None, :], KW, eps, HEAD_DIM, QK_NORM,
        )  # fmt: skip
        k = k * k_inv  # [ch28]
        slot = tl.load(OutLoc + b).to(tl.int64)
        at = slot * stride_ks + kv_head * stride_kh + 0 * offs_h[:, None] + offs_d[None, :]
        tl.store(K + at, _cached(k, K), mask=store)
        v_ptrs = qkv + (Q_HEADS + KV_HEADS + kv_head) * HEAD_DIM + 0 * offs_h[:, None]
        v = tl.load(v_ptrs + offs_d[None, :], mask=store, other=0.0)
        v = v * v_inv  # [ch28]
        at = slot * stride_vs + kv_head * stride_vh + 0 * offs_h[:, None] + offs_d[None, :]
        tl.store(V + at, _cached(v, V), mask=store)
        tl.debug_barrier()  # the loads below read this key back

    if FP16_DOTS:  # [ch28]
        q = _fp16(q)  # [ch28]
    m_i, l_i, acc = _attend_range(
        q, K, V, PageTable + row * stride_pt, start, end, kv_head, stride_ks, stride_kh,
        stride_vs, stride_vh, offs_d, d_mask, sm_scale, BLOCK_H, BLOCK_N, BLOCK_D, IEEE,
    )  # fmt: skip

    out_mask = h_mask[:, None] & d_mask[None, :]
    out_ptrs = Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out = out * v_scale  # [ch28]
    partial = OutPartial + b * stride_pb + heads[:, None] * stride_ph + offs_d[None, :]
    _store_or_merge(
        out, m_i, l_i, out_ptrs, partial, LsePartial + b * stride_lb + heads * stride_lh,
        Counters + b * KV_HEADS + kv_head, split, used, stride_ps, out_mask, h_mask, BLOCK_H,
        BLOCK_D,
    )  # fmt: skip


# A split holds at least this many keys: below it, the partials' store, the count and the
# merge cost more than the keys a split saves. A context of at most this many keys is one
# split that writes the output itself.
MIN_SPLIT_KEYS = 2 * DECODE_BLOCK_N

_counters: dict[torch.device, torch.Tensor] = {}


def _split_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters, one per (request, KV head), kept zero by the kernel itself.
    One buffer per device, made before any graph capture (the first decode step is eager),
    so a captured graph and eager steps count in the same place; kernels that use it run
    one after another on one stream."""
    buf = _counters.get(device)
    if buf is None or buf.numel() < n:
        assert not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()), (
            "the split counters must exist before a CUDA graph is captured"
        )
        buf = _counters[device] = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
    return buf


def decode_attention_qkv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_loc: torch.Tensor,
    page_table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    k_scale: float = 1.0,  # an FP8 cache's keys and values are stored * these  # [ch28]
    v_scale: float = 1.0,  # [ch28]
) -> torch.Tensor:
    """One decode token per request: qkv [bs, (q_heads + 2 kv_heads) * head_dim] ->
    attention output [bs, q_heads, head_dim]; each token's key (rotated, and normed with
    q/k_weight) and value are stored at out_loc on the way. Equal to `qk_rope_store`
    followed by `decode_attention`."""
    sm_scale *= k_scale  # [ch28]
    assert qkv.stride(-1) == 1 and head_dim % 2 == 0 and q_heads % kv_heads == 0
    bs, group = qkv.size(0), q_heads // kv_heads
    splits = decode_num_splits(bs, kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    out = torch.empty(bs, q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    partial = torch.empty(bs, q_heads, splits, head_dim, dtype=torch.float32, device=qkv.device)
    lse = torch.empty(bs, q_heads, splits, dtype=torch.float32, device=qkv.device)
    counters = _split_counters(qkv.device, bs * kv_heads)
    qk_norm = q_weight is not None
    launch = decode_launch(bs, k_cache.dtype)
    _decode_qkv_kernel[(bs, kv_heads, splits)](
        qkv, k_cache, v_cache, out, page_table, rows, seq_lens, positions, out_loc, cos_sin,
        q_weight if qk_norm else cos_sin, k_weight if qk_norm else cos_sin, eps,
        partial, lse, counters, sm_scale,
        1 / k_scale, 1 / v_scale, v_scale,  # [ch28]
        qkv.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), page_table.stride(0), cos_sin.stride(0),
        out.stride(0), out.stride(1), partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1),
        Q_HEADS=q_heads, KV_HEADS=kv_heads, GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=launch.block_n,
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits, MIN_SPLIT=MIN_SPLIT_KEYS,
        QK_NORM=qk_norm,
        IEEE=qkv.dtype == torch.float32, **launch.options(),
        FP16_DOTS=fp16_dots(qkv.dtype, k_cache.dtype),  # [ch28]
    )  # fmt: skip
    return out
