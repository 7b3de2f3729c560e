"""The attention layer: split q/k/v, normalise and rotate q/k, then hand over to the backend.

The layer owns the math that is the same for every request; the backend owns everything
that depends on where each request's K/V lives (pages) and how long it is (metadata). On a
GPU the kernel plan (layers/kernel_plan.py) may install a forward that does the first
steps, or all of them for a decode, in one kernel of ours (layers/triton_ops.py).
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.core import (
    eager_on_graph,  # [ch23]
    get_global_ctx,
)
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryEmbedding


class AttentionLayer(nn.Module):
    def __init__(
        self,
        layer_id: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        qk_norm_eps: float | None = None,  # Qwen3 normalises each head of q and k
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rotary = rotary
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(get_global_ctx().batch.positions, q, k)
        return self.attend(q, k, v).reshape(-1, q_size)

    @eager_on_graph  # prefill attention plans on the host: it runs between segments  # [ch23]
    def attend(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        ctx = get_global_ctx()
        return ctx.attn_backend.forward(q, k, v, self.layer_id, ctx.batch)
