"""The reference attention backend: plain PyTorch, any device, written to be read.

Every other backend is checked against this one. It gathers each request's K/V from the
pool through the page table and runs scaled-dot-product attention with a causal mask
that accounts for the cached prefix.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from minisgl.attention.base import BaseAttnBackend, BaseAttnMetadata
from minisgl.quant.kv_scales import widen  # [ch28]
from minisgl.utils import to_device

if TYPE_CHECKING:
    from minisgl.core import Batch
    from minisgl.kvcache.mha_pool import MHAKVCache


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for slot ids of any shape: one row copy per slot. `index_select` on the
    flattened ids is the same gather as advanced indexing, several times faster on CPU."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


@dataclass
class TorchAttnMetadata(BaseAttnMetadata):
    cu_seqlens_q: torch.Tensor  # [bs + 1] int32: request i's new tokens are q[cu[i]:cu[i+1]]
    cache_seqlens: torch.Tensor  # [bs] int32: K/V length of request i, new tokens included
    page_table: torch.Tensor  # [bs, >= max(cache_seqlens)] int32: KV slot of each position
    max_seqlen_q: int

    def get_last_indices(self) -> torch.Tensor:
        return self.cu_seqlens_q[1:] - 1

    # >>> ch29
    def last_rows(self) -> TorchAttnMetadata:
        n = self.cache_seqlens.size(0)
        one_each = torch.arange(n + 1, dtype=torch.int32, device=self.cu_seqlens_q.device)
        return TorchAttnMetadata(one_each, self.cache_seqlens, self.page_table, 1)

    # <<< ch29


# >>> ch18 static metadata for CUDA graphs
@dataclass
class TorchCaptureData:
    cu_seqlens_q: torch.Tensor  # [max_bs + 1]: 0, 1, ..., max_bs in decode
    seq_lens: torch.Tensor  # [max_bs]
    page_table: torch.Tensor  # [max_bs, every position of the longest sequence]


# <<< ch18
class TorchAttnBackend(BaseAttnBackend):
    name = "torch"
    devices = ("cpu", "cuda")
    auto_devices = ("cpu", "cuda")
    reads_fp8_kv = True  # [ch28]
    # >>> ch18
    # No `cuda_graphs`: its decode reads the longest length on the host, which a CUDA graph
    # cannot replay; on CPU the graph runner's EmulatedGraph does not care, so the hooks
    # below still serve it.
    # <<< ch18

    def __init__(
        self, kv_cache: MHAKVCache, page_table: torch.Tensor, scale: float, num_qo_heads: int
    ) -> None:
        super().__init__(kv_cache, page_table, scale, num_qo_heads)
        self.capture: TorchCaptureData | None = None  # [ch18]

    def prepare_metadata(self, batch: Batch) -> None:
        reqs = batch.padded_reqs
        extend_lens = [req.extend_len for req in reqs]
        seq_lens = [req.device_len for req in reqs]
        host = [0, *itertools.accumulate(extend_lens), *seq_lens, *(r.table_idx for r in reqs)]
        n = len(reqs)
        cu_seqlens_q, cache_seqlens, rows = to_device(host, self.device, torch.int32).split(
            [n + 1, n, n]
        )  # one copy for all three
        batch.attn_metadata = TorchAttnMetadata(
            cu_seqlens_q=cu_seqlens_q,
            cache_seqlens=cache_seqlens,
            page_table=self.page_table[rows, : max(seq_lens)],
            max_seqlen_q=max(extend_lens),
        )

    def attend(self, q: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        md = batch.attn_metadata
        assert isinstance(md, TorchAttnMetadata)
        k_cache, v_cache = self.kv_cache.k_cache(layer_id), self.kv_cache.v_cache(layer_id)
        window = None
        window = self.window(layer_id)  # [ch29]
        scales = self.kv_cache.scales(layer_id)  # [ch28]
        if md.max_seqlen_q == 1:
            return self._decode(
                q, k_cache, v_cache, md, window,
                scales,  # [ch28]
            )  # fmt: skip
        return self._extend(
            q, k_cache, v_cache, md, window,
            scales,  # [ch28]
        )  # fmt: skip

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: TorchAttnMetadata,
        window: int | None,
        scales: tuple[float, float],  # an FP8 cache's (k_scale, v_scale)  # [ch28]
    ) -> torch.Tensor:
        # One query per request: pad every request's K/V to the longest and mask the rest,
        # so the whole batch is one attention call.
        max_len = int(md.cache_seqlens.max().item())  # a host read: why graphs need other backends
        slots = md.page_table[:, :max_len].long()  # [bs, L]
        keys = gather_slots(k_cache, slots).transpose(1, 2)  # [bs, kv_heads, L, head_dim]
        values = gather_slots(v_cache, slots).transpose(1, 2)
        keys, values = widen(keys, values, q.dtype, scales)  # an FP8 cache  # [ch28]
        positions = torch.arange(max_len, device=q.device)
        mask = positions[None, :] < md.cache_seqlens[:, None]
        if window is not None:  # the query sits at seq_len - 1  # [ch29]
            mask &= positions[None, :] >= md.cache_seqlens[:, None] - window  # [ch29]
        mask = mask[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q[:, :, None, :], keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True
        )
        return out[:, :, 0, :]

    def _extend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: TorchAttnMetadata,
        window: int | None,
        scales: tuple[float, float],  # an FP8 cache's (k_scale, v_scale)  # [ch28]
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        cu = md.cu_seqlens_q.tolist()
        for i, seq_len in enumerate(md.cache_seqlens.tolist()):
            start, end = cu[i], cu[i + 1]
            if start == end:
                continue
            slots = md.page_table[i, :seq_len].long()
            keys = gather_slots(k_cache, slots).transpose(0, 1)  # [kv_heads, seq_len, head_dim]
            values = gather_slots(v_cache, slots).transpose(0, 1)
            keys, values = widen(keys, values, q.dtype, scales)  # [ch28]
            # New token j sits at position seq_len - n + j and sees every position up to it.
            n = end - start
            q_pos = torch.arange(seq_len - n, seq_len, device=q.device)
            k_pos = torch.arange(seq_len, device=q.device)[None, :]
            mask = k_pos <= q_pos[:, None]
            if window is not None:  # [ch29]
                mask &= k_pos > q_pos[:, None] - window  # [ch29]
            out[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1),
                keys,
                values,
                attn_mask=mask,
                scale=self.scale,
                enable_gqa=True,
            ).transpose(0, 1)
        return out

    # >>> ch18 CUDA-graph hooks
    def init_capture_graph(self, max_seq_len: int, bs_list: list[int]) -> None:
        max_bs, device = max(bs_list), self.device
        # The table spans the engine's full width (max_seq_len + 1 positions in whole pages),
        # so no replay can ever need a column that was not copied in.
        assert self.page_table.size(1) >= max_seq_len + 1
        self.capture = TorchCaptureData(
            cu_seqlens_q=torch.arange(max_bs + 1, dtype=torch.int32, device=device),
            seq_lens=torch.ones(max_bs, dtype=torch.int32, device=device),
            page_table=self.page_table[-1:].repeat(max_bs, 1),  # the dummy row: the dummy page
        )

    def prepare_for_capture(self, batch: Batch) -> None:
        # The shape's own metadata (one token per request in decode), copied in.
        self.prepare_metadata(batch)
        self.prepare_for_replay(batch)
        cap, bs = self.capture, batch.padded_size
        assert cap is not None
        batch.attn_metadata = TorchAttnMetadata(
            cu_seqlens_q=cap.cu_seqlens_q[: bs + 1],
            cache_seqlens=cap.seq_lens[:bs],
            page_table=cap.page_table[:bs, :],
            max_seqlen_q=batch.attn_metadata.max_seqlen_q,  # 1 in decode
        )

    def prepare_for_replay(self, batch: Batch) -> None:
        metadata, bs, cap = batch.attn_metadata, batch.padded_size, self.capture
        assert isinstance(metadata, TorchAttnMetadata) and cap is not None
        table_len = metadata.page_table.size(1)
        cap.cu_seqlens_q[: bs + 1].copy_(metadata.cu_seqlens_q)  # 0, 1, ..., bs in decode
        cap.seq_lens[:bs].copy_(metadata.cache_seqlens)
        cap.page_table[:bs, :table_len].copy_(metadata.page_table)

    # <<< ch18
