"""An adapter to the flash-attn package, for users who have it installed.

flash-attn reads a paged KV cache through a *block table*: row i lists the page ids of
request i in order. It is the Triton backend's metadata plus that table, so this class
extends that backend and changes only the two kernel calls. flash-attn 2 (>= 2.6) takes
pages of a multiple of 256 tokens; flash-attn 3 (the `flash_attn_interface` module of its
Hopper build) takes any page size.

Not exercised on our machines: flash-attn publishes no wheel for the torch and CUDA we
run, and building it takes about an hour. Its plumbing is tested on CPU against a
stand-in module (tests/test_triton_attention.py).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from minisgl.attention.triton_backend import TritonAttnBackend, TritonMetadata
from minisgl.utils import cdiv

if TYPE_CHECKING:
    from minisgl.core import Batch
    from minisgl.kvcache.mha_pool import MHAKVCache

FA2_PAGE_MULTIPLE = 256


def _flash_attn() -> tuple[ModuleType | None, int]:
    """(the module with flash_attn_with_kvcache / flash_attn_varlen_func, its major version)."""
    for name, major in (("flash_attn_interface", 3), ("flash_attn", 2)):
        if importlib.util.find_spec(name) is not None:
            return importlib.import_module(name), major
    return None, 0


@dataclass
class FlashAttnMetadata(TritonMetadata):
    block_table: torch.Tensor  # [bs, pages of the longest request] int32 page ids
    cu_seqlens_k: torch.Tensor  # [bs + 1] int32
    max_seq_len: int


class FlashAttnBackend(TritonAttnBackend):
    name = "fa"
    devices = ("cuda",)
    auto_devices = ()  # only when asked for by name
    cuda_graphs = ("decode",)

    @classmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype, page_size: int) -> str:
        if device.type != "cuda":
            return f"flash-attn needs a CUDA device, and this engine runs on {device.type}"
        module, major = _flash_attn()
        if module is None:
            return "the flash_attn package is not installed; --attn triton runs our own kernels"
        if dtype not in (torch.bfloat16, torch.float16):
            return f"flash-attn takes bfloat16 or float16, not {dtype}"
        if major == 2 and page_size % FA2_PAGE_MULTIPLE:
            return (
                f"flash-attn 2 reads paged KV only in pages of a multiple of "
                f"{FA2_PAGE_MULTIPLE} tokens, and the page size is {page_size} "
                f"(use --page-size {FA2_PAGE_MULTIPLE}, or --attn triton)"
            )
        return ""

    def __init__(
        self, kv_cache: MHAKVCache, page_table: torch.Tensor, scale: float, num_qo_heads: int
    ) -> None:
        super().__init__(kv_cache, page_table, scale, num_qo_heads)
        self.fa, _ = _flash_attn()
        self.page_size = kv_cache.page_size
        self.graph_table: torch.Tensor | None = None  # [max_bs, pages per row] for replays

    def _block_table(self, rows: torch.Tensor, num_pages: int) -> torch.Tensor:
        # Each page's first slot, divided by the page size, is the page id.
        first_slots = self.page_table[rows.long(), : num_pages * self.page_size : self.page_size]
        return first_slots // self.page_size

    def prepare_metadata(self, batch: Batch) -> None:
        super().prepare_metadata(batch)
        md = batch.attn_metadata
        assert isinstance(md, TritonMetadata)
        max_seq_len = max(r.device_len for r in batch.padded_reqs)
        cu_k = torch.zeros(len(md.rows) + 1, dtype=torch.int32, device=self.device)
        cu_k[1:] = torch.cumsum(md.seq_lens, 0)
        batch.attn_metadata = FlashAttnMetadata(
            qo_indptr=md.qo_indptr,
            rows=md.rows,
            seq_lens=md.seq_lens,
            max_extend_len=md.max_extend_len,
            block_table=self._block_table(md.rows, cdiv(max_seq_len, self.page_size)),
            cu_seqlens_k=cu_k,
            max_seq_len=max_seq_len,
        )

    def attend(self, q: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        md = batch.attn_metadata
        assert isinstance(md, FlashAttnMetadata)
        k_pages, v_pages = self.kv_cache.paged(layer_id)
        window: dict = {}
        # >>> ch29 flash-attn's (left, right) window: p - left .. p + right
        if (w := self.window(layer_id)) is not None:
            window["window_size"] = (w - 1, 0)
        # <<< ch29
        if md.max_extend_len == 1:
            out = self.fa.flash_attn_with_kvcache(
                q[:, None],
                k_pages,
                v_pages,
                cache_seqlens=md.seq_lens,
                block_table=md.block_table,
                softmax_scale=self.scale,
                causal=True,
                **window,
            )
            return out[:, 0]
        return self.fa.flash_attn_varlen_func(
            q,
            k_pages,
            v_pages,
            cu_seqlens_q=md.qo_indptr,
            cu_seqlens_k=md.cu_seqlens_k,
            max_seqlen_q=md.max_extend_len,
            max_seqlen_k=md.max_seq_len,
            softmax_scale=self.scale,
            causal=True,  # bottom-right aligned: the new tokens are the last positions
            block_table=md.block_table,
            **window,
        )

    def init_capture_graph(self, max_seq_len: int, bs_list: list[int]) -> None:
        super().init_capture_graph(max_seq_len, bs_list)
        assert self.capture is not None
        pages = cdiv(self.page_table.size(1), self.page_size)
        self.graph_table = self._block_table(self.capture.rows, pages)  # the dummy page

    def prepare_for_capture(self, batch: Batch) -> None:
        super().prepare_for_capture(batch)
        md, bs = batch.attn_metadata, batch.padded_size
        assert isinstance(md, TritonMetadata) and self.graph_table is not None
        batch.attn_metadata = FlashAttnMetadata(
            **vars(md),
            block_table=self.graph_table[:bs],
            cu_seqlens_k=torch.zeros(bs + 1, dtype=torch.int32, device=self.device),  # unused
            max_seq_len=self.page_table.size(1),
        )

    def prepare_for_replay(self, batch: Batch) -> None:
        super().prepare_for_replay(batch)
        md, bs = batch.attn_metadata, batch.padded_size
        assert isinstance(md, FlashAttnMetadata) and self.graph_table is not None
        self.graph_table[:bs, : md.block_table.size(1)].copy_(md.block_table)
