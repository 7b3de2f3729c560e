"""Small arithmetic that several modules share, written once so that it is right once."""

from __future__ import annotations

import torch


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for a >= 0 and b > 0, e.g. the pages that hold a tokens."""
    return -(-a // b)


def common_prefix_len(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading elements two 1-D tensors have in common."""
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if len(diff) else n


def to_device(
    data: torch.Tensor | list, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Host data on `device` without making the host wait for the device.

    A copy from ordinary (pageable) host memory may hold the host until the device has
    caught up; one from page-locked memory is queued and returns at once, which is what
    lets the host prepare the next batch while the device runs this one.
    """
    host = torch.as_tensor(data, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of a device tensor, queued behind the work that computes it: read it only
    once the device has reached this point (an event recorded after the copy says when)."""
    if t.device.type != "cuda":
        return t
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
