"""Linear layers. q/k/v and gate/up are stored merged, so each is one matmul per layer.

`matmul` is the reference; the kernel plan (layers/kernel_plan.py) installs a faster one
at start-up where it has one for the device, the dtype and the shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import Split, all_reduce  # [ch21]
from minisgl.layers.activation import silu_and_mul
from minisgl.layers.parallel import mark_split, needs_all_reduce, rank_shape  # [ch21]


class Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        split: Split | None = None,  # how the ranks share it (layers/parallel.py)  # [ch21]
    ) -> None:
        super().__init__()
        out_features, in_features = rank_shape(split, out_features, in_features)  # [ch21]
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        mark_split(split, self.weight, self.bias)  # [ch21]
        self.reduce = needs_all_reduce(split)  # [ch21]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        y = all_reduce(y) if self.reduce else y  # a row layer's partial sums, added up  # [ch21]
        return y

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class GatedLinear(Linear):
    """A merged [gate; up] projection with silu(gate) * up after it: one layer, so that a
    kernel may do the product and the activation in one pass."""

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(F.linear(x, self.weight, self.bias))
