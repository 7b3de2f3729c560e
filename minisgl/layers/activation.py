"""The gated activation of Llama-family MLPs: silu(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.layers.elementwise_ops import elementwise_ops  # [ch20]
from minisgl.layers.fused import fused_ops  # [ch19]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # >>> ch20 our Triton kernel, unless FlashInfer is the attention backend
    if own := elementwise_ops(gate_up):
        return own.silu_and_mul(gate_up)
    # <<< ch20
    # >>> ch19
    if fi := fused_ops(gate_up):
        return fi.activation.silu_and_mul(gate_up)
    # <<< ch19
    return silu_and_mul_reference(gate_up)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
