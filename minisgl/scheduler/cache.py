"""The cache manager: who owns each KV page, and the prefix cache on top.

Every page is in exactly one of three places: the free list, the prefix cache (shared,
locked by the requests using it or evictable), or owned by one running request (pages it
computed that are not cached yet). A request's page-table row reads, in order: its cached
prefix (`shared_len` tokens, owned by the cache), then its own pages up to `alloc_len`.
"""

from __future__ import annotations

import torch

from minisgl.core import Req
from minisgl.kvcache.allocator import PageAllocator
from minisgl.kvcache.base import BasePrefixCache, MatchResult
from minisgl.kvcache.naive_cache import NaiveCache
from minisgl.kvcache.radix_cache import RadixCache  # [ch11]
from minisgl.utils import cdiv, to_device

# An eviction frees at least 1/EVICT_AHEAD of the pool: a full cache then walks its tree
# once in many steps, not in every step (each needs a few pages).
EVICT_AHEAD = 64


class CacheManager:
    def __init__(self, num_pages: int, page_size: int, page_table: torch.Tensor, cache_type: str):
        if cache_type not in ("radix", "naive"):
            raise ValueError(f"cache_type must be 'radix' or 'naive', got {cache_type!r}")
        self.num_pages, self.page_size = num_pages, page_size
        self.page_table = page_table
        # A host copy of every row we write, so caching never waits for the device.
        self.host_table = torch.zeros_like(page_table, device="cpu")
        self.allocator = PageAllocator(num_pages)
        self.cache: BasePrefixCache = NaiveCache()
        if cache_type == "radix":  # [ch11]
            self.cache = RadixCache(page_size)  # [ch11]

    @property
    def available_pages(self) -> int:
        """Pages that can be handed out now: free, or cached and evictable."""
        return self.allocator.num_free + self.cache.evictable_tokens // self.page_size

    def pages_needed(self, req: Req, upto: int) -> int:
        """New pages `req` needs so that its row covers positions [0, upto)."""
        return max(0, cdiv(upto, self.page_size) - req.alloc_len // self.page_size)

    def match(self, input_ids: torch.Tensor) -> MatchResult:
        # Leave at least one token to compute: the forward must produce the next token's logits.
        return self.cache.match_prefix(input_ids[: len(input_ids) - 1])

    def attach(self, req: Req, match: MatchResult) -> None:
        """Point a new request's row at its cached prefix, and lock that prefix."""
        self.cache.lock(match.node)
        req.cache_handle, req.shared_len, req.alloc_len = match.node, match.length, match.length
        self._write(req.table_idx, 0, match.slots)

    def allocate(self, reqs: list[Req]) -> None:
        """Give each request pages for positions [alloc_len, device_len); the caller checked
        availability. One eviction and one device write for the whole batch."""
        ps, width = self.page_size, self.page_table.size(1)
        needs = [self.pages_needed(req, req.device_len) for req in reqs]
        total = sum(needs)
        if total == 0:
            return
        self._evict_for(total)
        places = []  # of each new page's first token in the table, flat: row * width + column
        for req, n in zip(reqs, needs):
            start = req.table_idx * width + req.alloc_len
            places += range(start, start + n * ps, ps)
            req.alloc_len += n * ps
        slots = [page * ps for page in self.allocator.alloc(total)]
        where = torch.tensor([places, slots])
        if ps > 1:  # along a page, place and slot both go up by one per token
            where = (where[:, :, None] + torch.arange(ps)).flatten(1)
        self.host_table.put_(where[0], where[1].to(torch.int32))
        where = to_device(where, self.page_table.device)
        self.page_table.put_(where[0], where[1].to(torch.int32))

    def cache_req(self, req: Req, finished: bool) -> None:
        """Move the request's computed, page-aligned prefix into the cache.

        Pages that turn out to be cached already (another request got there first) are
        freed and the row is pointed at the cached copy. A finished request also gives
        back its lock, its partial last page and any pages beyond.
        """
        valid = min(req.seq_len, req.cached_len) // self.page_size * self.page_size
        row = self.host_table[req.table_idx]
        slots = row[:valid].clone()
        already = self.cache.insert(req.input_ids[:valid], slots)
        self._free_slots(slots[req.shared_len : already])
        match = self.cache.match_prefix(req.input_ids[:valid])  # what the cache now holds
        self.cache.lock(match.node)
        self.cache.unlock(req.cache_handle)
        if already > req.shared_len:
            self._write(req.table_idx, 0, match.slots[:already])
        req.cache_handle, req.shared_len = match.node, match.length
        if finished:
            self.cache.unlock(req.cache_handle)
            self._free_slots(row[req.shared_len : req.alloc_len])
            req.cache_handle, req.shared_len, req.alloc_len = None, 0, 0

    # >>> ch26
    def trim(self, req: Req, upto: int) -> None:
        """Give back the request's own pages past position `upto` (rejected drafts' pages)."""
        keep = max(cdiv(upto, self.page_size) * self.page_size, req.shared_len)
        if keep < req.alloc_len:
            self._free_slots(self.host_table[req.table_idx, keep : req.alloc_len])
            req.alloc_len = keep

    # <<< ch26
    def _write(self, row: int, start: int, slots: torch.Tensor) -> None:
        if len(slots):
            self.host_table[row, start : start + len(slots)] = slots
            self.page_table[row, start : start + len(slots)] = to_device(
                slots, self.page_table.device
            )

    def _free_slots(self, slots: torch.Tensor) -> None:
        if len(slots):
            self.allocator.free((slots[:: self.page_size] // self.page_size).tolist())

    def _evict_for(self, num_pages: int) -> None:
        short = num_pages - self.allocator.num_free
        if short > 0:  # and a little more: each eviction walks the whole tree
            ahead = max(short, self.num_pages // EVICT_AHEAD)
            self._free_slots(self.cache.evict(ahead * self.page_size))
        if self.allocator.num_free < num_pages:
            raise MemoryError(f"needed {num_pages} KV pages, only {self.allocator.num_free} free")

    def check_integrity(self, running: list[Req]) -> None:
        """Free + cached + owned by requests == every page, each exactly once."""
        self.cache.check_integrity()
        ps = self.page_size
        free = self.allocator.free_pages()
        cached = (self.cache.all_slots()[::ps] // ps).tolist()
        owned: list[int] = []
        for req in running:
            own = self.host_table[req.table_idx, req.shared_len : req.alloc_len]
            owned += (own[::ps] // ps).tolist()
        everything = free + cached + owned
        assert len(everything) == len(set(everything)) == self.num_pages, (
            f"KV pages leaked or shared: {len(free)} free + {len(cached)} cached + "
            f"{len(owned)} owned by {len(running)} requests, {len(set(everything))} distinct, "
            f"pool has {self.num_pages}"
        )
        tokens = self.cache.evictable_tokens + self.cache.protected_tokens
        assert tokens == len(cached) * ps, (
            f"cache counts {tokens} tokens, holds {len(cached)} pages"
        )
