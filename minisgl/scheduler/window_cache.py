"""The cache manager of a model with sliding layers: their windowed pages, taken and freed.

With a sliding group, a full page may have a windowed page (kvcache/window_pages.py): its
sliding layers' keys. Who needs it:
- a running request, for the pages over its window: from the first key its next query reads,
  cached_len - window + 1, to its last page. It takes them as it gets pages (or as a cached
  prefix is attached), and gives back those that fall wholly before that key as it advances;
  its full pages stay. The windowed pages of a chunked prompt's earlier chunks go back the
  same way: the next chunk's first query reads no further back than its window.
- the prefix cache, for matches that end within a window of the page: the same prompt
  again, a shared system prompt, and above all the next turn of a conversation, which
  extends the whole previous sequence and must find the keys of its last window.
A page's windowed part is counted by its running holders. When the last lets go, a page the
prefix cache holds keeps it, *idle*: the idle parts are freed least recently released first
when windowed pages run short (so a finished sequence's last window, released last, goes
last), before the prefix cache itself is evicted. A page no cache holds frees it at once.
Full pages freed (a finished request's own pages, duplicates of cached ones, eviction, a
flush) free their windowed parts: no running request holds a page the cache may evict.

A match of the prefix cache ending at m is usable only if the windowed pages over
[m - window + 1, m) are there (the first computed query, at m, reads them): a match is cut
back to the deepest page boundary where they are. Two requests that computed the same prompt
at once: the cache keeps the first's pages, and the second's windowed pages move to them where
they have none (the keys are the same).

Admission and preemption count both kinds: a new page takes a full page and a windowed one,
so the pages available are the fewer of the two (free or evictable; free or idle). The count
is cautious: the pages a step gives back behind the window are not in it yet. The windowed
pool is sized for what the running requests can hold (window_pages.py), so it seldom binds.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from minisgl.core import Req
from minisgl.kvcache.allocator import PageAllocator
from minisgl.kvcache.base import MatchResult
from minisgl.kvcache.window_pages import WindowedKVCache
from minisgl.scheduler.cache import CacheManager
from minisgl.utils import to_device


class WindowCacheManager(CacheManager):
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        page_table: torch.Tensor,
        cache_type: str,
        pool: WindowedKVCache,
    ) -> None:
        super().__init__(num_pages, page_size, page_table, cache_type)
        assert pool.window_table is not None, "the attention backend sets the windowed table"
        self.pool, self.window = pool, pool.window
        self.window_table = pool.window_table
        self.window_pages = PageAllocator(pool.num_window_pages)
        self.none = pool.num_window_pages  # the windowed dummy page: no windowed page
        self.wmap = [self.none] * (num_pages + 1)  # host copy, a list: read per page per step
        self.wmap_t = torch.full((num_pages + 1,), self.none, dtype=torch.int32)  # for match
        self.refs = [0] * num_pages  # running requests holding each full page's windowed page
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached, unheld: least recent first
        self.hold_from: dict[int, int] = {}  # row -> the first position its request holds
        self._changed: dict[int, int] = {}  # full page -> windowed page, for the device
        self._places: list[int] = []  # window-table entries to write (flat row * width + col)
        self._slots: list[int] = []
        self._orphans: dict[int, int] = {}  # freed full pages' windowed pages, not yet freed
        self._deferring = False

    @property
    def window_free(self) -> int:
        return self.window_pages.num_free

    @property
    def available_pages(self) -> int:
        """Pages that can be handed out now, full and windowed: a new page takes one of each
        (the windowed ones: free, or idle on a cached page; an evictable page's windowed
        part is idle, or it has none)."""
        return min(super().available_pages, self.window_pages.num_free + len(self.idle))

    # ---- the cache manager's operations, for both kinds of pages

    def match(self, input_ids: torch.Tensor) -> MatchResult:
        """The cached prefix, cut back to where the windowed pages its next query reads are."""
        full = super().match(input_ids)
        ps, m = self.page_size, full.length
        if m == 0:
            return full
        pages = (full.slots[::ps] // ps).long()
        missing = (self.wmap_t[pages] == self.none).to(torch.int32)
        count = torch.cat([torch.zeros(1, dtype=torch.int32), missing.cumsum(0)])
        ends = torch.arange(len(pages) + 1)  # a match of `end` pages...
        first = (ends * ps - self.window + 1).clamp(min=0) // ps  # reads pages first..end-1
        usable = (count[ends] - count[first] == 0).nonzero().max().item()
        if usable == len(pages):
            return full
        match = self.cache.match_prefix(input_ids[: usable * ps])
        assert match.length == usable * ps
        return match

    def attach(self, req: Req, match: MatchResult) -> None:
        super().attach(req, match)
        start = self._first_read(match.length)
        self.hold_from[req.table_idx] = start
        self._hold(req.table_idx, start, self._pages(req.table_idx, start, match.length))
        self._commit()

    def allocate(self, reqs: list[Req]) -> None:
        """Give back the windowed pages the requests have left behind, then take the new
        pages' windowed parts (evicting the prefix cache if they run short)."""
        self._advance(reqs)
        self._commit()
        before = [req.alloc_len for req in reqs]
        super().allocate(reqs)
        self._commit()  # what eviction freed
        new = sum(req.alloc_len - b for req, b in zip(reqs, before)) // self.page_size
        self._room(new)
        spans = [(req.table_idx, b, req.alloc_len) for req, b in zip(reqs, before)]
        for (row, start, _), pages in zip(spans, self._pages_of(spans)):
            self._hold(row, start, pages)
        self._commit()

    def cache_req(self, req: Req, finished: bool) -> None:
        """Also: where the row now reads the cache's copy of a page it computed, the hold moves
        to the copy (with the windowed page, if the copy has none); a request that leaves
        lets go of its window, whose cached pages stay idle."""
        row, ps = req.table_idx, self.page_size
        start, end = self.hold_from[row], req.alloc_len
        old = self._pages(row, start, end)
        self._deferring = True
        try:
            super().cache_req(req, finished)
        finally:
            self._deferring = False
        new = self._pages(row, start, end)
        for i, (o, c) in enumerate(zip(old, new)):
            if o == c:
                continue
            if self.wmap[c] == self.none and o in self._orphans:
                self._map(c, self._orphans.pop(o))  # the same keys: the copy takes the page
            self._hold(row, start + i * ps, [c])
        if finished:  # the pages not freed with the request are the cache's now
            for page in new:
                if self.wmap[page] != self.none:
                    self._release(page, cached=True)
            del self.hold_from[row]
        self._commit()

    def trim(self, req: Req, upto: int) -> None:
        """Also: the windowed parts of the pages given back (rejected drafts')."""
        super().trim(req, upto)
        self._commit()

    def _free_slots(self, slots: torch.Tensor) -> None:
        """Full pages freed: their windowed pages too, whatever held them."""
        for page in (slots[:: self.page_size] // self.page_size).tolist():
            w = self.wmap[page]
            if w != self.none:
                self._map(page, self.none)
                self._orphans[page] = w
                self.refs[page] = 0
                self.idle.pop(page, None)
        if not self._deferring:
            self._commit()
        super()._free_slots(slots)

    # ---- holding and releasing

    def _first_read(self, position: int) -> int:
        """The page boundary at or before the first key a query at `position` reads."""
        return max(0, position - self.window + 1) // self.page_size * self.page_size

    def _pages(self, row: int, start: int, end: int) -> list[int]:
        return (self.host_table[row, start : end : self.page_size] // self.page_size).tolist()

    def _pages_of(self, spans: list[tuple[int, int, int]]) -> list[list[int]]:
        """`_pages` of each (row, start, end), read from the table at once: a decode step
        asks for one page a request, and one read per request costs more than the rest."""
        ps, width, flat = self.page_size, self.host_table.size(1), []
        for row, start, end in spans:
            flat += range(row * width + start, row * width + end, ps)
        pages = (self.host_table.view(-1)[torch.tensor(flat, dtype=torch.int64)] // ps).tolist()
        out, at = [], 0
        for _, start, end in spans:
            n = len(range(start, end, ps))
            out.append(pages[at : at + n])
            at += n
        return out

    def _hold(self, row: int, start: int, pages: list[int]) -> None:
        """The request of `row` holds the windowed parts of its pages from `start` on, each
        taken from the free list where it has none; its table entries written."""
        ps, width, wmap = self.page_size, self.window_table.size(1), self.wmap
        for i, page in enumerate(pages):
            self.refs[page] += 1
            self.idle.pop(page, None)
            if wmap[page] == self.none:
                self._map(page, self.window_pages.alloc(1)[0])
            place = row * width + start + i * ps
            self._places += range(place, place + ps)
            first = wmap[page] * ps
            self._slots += range(first, first + ps)

    def _release(self, page: int, cached: bool) -> None:
        """One holder lets go; the last frees the windowed page, or leaves it idle where the
        prefix cache holds the page."""
        self.refs[page] -= 1
        assert self.refs[page] >= 0, f"full page {page}'s windowed page released too often"
        if self.refs[page] > 0:
            return
        if cached:
            self.idle[page] = None
        else:
            self.window_pages.free([self.wmap[page]])
            self._map(page, self.none)

    def _advance(self, reqs: list[Req]) -> None:
        """Give back the pages wholly before the first key each request's next query reads."""
        moved = [(req, self.hold_from[req.table_idx], self._first_read(req.cached_len))
                 for req in reqs]  # fmt: skip
        moved = [(req, start, upto) for req, start, upto in moved if upto > start]
        spans = [(req.table_idx, start, upto) for req, start, upto in moved]
        for (req, start, upto), pages in zip(moved, self._pages_of(spans)):
            for i, page in enumerate(pages):
                self._release(page, cached=start + i * self.page_size < req.shared_len)
            self.hold_from[req.table_idx] = upto

    def _room(self, n: int) -> None:
        """At least n free windowed pages: the idle ones freed, least recently released
        first, then the prefix cache evicted, if need be."""
        while self.window_pages.num_free < n and self.idle:
            page, _ = self.idle.popitem(last=False)
            self.window_pages.free([self.wmap[page]])
            self._map(page, self.none)
        while self.window_pages.num_free < n and self.cache.evictable_tokens:
            short = n - self.window_pages.num_free
            self._free_slots(self.cache.evict(short * self.page_size))
        if self.window_pages.num_free < n:
            raise MemoryError(
                f"needed {n} windowed KV pages, only {self.window_pages.num_free} free of "
                f"{self.pool.num_window_pages}: raise window_pages or lower max_running_req"
            )

    def _map(self, page: int, window_page: int) -> None:
        self.wmap[page] = window_page
        self._changed[page] = window_page

    def _commit(self) -> None:
        """Free the orphaned windowed pages; send the map's and the table's changes."""
        if self._orphans:
            self.window_pages.free(list(self._orphans.values()))
            self._orphans.clear()
        device = self.window_table.device
        if self._changed:
            changed = torch.tensor([list(self._changed), list(self._changed.values())])
            self.wmap_t[changed[0]] = changed[1].to(torch.int32)
            where = to_device(changed, device)
            self.pool.window_map[where[0]] = where[1].to(torch.int32)
            self._changed.clear()
        if self._places:
            where = to_device(self._places + self._slots, device, torch.int64).view(2, -1)
            self.window_table.view(-1)[where[0]] = where[1].to(torch.int32)
            self._places, self._slots = [], []

    def check_integrity(self, running: list[Req]) -> None:
        """Also: every windowed page free or the part of one full page, held as counted by
        the running requests over their windows, or idle on a cached page."""
        super().check_integrity(running)
        mapped = [w for w in self.wmap[:-1] if w != self.none]
        every = self.window_pages.free_pages() + mapped
        assert len(every) == len(set(every)) == self.pool.num_window_pages, (
            f"windowed pages leaked or shared: {self.window_pages.num_free} free + "
            f"{len(mapped)} mapped, {len(set(every))} distinct, pool has "
            f"{self.pool.num_window_pages}"
        )
        held = [0] * self.num_pages
        for req in running:
            for page in self._pages(req.table_idx, self.hold_from[req.table_idx], req.alloc_len):
                held[page] += 1
        assert held == self.refs, "windowed pages' holders miscounted"
        has = [w != self.none for w in self.wmap[:-1]]
        idle = [page in self.idle for page in range(self.num_pages)]
        assert all(h == (r > 0 or i) for h, r, i in zip(has, self.refs, idle)), (
            "a windowed page neither held nor idle, or a held page without one"
        )
        cached = set((self.cache.all_slots()[:: self.page_size] // self.page_size).tolist())
        assert all(r == 0 for r in (self.refs[p] for p in self.idle)) and cached >= set(
            self.idle
        ), "an idle windowed page is held, or on a page the cache does not hold"
        assert self.pool.window_map.tolist() == self.wmap == self.wmap_t.tolist(), (
            "the device's map or the host's tensor differs"
        )


def window_cache(manager: CacheManager, kv_cache: object) -> CacheManager:
    """The cache manager a model runs with: for a pool with windowed pages, one that takes
    and frees them."""
    if not isinstance(kv_cache, WindowedKVCache):
        return manager
    cache_type = "radix" if type(manager.cache).__name__ == "RadixCache" else "naive"
    if type(manager) is not CacheManager:
        raise ValueError(
            f"{type(manager).__name__} cannot keep a sliding group's pages: a model with both "
            "recurrent states and sliding windows is not supported"
        )
    return WindowCacheManager(
        manager.num_pages, manager.page_size, manager.page_table, cache_type, kv_cache
    )


def window_counters(manager: CacheManager) -> dict:
    """What the live page shows of the sliding layers' own pages: those the running requests
    hold, those idle on cached pages (the first freed when pages run short), of the windowed
    pool (no counters for a model whose sliding layers keep none of their own)."""
    if not isinstance(manager, WindowCacheManager):
        return {}
    total, idle = manager.window_pages.num_pages, len(manager.idle)
    return {"window_pages_in_use": total - manager.window_free - idle,
            "window_pages_idle": idle, "window_pages": total}  # fmt: skip
