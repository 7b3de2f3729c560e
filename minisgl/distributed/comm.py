"""Process groups and the few collectives tensor parallelism needs, on torch.distributed.

Two groups join the same ranks. The device group carries the forward's tensors: NCCL
between GPUs, gloo between CPU processes. The control group is always gloo, on host
memory: rank 0 sends the scheduler's messages through it, so that they never wait in
line behind the GPU's work and never need a device copy. Ranks meet at a TCP address
(host:port of rank 0's machine), so they may live on several machines.

Nothing here touches the environment: NCCL reads its own settings (NCCL_*), and a
launcher that set them for its machine gets them honoured in every rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from minisgl.distributed.info import get_tp_info, set_tp_info

logger = logging.getLogger(__name__)

# torch 2.13 renamed all_gather_into_tensor; 2.11 has only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# Ranks other than 0 wait in a control broadcast for as long as rank 0 has nothing to say
# (an offline LLM between two generate calls): that wait must not time out.
_CONTROL_TIMEOUT = timedelta(days=365)


@dataclass
class _Groups:
    device: dist.ProcessGroup
    control: dist.ProcessGroup


_groups: _Groups | None = None


def init_distributed(rank: int, size: int, addr: str | None, device: torch.device) -> None:
    """Join ranks 0..size-1 at `addr` ("host:port"). With one rank, only set the info."""
    global _groups
    set_tp_info(rank, size)
    if size == 1:
        return
    if addr is None:
        raise ValueError("tensor parallelism needs a rendezvous address (host:port)")
    if device.type == "cuda":
        # device_id binds the communicator to this rank's GPU now, not at the first collective.
        dist.init_process_group(
            "nccl", init_method=f"tcp://{addr}", rank=rank, world_size=size, device_id=device
        )
    else:
        dist.init_process_group("gloo", init_method=f"tcp://{addr}", rank=rank, world_size=size)
    control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    _groups = _Groups(dist.group.WORLD, control)
    logger.info("rank %d of %d joined at %s over %s", rank, size, addr, dist.get_backend())


def destroy_distributed() -> None:
    global _groups
    if _groups is not None:
        dist.destroy_process_group()
        _groups = None
    set_tp_info(0, 1)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place (every rank gets the same sum). Capturable in a graph."""
    if _groups is not None:
        dist.all_reduce(x, group=_groups.device)
    return x


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """[n, d] on each rank -> [n, ranks * d], rank 0's columns first: the inverse of
    splitting the last dimension into equal slices, one per rank."""
    if _groups is None:
        return x
    size = get_tp_info().size
    out = torch.empty((size * x.size(0), x.size(1)), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x.contiguous(), group=_groups.device)
    # The gather stacks the ranks' blocks along dim 0; put each rank's columns side by side.
    return out.view(size, x.size(0), x.size(1)).permute(1, 0, 2).reshape(x.size(0), -1)


def broadcast_bytes(data: bytes | None) -> bytes:
    """Rank 0's `data` on every rank (the others pass None), over the control group."""
    assert _groups is not None, "broadcast_bytes needs init_distributed with several ranks"
    primary = get_tp_info().is_primary
    data = (data or b"") if primary else b""
    length = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(length, 0, group=_groups.control)
    if int(length) == 0:
        return b""
    if primary:
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        payload = torch.empty(int(length), dtype=torch.uint8)
    dist.broadcast(payload, 0, group=_groups.control)
    return data if primary else payload.numpy().tobytes()


def agree_min(value: int) -> int:
    """The smallest of the ranks' values, on every rank (e.g. KV pages that fit every GPU)."""
    if _groups is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_groups.control)
    return int(t)
