"""RMSNorm: scale each vector to unit root-mean-square, then by a learned weight.

`forward_add` also adds the residual first, the way every decoder layer uses it, so that
a fused kernel can do both in one pass over memory.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.layers.elementwise_ops import elementwise_ops  # [ch20]
from minisgl.layers.fused import fused_ops  # [ch19]
from minisgl.layers.triton_ops import defer_norm  # [ch20]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps
        self.into_gemv = False  # set where a projection's GEMV can do the norm  # [ch20]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # >>> ch20 our Triton kernel, unless FlashInfer is the attention backend
        if own := elementwise_ops(x):
            return own.rmsnorm(x, self.weight, self.eps)
        # <<< ch20
        # >>> ch19
        if fi := fused_ops(x):
            return fi.norm.rmsnorm(x, self.weight, self.eps)
        # <<< ch19
        return self.reference(x)

    def forward_add(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual). May overwrite both inputs."""
        # >>> ch20 a few tokens before a projection: the add and the norm go into its kernel
        if self.into_gemv and (deferred := defer_norm(x, residual, self.weight, self.eps)):
            return deferred  # type: ignore[return-value]
        if own := elementwise_ops(x):
            own.fused_add_rmsnorm(x, residual, self.weight, self.eps)  # in place
            return x, residual
        # <<< ch20
        # >>> ch19
        if fi := fused_ops(x):
            fi.norm.fused_add_rmsnorm(x, residual, self.weight, self.eps)  # in place
            return x, residual
        # <<< ch19
        residual = x + residual
        return self.reference(residual), residual

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        # The statistics are taken in fp32 even for bf16 activations, as the reference does;
        # rounding here is where low-precision runs first drift apart.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
