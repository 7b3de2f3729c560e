"""Attention over an FP8 KV cache: when the attention kernels (decode_attention.py,
extend_attention.py, fused_decode.py) run their dots in fp16, and the cast they use."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
