"""Tensor parallelism's plumbing: who this process is among the ranks, and how ranks talk."""

from minisgl.distributed.comm import (
    agree_min,
    all_gather,
    all_reduce,
    broadcast_bytes,
    destroy_distributed,
    init_distributed,
)
from minisgl.distributed.info import Split, TPInfo, get_tp_info, rank_heads

__all__ = [
    "Split",
    "TPInfo",
    "agree_min",
    "all_gather",
    "all_reduce",
    "broadcast_bytes",
    "destroy_distributed",
    "get_tp_info",
    "init_distributed",
    "rank_heads",
]
