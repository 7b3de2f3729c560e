"""The recurrent state pool: what a hybrid model's linear-attention layers keep per request.

A Gated DeltaNet layer (Qwen3.5) keeps no keys and values. It carries, per request, a fixed
amount of state from one token to the next, however long the sequence:
- a conv state: the last `conv_kernel - 1` inputs of its causal depthwise conv, over the q, k
  and v channels, in the model's dtype;
- an SSM state: one [key_head_dim, value_head_dim] matrix per value head, in float32 (the
  recurrence adds to it every token; in bf16 it would drift).

Storage is one tensor of each per pool, shaped [linear layers, slots, ...]. A slot belongs
to a page-table row: request row i keeps its state in slot i, and the last slot is the dummy
request's, where padding writes. Nothing is allocated or freed per request: a request owns
its row, so it owns the slot. A request's slot is zeroed when its first forward starts
(`cached_len == 0`); a later chunk of its prompt, or a decode step, reads what the previous
forward left there.
"""

from __future__ import annotations

import torch

from minisgl.core import Batch
from minisgl.models.families import LinearAttention
from minisgl.utils import to_device


class RecurrentStatePool:
    def __init__(
        self,
        num_layers: int,  # the linear-attention layers
        num_slots: int,  # page-table rows: running requests plus the dummy request
        shape: LinearAttention,
        conv_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        s = shape
        self.num_slots, self.device = num_slots, device
        self.conv = torch.zeros(
            (num_layers, num_slots, s.conv_dim, s.conv_kernel - 1), dtype=conv_dtype, device=device
        )
        self.ssm = torch.zeros(
            (num_layers, num_slots, s.num_value_heads, s.key_head_dim, s.value_head_dim),
            dtype=torch.float32,
            device=device,
        )

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.ssm))

    @staticmethod
    def bytes_per_slot(num_layers: int, shape: LinearAttention, conv_dtype: torch.dtype) -> int:
        s = shape
        conv = s.conv_dim * (s.conv_kernel - 1) * conv_dtype.itemsize
        ssm = s.num_value_heads * s.key_head_dim * s.value_head_dim * 4
        return num_layers * (conv + ssm)

    def prepare(self, batch: Batch) -> None:
        """`batch.state_slots`: each (padded) request's slot on the device; the slots of
        requests whose first forward this is are zeroed."""
        reqs = batch.padded_reqs
        slots = [r.table_idx for r in reqs]
        batch.state_slots = to_device(slots, self.device, torch.int64)
        fresh = [r.table_idx for r in reqs if r.cached_len == 0]
        if fresh:
            index = to_device(fresh, self.device, torch.int64)
            self.conv.index_fill_(1, index, 0)
            self.ssm.index_fill_(1, index, 0)
