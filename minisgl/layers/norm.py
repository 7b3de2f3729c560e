"""RMSNorm: scale each vector to unit root-mean-square, then by a learned weight.

`forward_add` also adds the residual first, the way every decoder layer uses it, so that
a fused kernel can do both in one pass over memory. The code here is the reference; the
kernel plan (layers/kernel_plan.py) installs a fused kernel in its place at start-up.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps
        self.into_gemv = False  # set where a projection's GEMV can do the norm  # [ch20]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reference(x)

    def forward_add(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual). May overwrite both inputs."""
        residual = x + residual
        return self.reference(residual), residual

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        # The statistics are taken in fp32 even for bf16 activations, as the reference does;
        # rounding here is where low-precision runs first drift apart.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
