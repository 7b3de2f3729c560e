"""FlashAttention in Triton: what the paged decode and extend kernels share.

Both kernels (decode_attention.py, extend_attention.py) read keys and values through the
page table: position p of the request in row r lives in KV slot `page_table[r, p]`, so any
page size works and nothing is copied into a contiguous buffer first. Both use the online
softmax: scores are computed one block of keys at a time, and the running maximum `m`, the
running sum `l` of exp(score - m) and the weighted sum of values `acc` are rescaled whenever
`m` grows, so no [queries x keys] matrix is ever stored. Here: that step, and how each
kernel is launched (keys per block, warps, decode's number of splits).
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


# Decode launch shape: enough (request, KV head, split) programs to fill a large GPU, at
# most MAX_SPLITS; keys are read BLOCK_N at a time. tools/bench_attention.py measures them.
DECODE_PROGRAMS, DECODE_MAX_SPLITS, DECODE_BLOCK_N = 512, 32, 64
# Warps per decode program: 2 from batch 8 up (an H200 sweep of blocks, warps and stages at
# batch 8, 64 and 256: 4%, 1% and 9% faster than 4 warps); below that, not measured: 4.
DECODE_WARPS_FROM_BS8 = 2


@dataclass(frozen=True)
class Launch:
    """How a kernel is launched: keys per block (and queries per block for extend), warps
    per program, the software pipeline's stages (None: Triton's default), and at most how
    many registers a thread takes (0: the compiler's choice; fewer let more programs share
    an SM, more may spill to memory; a CUDA launch option, Triton's `maxnreg`)."""

    block_n: int
    warps: int
    stages: int | None = None
    block_m: int = 0  # extend only
    registers: int = 0

    def options(self) -> dict:
        options = {"num_warps": self.warps} | ({"num_stages": self.stages} if self.stages else {})
        return options | ({"maxnreg": self.registers} if self.registers else {})


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
