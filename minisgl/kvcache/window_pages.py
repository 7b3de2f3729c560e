"""Pages of their own for the sliding layers, given back as a request moves on.

A sliding layer reads only the last `window` positions, yet in one page table every page
holds page_size tokens of every group: a 32K conversation pays its sliding layers' bytes for
all 32K tokens. Here the sliding groups get their own, smaller page id space:

- The pool's sliding groups hold `window_pages` pages (and a dummy page, the last); a full
  page's sliding part is the windowed page `window_map[full page]` (a device tensor; the
  windowed dummy page where there is none). Storing translates the batch's KV slots through
  the map, inside the forward, so a graph replays it from its static slots.
- The attention kernels read a second page table, `window_table`, of the same shape as the
  page table: each position's windowed slot. The scheduler writes its entries when a request
  takes a page's windowed part (scheduler/window_cache.py), as it writes the page table, so
  a step costs nothing more than those writes. The backend swaps it in for the sliding
  layers (`WindowedTables`), and keeps a second set of metadata and static buffers for them,
  so graphs read both tables from fixed addresses. The table is kept, not gathered through
  the map every step: a gather costs rows x positions a step, the writes only the new pages.
  An entry outside a request's window may be stale (its page given to another request): the
  window masks it, and it always names a slot of the pool.
- Sizing: a running request holds at most cdiv(window + chunk, page_size) + 1 windowed pages
  however long it grows, so the windowed pool is sized for the running requests (twice: once
  more for what the prefix cache keeps), and the rest of the budget buys full pages at the
  bytes of the groups that keep every position. A model whose every layer slides keeps
  nothing by full page: its page ids then cost nothing, and every row can be filled.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from minisgl.distributed import agree_min
from minisgl.kvcache.layout import GroupedKVCache, KVLayout
from minisgl.utils import cdiv

if TYPE_CHECKING:
    from minisgl.attention.base import BaseAttnBackend
    from minisgl.core import Batch
    from minisgl.kvcache.layout import EngineShape

logger = logging.getLogger(__name__)


class WindowedKVCache(GroupedKVCache):
    """GroupedKVCache whose sliding groups hold `window_pages` pages of their own, reached
    from a full page through `window_map`."""

    def __init__(
        self,
        layout: KVLayout,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        window_pages: int,
    ) -> None:
        if window_pages < 1:
            raise ValueError(f"need window_pages >= 1, got {window_pages}")
        super().__init__(layout, num_pages, page_size, dtype, device, window_pages)
        assert layout.window is not None
        self.window, self.num_window_pages = layout.window, window_pages
        self.windowed = frozenset(
            layer for layer, (g, _) in enumerate(layout.place) if layout.groups[g].window
        )
        # full page -> windowed page; the windowed dummy page (window_pages) where none
        self.window_map = torch.full((num_pages + 1,), window_pages, dtype=torch.int32,
                                     device=device)  # fmt: skip
        self.window_table: torch.Tensor | None = None  # the backend's (WindowedTables)

    def window_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """The windowed slots of full slots: the same offset in the mapped page."""
        ps = self.page_size
        pages = self.window_map.index_select(0, slots // ps if ps > 1 else slots)
        return pages * ps + slots % ps if ps > 1 else pages

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer_id: int
    ) -> None:
        if layer_id in self.windowed:
            out_loc = self.window_slots(out_loc)
        super().store_kv(k, v, out_loc, layer_id)


def store_slots(kv_cache: Any, out_loc: torch.Tensor, layer_id: int) -> torch.Tensor:
    """Where a layer's new keys go: `out_loc`, or for a sliding layer of a windowed pool its
    windowed slots (for kernels that store K/V themselves)."""
    if isinstance(kv_cache, WindowedKVCache) and layer_id in kv_cache.windowed:
        return kv_cache.window_slots(out_loc)
    return out_loc


# ---- the attention backend: the sliding layers read the windowed table


class WindowedTables:
    """Mixed into an attention backend that reads the page table (triton, torch): the sliding
    layers attend through `window_table` and a metadata of their own (`batch.window_metadata`,
    built by the backend's own code with the table swapped in); graphs get static buffers
    for both."""

    def __init__(self, kv_cache: Any, page_table: torch.Tensor, *args: Any) -> None:
        super().__init__(kv_cache, page_table, *args)  # type: ignore[call-arg]
        assert isinstance(kv_cache, WindowedKVCache)
        ps, dummy = kv_cache.page_size, kv_cache.num_window_pages
        self.window_table = torch.zeros_like(page_table)
        width = page_table.size(1)
        self.window_table[-1] = dummy * ps + torch.arange(width, device=page_table.device) % ps
        kv_cache.window_table = self.window_table
        self.window_capture: Any = None
        self._inner = False  # inside one of the two passes: the backend's own code only

    @contextmanager
    def _windowed(self, batch: Batch | None) -> Iterator[None]:
        """The backend as the sliding layers see it: their table, metadata and buffers."""
        me: Any = self
        saved = (me.page_table, me.capture, me._inner)
        md = batch.attn_metadata if batch is not None else None
        me.page_table, me.capture, me._inner = self.window_table, self.window_capture, True
        if batch is not None:
            batch.attn_metadata = batch.window_metadata  # type: ignore[attr-defined]
        try:
            yield
        finally:
            self.window_capture = me.capture
            if batch is not None:
                batch.window_metadata = batch.attn_metadata  # type: ignore[attr-defined]
                batch.attn_metadata = md  # type: ignore[assignment]
            me.page_table, me.capture, me._inner = saved

    def prepare_metadata(self, batch: Batch) -> None:
        sup: Any = super()
        sup.prepare_metadata(batch)
        if self._inner:
            return
        batch.window_metadata = batch.attn_metadata  # type: ignore[attr-defined]
        with self._windowed(batch):
            sup.prepare_metadata(batch)

    def attend(self, q: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        me: Any = self
        sup: Any = super()
        if layer_id not in me.kv_cache.windowed:
            return sup.attend(q, layer_id, batch)
        with self._windowed(batch):
            return sup.attend(q, layer_id, batch)

    def init_capture_graph(self, max_seq_len: int, bs_list: list[int]) -> None:
        sup: Any = super()
        sup.init_capture_graph(max_seq_len, bs_list)
        with self._windowed(None):
            sup.init_capture_graph(max_seq_len, bs_list)

    def prepare_for_capture(self, batch: Batch) -> None:
        sup: Any = super()
        sup.prepare_for_capture(batch)  # the full layers' (the sliding ones' are filled in)
        if self._inner:
            return
        with self._windowed(batch):
            sup.prepare_for_capture(batch)

    def prepare_for_replay(self, batch: Batch) -> None:
        sup: Any = super()
        sup.prepare_for_replay(batch)
        if self._inner:
            return
        with self._windowed(batch):
            sup.prepare_for_replay(batch)


def windowed_backend(cls: type[BaseAttnBackend]) -> type[BaseAttnBackend]:
    """`cls` with its sliding layers reading the windowed table."""
    return type(cls.__name__, (WindowedTables, cls), {"__doc__": cls.__doc__})


# ---- sizing


def running_window_pages(shape: EngineShape, window: int) -> int:
    """The windowed pages the running requests may hold at once: each the pages over its
    window and its new tokens (one page more where they straddle pages), and a prefill's
    new tokens at most max_prefill_length in all."""
    ps, config = shape.page_size, shape.config
    return config.max_running_req * (cdiv(window, ps) + 2) + cdiv(config.max_prefill_length, ps)


def window_pages_for(shape: EngineShape, layout: KVLayout, num_pages: int) -> int:
    """The windowed pages of a pool of `num_pages` full pages: as many again as the running
    requests hold, for the windows the prefix cache keeps; never more than the full pages
    (each full page has at most one). Set by the budget (`budget_after_windows`) where it
    sized the pool."""
    assert layout.window is not None
    if shape.config.window_pages is not None:
        return min(shape.config.window_pages, num_pages)
    return min(2 * running_window_pages(shape, layout.window), num_pages)


def budget_after_windows(shape: EngineShape, layout: KVLayout, budget: int, per_page: int) -> int:
    """The full pages' budget once the windowed pages have theirs (`window_pages`, set here
    unless given). Where the budget cannot hold the windowed pages the running requests
    want at their full cost, every page keeps its windowed part, as without windowed pages."""
    if layout.window is None:
        return budget
    ps, config = shape.page_size, shape.config
    full, windowed = (b * ps for b in layout.split_bytes_per_token(shape.kv_dtype))
    useful = config.max_running_req * cdiv(shape.max_seq_len, ps)
    want = 2 * running_window_pages(shape, layout.window)
    if config.window_pages is not None:
        want = config.window_pages
    if full == 0:  # every layer slides: full pages are page ids, nothing more
        count = min(budget // windowed, useful)
        config.window_pages = agree_min(count)
        return useful * per_page
    if budget < want * (full + windowed):
        count = budget // (full + windowed)
        config.window_pages = agree_min(count)
        return count * per_page
    config.window_pages = agree_min(want)
    return budget - config.window_pages * windowed


def sequence_bytes_per_token(layout: KVLayout, dtype: torch.dtype, tokens: int) -> float:
    """What a sequence of `tokens` keeps a token, once its sliding groups keep only their
    last window: every token of the full groups, `window` tokens of the sliding ones."""
    full, windowed = layout.split_bytes_per_token(dtype)
    return full + windowed * min(tokens, layout.window or tokens) / tokens


def describe_split(layout: KVLayout, num_pages: int, window_pages: int, ps: int,
                   dtype: torch.dtype, tokens: int = 32768) -> str:  # fmt: skip
    """One line: the full and windowed pages, their bytes, and a long sequence's bytes a
    token (its full groups' every token, its sliding groups' last window) against all."""
    full, windowed = layout.split_bytes_per_token(dtype)
    long = sequence_bytes_per_token(layout, dtype, tokens)
    mib = 2**20
    return (
        f"KV pages: {num_pages} full ({num_pages * ps * full / mib:,.1f} MiB, {full:,} B a "
        f"token) and {window_pages} windowed ({window_pages * ps * windowed / mib:,.1f} MiB, "
        f"{windowed:,} B a token, the last {layout.window} positions); a {tokens:,}-token "
        f"sequence keeps {long:,.0f} B a token, against {full + windowed:,} B in one page table"
    )
