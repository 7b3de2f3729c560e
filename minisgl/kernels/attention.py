"""FlashAttention in Triton: paged decode (split-KV) and paged extend (tiled, causal).

Both kernels read keys and values through the page table: position p of the request in
row r lives in KV slot `page_table[r, p]`, so any page size works and nothing is copied
into a contiguous buffer first. Both use the online softmax: scores are computed one block
of keys at a time, and the running maximum `m`, the running sum `l` of exp(score - m) and
the weighted sum of values `acc` are rescaled whenever `m` grows, so no [queries x keys]
matrix is ever stored.

Decode has one query per request, too little work for a GPU if each (request, head) is
one program. So the keys of each request are cut into `num_splits` ranges handled in
parallel ("flash-decoding"), each writing a partial output and its log-sum-exp; a second
small kernel merges them. All query heads that share a KV head are handled by one
program, so each key is loaded once per group (grouped-query attention).

Lengths are read on the device, and the number of splits depends only on the batch size,
so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # fp32 inputs: exact products (tests compare with fp32 references), not TF32.
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


# >>> ch28
def fp16_dots(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether the dots run in fp16: bf16 queries over an e4m3 cache. e4m3 widens to fp16
    exactly, in one instruction per two values (to bf16 it takes several, and on the H200
    a batch-256 decode over e4m3 keys then took as long as over bf16 ones, at half the
    bytes); every bf16 value up to fp16's largest, 65504, is an fp16 value too, and the
    probabilities, in [0, 1], keep more bits in fp16 than in bf16."""
    return kv_dtype == torch.float8_e4m3fn and q_dtype == torch.bfloat16


@triton.jit
def _fp16(q):
    return tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)


# <<< ch28


@triton.jit
def _attend_block(
    q, K, V, slots, kv_head, stride_ks, stride_kh, stride_vs, stride_vh, offs_d,
    kv_mask, visible, sm_scale, m_i, l_i, acc, IEEE: tl.constexpr,
):  # fmt: skip
    """One step of the online softmax: queries q attend to the keys in `slots` where
    `visible`; the running max m_i, sum l_i and output acc are rescaled and extended."""
    k = tl.load(
        K + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    ).to(q.dtype)  # a cache in a narrower dtype is widened here; otherwise a no-op
    s = tl.where(visible, _dot(q, tl.trans(k), IEEE) * sm_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no key yet (not reachable with today's callers, but cheap to
    # guard) would otherwise compute exp(-inf - -inf) = nan.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    v = tl.load(
        V + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    ).to(q.dtype)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _attend_range(
    q, K, V, table_row, start, end, kv_head, stride_ks, stride_kh, stride_vs, stride_vh,
    offs_d, d_mask, sm_scale, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One decode program's online softmax over the keys at positions [start, end) of its
    request, found through the request's row of the page table: (m_i, l_i, acc)."""
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        slots = tl.load(table_row + offs_n, mask=n_mask, other=0).to(tl.int64)
        m_i, l_i, acc = _attend_block(
            q, K, V, slots, kv_head, stride_ks, stride_kh, stride_vs, stride_vh, offs_d,
            n_mask[:, None] & d_mask[None, :], n_mask[None, :], sm_scale, m_i, l_i, acc, IEEE,
        )  # fmt: skip
    return m_i, l_i, acc


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


# Decode launch shape: enough (request, KV head, split) programs to fill a large GPU, at
# most MAX_SPLITS; keys are read BLOCK_N at a time. tools/bench_attention.py measures them.
DECODE_PROGRAMS, DECODE_MAX_SPLITS, DECODE_BLOCK_N = 512, 32, 64
# Warps per decode program: 2 from batch 8 up (an H200 sweep of blocks, warps and stages at
# batch 8, 64 and 256: 4%, 1% and 9% faster than 4 warps); below that, not measured: 4.
DECODE_WARPS_FROM_BS8 = 2


@dataclass(frozen=True)
class Launch:
    """How a kernel is launched: keys per block (and queries per block for extend), warps
    per program, and the software pipeline's stages (None: Triton's default)."""

    block_n: int
    warps: int
    stages: int | None = None
    block_m: int = 0  # extend only

    def options(self) -> dict:
        return {"num_warps": self.warps} | ({"num_stages": self.stages} if self.stages else {})


_override: dict[str, Launch] = {}


@contextlib.contextmanager
def launch_override(kind: str, launch: Launch) -> Iterator[None]:
    """Within the block, every "decode" or "extend" launch uses `launch` (sweeps)."""
    _override[kind] = launch
    try:
        yield
    finally:
        del _override[kind]


def decode_launch(batch_size: int, kv_dtype: torch.dtype) -> Launch:
    """The decode kernels' blocks for a batch size and a KV-cache dtype."""
    if "decode" in _override:
        return _override["decode"]
    # tools/sweep_attention.py on the H200, fused kernel, Qwen3-0.6B's heads, context 1,024:
    # bf16 K/V at batch 256 read fastest 32 keys a block (258 against 275 us, and 253
    # against 269 in another sweep), at batch 64 and 8 with 64 (32 lost 11%); e4m3 K/V at
    # batch 256 with 64 (32 lost 8%). Batches between 64 and 256 were not measured: 64.
    block_n = 32 if batch_size >= 256 and kv_dtype.itemsize == 2 else DECODE_BLOCK_N
    return Launch(block_n, DECODE_WARPS_FROM_BS8 if batch_size >= 8 else 4)


def extend_launch(max_extend_len: int, kv_dtype: torch.dtype | None = None) -> Launch:
    """The extend kernel's blocks for the longest run of new tokens in the batch."""
    if "extend" in _override:
        return _override["extend"]
    # >>> ch28 one 8,192-token prompt over e4m3 K/V on the H200 (tools/sweep_attention.py):
    # 64 keys a block 1.17x faster than 32 (1.27 against 1.48 ms); over bf16, 0.96x
    if kv_dtype is not None and kv_dtype.itemsize == 1 and max_extend_len > 32:
        return Launch(64, 4, block_m=64)
    # <<< ch28
    return Launch(32, 4, block_m=64 if max_extend_len > 32 else 16)


NO_WINDOW = 1 << 30  # a window longer than any context: every key  # [ch29]


def decode_num_splits(batch_size: int, num_kv_heads: int) -> int:
    """Splits per (request, KV head): a power of two that shrinks as the batch grows."""
    splits = 1
    while splits < DECODE_MAX_SPLITS and batch_size * num_kv_heads * splits < DECODE_PROGRAMS:
        splits *= 2
    return splits


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
