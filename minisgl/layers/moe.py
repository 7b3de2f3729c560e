"""Mixture of experts: a router picks top-k expert MLPs per token and mixes their outputs.

The experts' weights are stored stacked ([experts, out, in]) so that a token-grouped
kernel could run them at once; this reference version loops over the experts that were
actually chosen, each processing the tokens routed to it in one matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import Split, all_reduce  # [ch21]
from minisgl.layers.activation import silu_and_mul
from minisgl.layers.fused_moe import fused_experts, loop_won, use_fused_moe  # [ch22]
from minisgl.layers.linear import Linear
from minisgl.models.config import MoEConfig


class MoEBlock(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.gate = Linear(hidden_size, moe.num_experts)  # the router
        self.experts = Experts(moe.num_experts, hidden_size, moe.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [tokens, top_k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(x, experts, weights.to(x.dtype))
        out = all_reduce(out)  # each rank's slice of every expert gave a partial sum  # [ch21]
        return out


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        gate_up_split = Split.even(1, intermediate_size, intermediate_size)  # [ch21]
        down_split = Split.even(2, intermediate_size)  # [ch21]
        intermediate_size = down_split.local_size  # each rank's slice of every expert  # [ch21]
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.gate_up_proj.tp_split, self.down_proj.tp_split = gate_up_split, down_split  # [ch21]

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        # >>> ch22 the fused kernel, where Triton can run it and the loop did not measure faster
        if use_fused_moe(x) and not loop_won(self.gate_up_proj, x.size(0)):
            return fused_experts(x, self.gate_up_proj, self.down_proj, experts, weights)
        # <<< ch22
        return self.forward_reference(x, experts, weights)

    def forward_reference(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(x)
        # Sort the (token, slot) pairs by expert so each expert's tokens are contiguous.
        flat_experts = experts.flatten()
        order = flat_experts.argsort(stable=True)
        tokens = order // experts.size(1)
        counts = torch.bincount(flat_experts, minlength=self.gate_up_proj.size(0)).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            idx = order[start : start + count]
            tok = tokens[start : start + count]
            h = silu_and_mul(F.linear(x[tok], self.gate_up_proj[expert]))
            h = F.linear(h, self.down_proj[expert]) * weights.flatten()[idx, None]
            out.index_add_(0, tok, h)
            start += count
        return out
