"""Linear layers. q/k/v and gate/up are stored merged, so each is one matmul per layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import Split, all_reduce  # [ch21]
from minisgl.layers.parallel import mark_split, needs_all_reduce, rank_shape  # [ch21]
from minisgl.layers.triton_ops import gemv_projection  # [ch20]
from minisgl.quant.fp8 import fp8_projection, is_fp8  # [ch28]


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
        # >>> ch28 FP8 weights: multiplied by FP8's own kernels, with their scales
        if is_fp8(self):
            return fp8_projection(x, self)
        # <<< ch28
        # >>> ch20 a few tokens: a matrix-vector product, the weights read once at full speed
        if (y := gemv_projection(x, self.weight, self.bias)) is not None:
            return y
        # <<< ch20
        return F.linear(x, self.weight, self.bias)
