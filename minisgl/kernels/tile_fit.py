"""Launches that fit one GPU block at any head_dim: Gemma 4's 512-dim heads.

The decode and extend kernels (decode_attention.py, extend_attention.py) multiply tiles of
[rows x head_dim] queries by [block_n x head_dim] keys and values. Triton stages the
operands of each `tl.dot` in shared memory, and its software pipeline keeps `stages` copies
of the tiles loaded inside the key loop, so a program needs about

    rows x head_dim (queries, in q's dtype)
  + stages x 2 x block_n x head_dim (keys and values, in the cache's dtype)
  + 2 x block_n x head_dim in q's dtype (an FP8 cache's tiles, widened for the dot)
  + rows x block_n in q's dtype (the probabilities, the second dot's operand) + scratch

bytes of it, and an H200 gives a block at most 227 KB. Its accumulator, [rows x head_dim]
fp32, lives in registers: past 128 numbers a thread it spills, and a decode program runs
fastest with at most 64 (more warps share it). The launches chosen for
head_dim <= 256 were measured (attention.py) and fit; at 512 the same tiles need twice the
memory (415,744 B for bf16 decode), so there the query rows are halved until the
accumulator fits, then the key block, then the stages, until the tiles fit.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton

from minisgl.kernels.attention import Launch, _override

SMEM_PER_BLOCK = 227 * 1024  # an H200 (and H100) block's shared memory at most
SCRATCH = 4096  # Triton's own: row maxima and sums, layout conversions
DEFAULT_STAGES = 3  # Triton's pipeline depth on NVIDIA GPUs where a launch names none
ACC_PER_THREAD = 128  # fp32 accumulator numbers a thread holds without spilling
MEASURED_UP_TO = 256  # the head_dim the chosen launches were measured at
# A decode program's accumulator a warp holds (64 numbers a thread): at head_dim 512 and 16
# query rows 2 warps held 128 a thread and ran 1.62-1.64x slower than 4 (an H100's sweep
# of Gemma-4-E4B's global heads at batch 128 and 256, docs/benchmarks.md)
DECODE_ACC = 64 * 32


def tile_bytes(rows: int, launch: Launch, head_dim: int, q_dtype: torch.dtype,
               kv_dtype: torch.dtype) -> int:  # fmt: skip
    """Shared memory a program of `launch` needs, by the sum in the module's docstring."""
    d, q, kv = triton.next_power_of_2(head_dim), q_dtype.itemsize, kv_dtype.itemsize
    stages = launch.stages or DEFAULT_STAGES
    widened = 2 * launch.block_n * d * q if kv < q else 0
    return rows * d * q + stages * 2 * launch.block_n * d * kv + widened + \
        rows * launch.block_n * q + SCRATCH  # fmt: skip


def fit_launch(launch: Launch, group: int, head_dim: int, q_dtype: torch.dtype,
               kv_dtype: torch.dtype) -> Launch:  # fmt: skip
    """`launch`, shrunk where its tiles outgrow a block at this head_dim; head_dim <= 256
    keeps the measured launch. A program's query rows: extend's block_m, or decode's query
    heads of one KV head (`group`), at least 16."""
    if head_dim <= MEASURED_UP_TO:
        return launch
    d, rows = triton.next_power_of_2(head_dim), max(16, triton.next_power_of_2(group))
    while not launch.block_m and "decode" not in _override and rows * d > DECODE_ACC * launch.warps:
        launch = replace(launch, warps=launch.warps * 2)  # a sweep's warps stay as asked
    if launch.block_m:  # the accumulator first: fewer query rows a program
        while launch.block_m > 16 and launch.block_m * d > ACC_PER_THREAD * 32 * launch.warps:
            launch = replace(launch, block_m=launch.block_m // 2)
        rows = launch.block_m
    launch = replace(launch, stages=launch.stages or DEFAULT_STAGES)
    while tile_bytes(rows, launch, head_dim, q_dtype, kv_dtype) > SMEM_PER_BLOCK:
        if launch.block_n > 16:
            launch = replace(launch, block_n=launch.block_n // 2)
        elif launch.stages > 1:  # type: ignore[operator]
            launch = replace(launch, stages=launch.stages - 1)  # type: ignore[operator]
        else:
            raise ValueError(
                f"attention tiles of head_dim {head_dim} need "
                f"{tile_bytes(rows, launch, head_dim, q_dtype, kv_dtype):,} B of shared "
                f"memory at the smallest blocks; a block has {SMEM_PER_BLOCK:,} B"
            )
    return launch
