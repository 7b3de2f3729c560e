"""Rotary position embedding: rotate pairs of q/k channels by a position-dependent angle.

The cos/sin table is computed once for every position up to the context length and shared
by all layers, so a forward only gathers rows by position: no trigonometry per step, and
nothing that reads positions on the host (which a CUDA graph could not do).
"""

from __future__ import annotations

import functools

import torch

from minisgl.layers.rope_scaling import RopeScaling, frequencies  # [ch29]


class RotaryEmbedding:
    def __init__(
        self,
        head_dim: int,
        base: float,
        max_position: int,
        device: torch.device,
        rope: RopeScaling | None = None,  # a variant, in full: it overrides base  # [ch29]
    ) -> None:
        # fp32 tables whatever the model dtype, cast per use, as the reference does.
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim
        inv_freq, scale = 1.0 / (base**exponents), 1.0
        # >>> ch29 a scaled variant's frequencies, maybe for the first channels only
        if rope is not None:
            inv_freq, scale = frequencies(rope, device)
            max_position = max(rope.context, max_position)  # the engine's may be longer
        # <<< ch29
        self.rotary_dim = 2 * inv_freq.numel()  # the channels that turn (partial rotary: not all)
        positions = torch.arange(max_position, dtype=torch.float, device=device)
        angles = torch.cat([positions[:, None] * inv_freq[None, :]] * 2, dim=-1)
        self.cos, self.sin = angles.cos() * scale, angles.sin() * scale  # [max_position, dim]
        self.rotate = (
            self.reference
        )  # where the kernel plan (layers/kernel_plan.py) may put a kernel
        # >>> ch19 FlashInfer's layout: [max_position, cos of each pair | sin of each pair]
        half = self.rotary_dim // 2
        self.cos_sin = torch.cat([self.cos[:, :half], self.sin[:, :half]], dim=-1).contiguous()
        # <<< ch19

    def __call__(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, q_heads, head_dim], k: [tokens, kv_heads, head_dim]. May rotate in place."""
        return self.rotate(positions, q, k)

    def reference(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # >>> ch29 partial rotary: the channels past rotary_dim pass unrotated
        if (dim := self.rotary_dim) < q.size(-1):
            q_rot, k_rot = self.reference(positions, q[..., :dim], k[..., :dim])
            return torch.cat([q_rot, q[..., dim:]], -1), torch.cat([k_rot, k[..., dim:]], -1)
        # <<< ch29
        cos = self.cos[positions].to(q.dtype)[:, None, :]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


@functools.cache
def get_rope(
    head_dim: int,
    base: float,
    max_position: int,
    device: torch.device,
    rope: RopeScaling | None = None,  # [ch29]
) -> RotaryEmbedding:
    # >>> ch29
    if rope is not None:
        return RotaryEmbedding(head_dim, base, max_position, device, rope)
    # <<< ch29
    return RotaryEmbedding(head_dim, base, max_position, device)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)
