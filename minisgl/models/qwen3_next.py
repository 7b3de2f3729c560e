"""Qwen3-Next: Qwen3.5-MoE's decoder (Gated DeltaNet and gated attention, experts beside a
gated shared expert) in a text-only checkpoint with its linear layers' projections fused.

Its checkpoint stores two projections per linear layer where Qwen3.5 stores four, grouped
by key head: for each of the key heads g, `in_proj_qkvz` holds that head's q rows, its k rows,
then the v rows and the z rows of the value heads that share it; `in_proj_ba` holds, per key
head, the b rows then the a rows of those value heads. Value head g * r + i (r value heads per
key head) is the i-th of group g, so regrouping the rows by kind gives Qwen3.5's
in_proj_{qkv, z, b, a} exactly, with the same head order: the layer is loaded fused and
split once after loading (`after_load`), and runs as Qwen3.5's. Grouped by key head, the
rows of a tensor-parallel rank's key heads (and of the value heads that share them) lie
together: each rank reads one run of rows of each fused tensor and regroups its own.

Its config.json may leave `layer_types` out: every `full_attention_interval`-th layer
attends (`families.qwen3_next_defaults`). Norms scale by (1 + w) but the gated one, RoPE
turns a quarter of each head (no mrope), every MLP is MoE unless `mlp_only_layers` or
`decoder_sparse_step` say otherwise (those keep a dense MLP of `intermediate_size`).
"""

from __future__ import annotations

import torch

from minisgl.distributed import Split
from minisgl.layers.gated_deltanet import GatedDeltaNet, linear_of
from minisgl.layers.linear import Linear
from minisgl.models.families import LinearAttention
from minisgl.models.qwen3_5 import Qwen3_5ForCausalLM


class FusedProjGatedDeltaNet(GatedDeltaNet):
    """Gated DeltaNet whose checkpoint fuses q, k, v, z and b, a per key-head group."""

    def __init__(self, hidden_size: int, shape: LinearAttention, eps: float, index: int) -> None:
        super().__init__(hidden_size, shape, eps, index)
        s = shape  # the whole layer's: the checkpoint's rows
        del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a
        rows = s.conv_dim + s.num_value_heads * s.value_head_dim
        # Grouped by key head, a rank's heads are one run of rows: an even cut of each.
        self.in_proj_qkvz = Linear(hidden_size, rows, split=Split.even(0, rows))
        ba = Split.even(0, 2 * s.num_value_heads)
        self.in_proj_ba = Linear(hidden_size, 2 * s.num_value_heads, split=ba)

    def after_load(self) -> None:
        """Regroup the fused rows into Qwen3.5's four projections (see the module's doc): this
        rank's, whose key heads are the groups it loaded."""
        s = self.shape
        r = s.num_value_heads // s.num_key_heads  # value heads per key head
        qkvz = self.in_proj_qkvz.weight.data
        hidden = qkvz.size(1)
        sizes = [s.key_head_dim, s.key_head_dim, r * s.value_head_dim, r * s.value_head_dim]
        q, k, v, z = qkvz.view(s.num_key_heads, -1, hidden).split(sizes, dim=1)
        b, a = self.in_proj_ba.weight.data.view(s.num_key_heads, 2 * r, hidden).split(r, dim=1)
        del self.in_proj_qkvz, self.in_proj_ba
        rows = [t.reshape(-1, hidden) for t in (q, k, v)]
        self.in_proj_qkv = linear_of(torch.cat(rows))
        self.in_proj_z = linear_of(z.reshape(-1, hidden))
        self.in_proj_b = linear_of(b.reshape(-1, hidden))
        self.in_proj_a = linear_of(a.reshape(-1, hidden))
        super().after_load()  # and then into one, as Qwen3.5's


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    linear_attention = FusedProjGatedDeltaNet
