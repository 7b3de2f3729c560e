"""What every attention backend provides.

A backend turns a batch into *metadata* (where each request's K/V lives, how long it is)
before the forward, and uses it inside every layer's attention. Keeping the metadata in
one object, built once per batch, is what later lets a CUDA graph read it from fixed
buffers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from minisgl.core import Batch
    from minisgl.kvcache.mha_pool import MHAKVCache


class BaseAttnMetadata(ABC):
    @abstractmethod
    def get_last_indices(self) -> torch.Tensor:
        """Index of each request's last new token in the flattened token dimension."""

    # >>> ch29
    def last_rows(self) -> BaseAttnMetadata | None:
        """The same requests with each one's last new token as its only query: a decode over
        the K/V the forward has written. None where a backend has no such view."""
        return None

    # <<< ch29


class BaseAttnBackend(ABC):
    """An attention implementation. The class attributes are what the registry reads."""

    name: str  # what `--attn` calls it
    devices: tuple[str, ...]  # device types it runs on
    auto_devices: tuple[str, ...] = ()  # where `--attn auto` may pick it
    # >>> ch18
    # The graph kinds ("decode", "prefill") it can be captured in on CUDA: lengths read on
    # the device, metadata in static buffers. On CPU, emulated graphs take every kind.
    cuda_graphs: tuple[str, ...] = ()
    # <<< ch18
    reads_fp8_kv: bool = False  # takes a KV cache of e4m3 keys and values  # [ch28]
    windows: tuple[int | None, ...] = ()  # each layer's sliding window, None: all  # [ch29]

    def __init__(
        self, kv_cache: MHAKVCache, page_table: torch.Tensor, scale: float, num_qo_heads: int
    ) -> None:
        """Every backend is offered what any backend needs: the KV pool, the engine's page
        table ([rows, max positions]: each position's KV slot), the softmax scale and this
        rank's query heads."""
        self.kv_cache, self.page_table, self.scale = kv_cache, page_table, scale
        self.num_qo_heads, self.device = num_qo_heads, page_table.device

    @classmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype, page_size: int) -> str:
        """Why this backend cannot run with these settings; "" when it can."""
        if device.type not in cls.devices:
            return f"runs on {' or '.join(cls.devices)}, not {device.type}"
        return ""

    # >>> ch29 sliding-window layers
    def set_windows(self, windows: list[int | None]) -> None:
        """Each layer's sliding window: a query at position p attends to the keys at
        positions p - window + 1 .. p only (None: to all before it)."""
        self.windows = tuple(windows)

    def window(self, layer_id: int) -> int | None:
        return self.windows[layer_id] if self.windows else None

    # <<< ch29
    @abstractmethod
    def prepare_metadata(self, batch: Batch) -> None:
        """Build `batch.attn_metadata` from the batch's requests (before the forward)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer_id: int,
        batch: Batch,
    ) -> torch.Tensor:
        """Store the new tokens' k/v into the KV pool, then attend q over each request's K/V.

        q: [tokens, q_heads, head_dim]; k, v: [tokens, kv_heads, head_dim], or None when the
        layer's fused kernel has written them into the pool already.
        Returns [tokens, q_heads, head_dim].
        """
        if k is not None:
            assert v is not None
            self.kv_cache.store_kv(k, v, batch.out_loc, layer_id)
        return self.attend(q, layer_id, batch)

    @abstractmethod
    def attend(self, q: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        """Attend q over each request's K/V in the pool (the new tokens' included)."""

    # >>> ch18 CUDA-graph hooks: metadata in static buffers
    def init_capture_graph(self, max_seq_len: int, bs_list: list[int]) -> None:
        """Allocate static metadata buffers big enough for every captured batch size (the
        request slots of every captured shape)."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_capture(self, batch: Batch) -> None:
        """Point `batch.attn_metadata` at the static buffers (the batch being captured)."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_replay(self, batch: Batch) -> None:
        """Copy this batch's metadata into the static buffers before a replay."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    # <<< ch18
