"""Emptying the prefix cache on demand: what POST /flush_cache asks of the scheduler.

A router's operator flushes every replica's cache to start a measurement cold, or after
swapping weights. Only an idle scheduler flushes: a running request holds (locks) the
cached prefix it reads, and pages it shares must not go back to the free list under it.
The API server refuses a flush while it has requests open, so a skipped flush here is a
request that slipped in between; the count of flushes done goes out in SchedulerStats,
which is how the API server learns that its flush happened. With KV-cache events on, a
flush publishes one AllBlocksCleared rather than a removal for every block.
"""

from __future__ import annotations

import logging
from typing import Any

from minisgl.message.backend import FlushCacheMsg, SchedulerStats
from minisgl.scheduler.kv_blocks import BlockEvents
from minisgl.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class CacheFlusher:
    def __init__(self, scheduler: Scheduler, kv_events: BlockEvents | None = None) -> None:
        self.scheduler = scheduler
        self.kv_events = kv_events
        self.done = 0

    def apply(self, messages: list[Any]) -> None:
        """Carry out a flush among `messages` (the scheduler itself ignores the message)."""
        if not any(isinstance(m, FlushCacheMsg) for m in messages):
            return
        if self.scheduler.has_work:
            logger.warning("cache flush skipped: requests are running")
            return
        cache = self.scheduler.cache
        slots = cache.cache.evict(cache.cache.evictable_tokens)
        cache._free_slots(slots)  # and what a page frees with it (a sliding group's page)
        if self.kv_events is not None:
            self.kv_events.cleared()
        self.done += 1
        logger.info("prefix cache flushed: %d KV pages free", cache.allocator.num_free)

    def report(self, stats: SchedulerStats) -> SchedulerStats:
        stats.cache_flushes_total = self.done
        return stats
