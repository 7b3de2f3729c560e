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
