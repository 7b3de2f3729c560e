"""An engine among tensor-parallel ranks: it joins them before its model is built, and agrees
with them on its limits before it captures graphs.

The layers read this process's rank when they are built, to keep their slice of each weight,
so joining comes first. Every rank must then schedule alike: they take the smallest KV pool
any of them can hold, and compare the rest of their limits with rank 0's, before a graph
could wait in a collective for a rank that has already failed.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from minisgl.distributed import agree_min, broadcast_bytes, get_tp_info, init_distributed
from minisgl.engine.config import EngineConfig
from minisgl.engine.limits import EngineLimits
from minisgl.layers.parallel import check_tp
from minisgl.message.codec import decode, encode
from minisgl.models.config import ModelConfig


def join_ranks(
    config: EngineConfig, model_config: ModelConfig, device: torch.device
) -> torch.device:
    """Check that the model splits over the ranks, take this rank's device and join the
    group. On CUDA each rank of a machine has a GPU of its own; on a CPU the ranks of a
    machine share its threads rather than each taking them all."""
    check_tp(model_config, config.tp_size)  # before anything is loaded
    per_node = config.tp_size // config.nnodes
    if device.type == "cuda" and config.tp_size > 1:
        device = torch.device("cuda", config.tp_rank % per_node)
        torch.cuda.set_device(device)
    elif device.type == "cpu" and per_node > 1:
        torch.set_num_threads(max(1, torch.get_num_threads() // per_node))
    init_distributed(config.tp_rank, config.tp_size, config.dist_init_addr, device)
    return device


def agree_on_limits(limits: EngineLimits) -> EngineLimits:
    """This rank's limits with the KV pages every rank can hold (the fewest any has), once
    every rank has checked that its limits with them are rank 0's."""
    limits = replace(limits, num_pages=agree_min(limits.num_pages))
    check_ranks_agree(limits)
    return limits


def check_ranks_agree(limits: EngineLimits) -> None:
    """Raise ValueError on every rank unless every rank's limits are rank 0's. Ranks on other
    machines are started by command lines of their own, which may differ."""
    tp = get_tp_info()
    if tp.size == 1:
        return
    mine = encode(limits.to_dict()) if tp.is_primary else None
    primary = EngineLimits.from_dict(decode(broadcast_bytes(mine)))
    if agree_min(int(primary == limits)) == 1:
        return
    if primary == limits:
        raise ValueError(f"another rank's limits differ from rank 0's {limits}; see its log")
    raise ValueError(
        f"rank {tp.rank} has {limits}, but rank 0 has {primary}: "
        "start every rank with the same settings"
    )
