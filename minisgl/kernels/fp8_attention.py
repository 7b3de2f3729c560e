"""Attention over an FP8 KV cache: when the attention kernels (decode_attention.py,
extend_attention.py, fused_decode.py) run their dots in fp16, the cast they use, and where
the values are widened.

A product of probabilities and values sums over keys, so each tensor-core operand register
holds the values of two keys at one channel: a column of the block of values, while the
cache stores a key's channels side by side. For 16-bit values the GPU reads such columns
from shared memory with a transposing load (ldmatrix.trans); there is none for bytes. Left
to itself, Triton moves e4m3 values into the operand layout while they are still bytes,
and on sm_90 that is 128 one-byte shared-memory reads a thread for every 64 keys of 128
channels, with their address arithmetic (255 registers a program of 2 warps, against 168
for the same kernel over bf16). MINISGL_FP8_V_WIDEN=first widens them in the layout they
were loaded in, pairs of channels split apart and joined again so that the compiler cannot
move the cast past the layout change, and the fp16 values take the transposing load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.env import ENV

WIDEN_FIRST = tl.constexpr(ENV.FP8_V_WIDEN.value == "first")  # read once, when kernels build


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


@triton.jit
def _widen(v, q):
    """A block of values [keys, channels] for the product with the probabilities of the
    queries q: e4m3 widened into q's fp16 where they were loaded (WIDEN_FIRST), else as they
    were (the caller casts). Only for fewer than 64 rows of queries: from 64 up Hopper's
    wgmma reads its operands from shared memory, Triton widens them before storing them
    there, and widening first would only add byte permutes (96 a thread an extend block)."""
    if WIDEN_FIRST and v.dtype == tl.float8e4nv and q.dtype == tl.float16 and q.shape[0] < 64:
        keys: tl.constexpr = v.shape[0]
        channels: tl.constexpr = v.shape[1]
        even, odd = tl.split(v.reshape(keys, channels // 2, 2))
        v = tl.join(even.to(q.dtype), odd.to(q.dtype)).reshape(keys, channels)
    return v
