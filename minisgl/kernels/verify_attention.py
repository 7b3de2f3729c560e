"""Attention for a verify batch: a few new tokens a request over a long context, split-KV.

A verify checks each request's last token and its k drafts: k + 1 new tokens over a
context of hundreds or thousands of keys. The extend kernel gives each (request, query
head) one program that walks every key in turn, so at batch 1 a model of 9 query heads
runs 9 programs on a GPU of 132 SMs, and the walk grows with the context; a decode step's
split-KV kernel cuts the keys into ranges handled in parallel and stays flat. Here the
verify gets the decode kernel's plan with its few tokens inside each program:

- one program per (request, KV head, block of new tokens, range of keys); its rows are the
  block's tokens times the query heads of its KV head, so each key is loaded once for all
  of them (grouped-query attention, as in decode);
- causal: the new token j of a request (position prefix + j) sees keys up to its own
  position, so the drafts see the ones before them; a program's range of keys ends at its
  block's last position, and a row that sees none of a range weighs nothing in the merge;
- the splits merge as in the one-kernel decode (fused_decode.py): each program writes its
  partial output and log-sum-exp, counts itself in, and the last of its (request, KV head,
  block) merges them; a context short enough for one range writes the output directly.

Lengths are read on the device and the grid depends only on the batch's size and its
longest run of new tokens, so a verify graph captures it. `verify_attention` finds the new
tokens' keys and values in the KV pool (the rotary-and-store kernel ran first);
`verify_attention_qkv` starts from the layer's qkv as the decode step's kernel does: each
program norms and rotates its query rows and stores the new keys and values of its own range
of keys before reading them back (where programs share one, they write the same bytes).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from minisgl.env import ENV
from minisgl.kernels.attention import (
    NO_WINDOW,  # [ch29]
    _attend_block,
    _override,
    decode_launch,
    decode_num_splits,
)
from minisgl.kernels.fp8_attention import _fp16, fp16_dots  # [ch28]
from minisgl.kernels.fused_decode import (
    MIN_SPLIT_KEYS,
    _rotated_heads,
    _split_counters,
    _store_or_merge,
)
from minisgl.kernels.rope_store import _cached
from minisgl.kernels.tile_fit import fit_launch  # [ch29]

if TYPE_CHECKING:
    from minisgl.attention.triton_backend import TritonAttnBackend
    from minisgl.core import Batch
    from minisgl.layers.attention import AttentionLayer

# Query rows a program holds (tokens x query heads of a KV head) times head_dim, at most:
# 64 rows of 128, whose fp32 accumulator four warps hold in registers (64 numbers a thread).
MAX_ROW_DIMS = 64 * 128
MAX_TOKENS = 16  # new tokens a program takes at most
# Keys a range holds at least, and new tokens a program takes at most (None: as many as the
# longest run, up to MAX_TOKENS). An H100 sweep of SmolLM2's, Qwen3-0.6B's and 8B's heads at
# contexts of 137 to 8,201 keys and batch 1 to 8 (tools/sweep_attention.py --verify sets
# them; docs/benchmarks.md) found 4 tokens and 256 keys the best setting overall: one range
# and more programs where the context is short, where 16 tokens in two ranges of 128 lost
# to the extend kernel by a quarter.
MIN_SPLIT = 2 * MIN_SPLIT_KEYS
BLOCK_TOKENS: int | None = 4
ACC_PER_WARP = 64 * 32  # accumulator numbers a warp holds: 64 a thread, as in decode


@triton.jit
def _verify_kernel(
    Q, K, V, Out, PageTable, Rows, SeqLens, QoIndptr, OutPartial, LsePartial, Counters,
    sm_scale,
    v_scale,  # an FP8 cache's values: stored * v_scale (k_scale is in sm_scale)  # [ch28]
    window,  # keys older than the last `window` positions are not attended  # [ch29]
    q_blocks,
    Positions, OutLoc, CosSin, QW, KW, eps, stride_cs,  # FROM_QKV: rotary, norms, the store
    k_inv, v_inv,  # an FP8 cache: k * k_inv stored  # [ch28]
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_pt,
    stride_ot, stride_oh, stride_pq, stride_ph, stride_ps, stride_lt, stride_lh,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr,
    IEEE: tl.constexpr, FROM_QKV: tl.constexpr, QK_NORM: tl.constexpr, STORE_T: tl.constexpr,
    FP16_DOTS: tl.constexpr = False,  # [ch28]
):  # fmt: skip
    b, pid, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_head, block = pid // q_blocks, pid % q_blocks
    q_start = tl.load(QoIndptr + b)
    q_len = tl.load(QoIndptr + b + 1) - q_start
    if block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(SeqLens + b)
    prefix = seq_len - q_len  # the new tokens are the last q_len positions
    # Keys this block's rows may see: up to its last token's position.
    keys = tl.minimum(seq_len, prefix + (block + 1) * BLOCK_Q)
    first = 0
    first = tl.maximum(prefix + block * BLOCK_Q - window + 1, 0)  # its first row's window  # [ch29]
    per_split = tl.maximum(tl.cdiv(keys - first, NUM_SPLITS), MIN_SPLIT)
    used = tl.cdiv(keys - first, per_split)  # ranges that hold keys; the rest have nothing to do
    if split >= used:
        return
    start = first + split * per_split
    end = tl.minimum(start + per_split, keys)

    offs_r = tl.arange(0, BLOCK_R)  # rows: BLOCK_Q tokens times the GROUP heads, then padding
    j = block * BLOCK_Q + offs_r // GROUP  # the row's new token, within its request
    h = offs_r % GROUP
    r_mask = (offs_r < BLOCK_Q * GROUP) & (j < q_len)
    tokens = (q_start + j).to(tl.int64)
    heads = kv_head * GROUP + h
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    mask = r_mask[:, None] & d_mask[None, :]
    q_ptrs = Q + tokens[:, None] * stride_qt + heads[:, None] * stride_qh
    if FROM_QKV:
        half: tl.constexpr = HEAD_DIM // 2
        partner = (offs_d + half) % HEAD_DIM
        sign = tl.where(offs_d < half, -1.0, 1.0)
        # The new tokens' keys and values in this range go into the pool before they are
        # read. Each program stores the ones it reads (programs of later blocks read the
        # same keys and write the same bytes), so none waits for another.
        for t0 in range(0, (block + 1) * BLOCK_Q, STORE_T):
            t = t0 + tl.arange(0, STORE_T)
            t_mask = (t < q_len) & (prefix + t >= start) & (prefix + t < end)
            store = t_mask[:, None] & d_mask[None, :]
            at = (q_start + t).to(tl.int64)
            pos = tl.load(Positions + at, mask=t_mask, other=0).to(tl.int64)
            cs = CosSin + pos[:, None] * stride_cs + (offs_d % half)[None, :]
            row = Q + at[:, None] * stride_qt  # the token's qkv: q heads, k heads, v heads
            k = _rotated_heads(
                row + (KV_HEADS * GROUP + kv_head) * HEAD_DIM, store,
                offs_d, partner, sign, tl.load(cs, mask=store, other=0.0),
                tl.load(cs + half, mask=store, other=0.0), KW, eps, HEAD_DIM, QK_NORM,
            )  # fmt: skip
            k = k * k_inv  # [ch28]
            slot = tl.load(OutLoc + at, mask=t_mask, other=0).to(tl.int64)
            k_at = slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :]
            tl.store(K + k_at, _cached(k, K), mask=store)
            v_ptrs = row + (KV_HEADS * GROUP + KV_HEADS + kv_head) * HEAD_DIM + offs_d[None, :]
            v = tl.load(v_ptrs, mask=store, other=0.0)
            v = v * v_inv  # [ch28]
            v_at = slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :]
            tl.store(V + v_at, _cached(v, V), mask=store)
        tl.debug_barrier()  # the loads below read these keys back
        pos = tl.load(Positions + tokens, mask=r_mask, other=0).to(tl.int64)
        cs = CosSin + pos[:, None] * stride_cs + (offs_d % half)[None, :]
        q = _rotated_heads(
            q_ptrs, mask, offs_d, partner, sign, tl.load(cs, mask=mask, other=0.0),
            tl.load(cs + half, mask=mask, other=0.0), QW, eps, HEAD_DIM, QK_NORM,
        )  # fmt: skip
    else:
        q = tl.load(q_ptrs + offs_d[None, :], mask=mask, other=0.0)
    if FP16_DOTS:  # [ch28]
        q = _fp16(q)  # [ch28]
    q_pos = prefix + j

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    table_row = PageTable + tl.load(Rows + b).to(tl.int64) * stride_pt
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        slots = tl.load(table_row + offs_n, mask=n_mask, other=0).to(tl.int64)
        visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        visible &= offs_n[None, :] > q_pos[:, None] - window  # [ch29]
        m_i, l_i, acc = _attend_block(
            q, K, V, slots, kv_head, stride_ks, stride_kh, stride_vs, stride_vh, offs_d,
            n_mask[:, None] & d_mask[None, :], visible, sm_scale, m_i, l_i, acc, IEEE,
        )  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out = out * v_scale  # [ch28]
    out_ptrs = Out + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    partial = OutPartial + tokens[:, None] * stride_pq + heads[:, None] * stride_ph
    _store_or_merge(
        out, m_i, l_i, out_ptrs, partial + offs_d[None, :],
        LsePartial + tokens * stride_lt + heads * stride_lh,
        Counters + (b * KV_HEADS + kv_head) * q_blocks + block, split, used, stride_ps, mask,
        r_mask, BLOCK_R, BLOCK_D,
    )  # fmt: skip


def verify_blocks(group: int, max_extend_len: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_R): new tokens a program, the longest run of them rounded up to a
    power of two (at most MAX_TOKENS, and as many rows as MAX_ROW_DIMS / head_dim), and its
    rows, those tokens times the group's query heads padded to a power of two, at least 16
    (a dot's least). Powers of two: a verify graph's tiers (2, 4, 8, 16, ...) build every
    BLOCK_Q a verify meets at start-up, and none is built mid-run."""
    most = MAX_ROW_DIMS // triton.next_power_of_2(head_dim)
    run = min(BLOCK_TOKENS or MAX_TOKENS, triton.next_power_of_2(max(max_extend_len, 1)))
    fits = max(1, triton.next_power_of_2(most // group + 1) // 2)  # a power of two
    block_q = min(run, MAX_TOKENS, fits)
    return block_q, max(16, triton.next_power_of_2(block_q * group))


def verify_attention(
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
    k_scale: float = 1.0,  # an FP8 cache's keys and values are stored * these  # [ch28]
    v_scale: float = 1.0,  # [ch28]
) -> torch.Tensor:
    """`extend_attention`'s result, split over the keys: q [tokens, q_heads, head_dim],
    request i's new tokens q[qo_indptr[i]:qo_indptr[i+1]], the last positions of its
    `seq_lens[i]`; at most `max_extend_len` new tokens a request; window: each token attends
    to the last `window` positions up to its own only."""
    tokens, q_heads, head_dim = q.shape
    return _launch(
        q, q.stride(0), q.stride(1), tokens, q_heads, head_dim, k_cache, v_cache, page_table,
        rows, seq_lens, qo_indptr, max_extend_len, sm_scale, None,
        window=window,  # [ch29]
        k_scale=k_scale, v_scale=v_scale,  # [ch28]
    )  # fmt: skip


def verify_attention_qkv(
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
    qo_indptr: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    k_scale: float = 1.0,  # [ch28]
    v_scale: float = 1.0,  # [ch28]
) -> torch.Tensor:
    """A verify's attention from the layer's qkv [tokens, (q_heads + 2 kv_heads) * head_dim]
    in one kernel, as the decode step's (kernels/fused_decode.py): the heads normed (with
    q/k_weight) and rotated at `positions`, each new token's key and value stored at
    `out_loc`, then `verify_attention`'s result. Equal to `qk_rope_store` followed by
    `verify_attention` (full rotary, no window)."""
    assert qkv.stride(-1) == 1 and head_dim % 2 == 0 and q_heads % kv_heads == 0
    assert k_cache.size(1) == kv_heads
    qk_norm = q_weight is not None
    rope = (
        positions, out_loc, cos_sin, q_weight if qk_norm else cos_sin,
        k_weight if qk_norm else cos_sin, eps, cos_sin.stride(0),
    )  # fmt: skip
    return _launch(
        qkv, qkv.stride(0), head_dim, qkv.size(0), q_heads, head_dim, k_cache, v_cache,
        page_table, rows, seq_lens, qo_indptr, max_extend_len, sm_scale, (rope, qk_norm),
        k_scale=k_scale, v_scale=v_scale,  # [ch28]
    )  # fmt: skip


def from_qkv(
    backend: TritonAttnBackend, layer: AttentionLayer, batch: Batch, inputs: tuple, heads: tuple
) -> torch.Tensor | None:
    """The Triton backend's verify from qkv (`decode_from_qkv`'s `inputs` and `heads`); None
    (rotary and store, then `attend`) unless MINISGL_VERIFY_ATTN is split-qkv."""
    if ENV.VERIFY_ATTN.value != "split-qkv":
        return None
    md = batch.attn_metadata
    return verify_attention_qkv(
        *inputs, md.qo_indptr, md.max_extend_len, backend.scale, *heads,
        *backend.kv_cache.scales(layer.layer_id),  # [ch28]
    )  # fmt: skip


def _launch(
    q, stride_qt, stride_qh, tokens, q_heads, head_dim, k_cache, v_cache, page_table, rows,
    seq_lens, qo_indptr, max_extend_len, sm_scale, from_qkv,
    window=None,  # [ch29]
    k_scale=1.0, v_scale=1.0,  # [ch28]
) -> torch.Tensor:  # fmt: skip
    """The kernel over q [tokens, q_heads, head_dim] (strides given), or from_qkv: (the
    rotary's arguments, whether the heads are normed) with q the layer's qkv."""
    sm_scale *= k_scale  # [ch28]
    bs, kv_heads = rows.size(0), k_cache.size(1)
    group = q_heads // kv_heads
    block_q, block_r = verify_blocks(group, max_extend_len, head_dim)
    q_blocks = triton.cdiv(max(max_extend_len, 1), block_q)
    splits = decode_num_splits(bs, kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    out = torch.empty(tokens, q_heads, head_dim, dtype=q.dtype, device=q.device)
    partial = torch.empty(tokens, q_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(tokens, q_heads, splits, dtype=torch.float32, device=q.device)
    counters = _split_counters(q.device, bs * kv_heads * q_blocks)
    launch = decode_launch(bs, k_cache.dtype)
    if "decode" not in _override:  # a sweep's launch as asked; else enough warps for the rows
        launch = replace(launch, warps=max(launch.warps, min(8, block_r * block_d // ACC_PER_WARP)))
    launch = fit_launch(launch, block_r, head_dim, q.dtype, k_cache.dtype)  # [ch29]
    rope, qk_norm = from_qkv or ((seq_lens,) * 5 + (0.0, 0), False)
    _verify_kernel[(bs, kv_heads * q_blocks, splits)](
        q, k_cache, v_cache, out, page_table, rows, seq_lens, qo_indptr, partial, lse, counters,
        sm_scale,
        v_scale,  # [ch28]
        window or NO_WINDOW,  # [ch29]
        q_blocks, *rope,
        1 / k_scale, 1 / v_scale,  # [ch28]
        stride_qt, stride_qh, k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), page_table.stride(0), out.stride(0), out.stride(1),
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        KV_HEADS=kv_heads, GROUP=group, BLOCK_Q=block_q, BLOCK_R=block_r,
        BLOCK_N=launch.block_n, HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits,
        MIN_SPLIT=MIN_SPLIT, IEEE=q.dtype == torch.float32, FROM_QKV=from_qkv is not None,
        QK_NORM=qk_norm, STORE_T=max(2, block_q), **launch.options(),
        FP16_DOTS=fp16_dots(q.dtype, k_cache.dtype),  # [ch28]
    )  # fmt: skip
    return out
