"""Linear layers. q/k/v and gate/up are stored merged, so each is one matmul per layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# >>> ch21 tensor parallelism: a layer may be cut across the ranks
from minisgl.distributed import Split, all_reduce, get_tp_info

# <<< ch21
from minisgl.layers.fused import NormedInput, gemv_kernel  # [ch20]

# >>> ch21
# A layer is cut one of two ways. Along its outputs (split dim 0, "column parallel"): each rank
# computes a slice of the output features from the whole input. Along its inputs (split dim
# 1, "row parallel"): each rank holds a slice of the input features and computes a partial
# sum of the whole output, and an all-reduce adds the partial sums up. A column layer feeding
# a row layer (qkv -> o_proj, gate_up -> down) needs one all-reduce for the pair: the slice
# that the first computes is exactly the slice of inputs that the second holds.
# <<< ch21


class Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        split: Split | None = None,  # [ch21]
    ) -> None:
        super().__init__()
        # >>> ch21 this rank's slice of the weight
        self.reduce = split is not None and split.dim == 1 and get_tp_info().size > 1
        if split is not None:
            whole = out_features if split.dim == 0 else in_features
            if sum(split.parts) != whole:
                raise ValueError(f"split {split} does not cover {whole} features")
            if split.dim == 0:
                out_features = split.local_size
            else:
                in_features = split.local_size
        # <<< ch21
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # >>> ch21
        self.weight.tp_split = split
        if self.bias is not None and split is not None and split.dim == 0:
            self.bias.tp_split = split  # sliced like the weight's rows
        # <<< ch21

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # >>> ch21 partial sums: add them up across the ranks, then add the bias once
        if self.reduce:
            y = all_reduce(self.matmul(x, None))
            return y if self.bias is None else y + self.bias
        # <<< ch21
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # >>> ch20 a few tokens: a matrix-vector product, the weights read once at full speed
        if isinstance(x, NormedInput):  # and the norm before it, in the same kernel
            return gemv_kernel(x.x)(x.x, self.weight, bias, **x.gemv_args())
        if gemv := gemv_kernel(x):
            return gemv(x, self.weight, bias)
        # <<< ch20
        return F.linear(x, self.weight, bias)
