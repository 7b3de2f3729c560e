"""The gated activation of Llama-family MLPs: silu(gate) * up.

`silu_and_mul` runs the reference until the kernel plan (layers/kernel_plan.py) installs
a fused kernel at start-up (`use_silu_and_mul`); callers never choose.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


_silu_and_mul: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul_reference


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _silu_and_mul(gate_up)


def use_silu_and_mul(kernel: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Install the kernel that `silu_and_mul` runs from now on (the kernel plan's choice)."""
    global _silu_and_mul
    _silu_and_mul = kernel
