"""Where the experts run in chapter 22's fused Triton kernel instead of the loop over experts.

Triton compiles the kernel for the GPU; on the CPU its interpreter runs it when asked to
(TRITON_INTERPRET=1, as the tests and the chapter's example do). Where neither holds, or
triton is not installed, `Experts` runs its reference loop.
"""

from __future__ import annotations

import importlib.util
import os

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def use_fused_moe(x: torch.Tensor) -> bool:
    return HAS_TRITON and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def fused_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """`kernels.moe.fused_moe`, imported on first use: triton is slow to import."""
    from minisgl.kernels.moe import fused_moe

    return fused_moe(x, gate_up_proj, down_proj, experts, weights)
