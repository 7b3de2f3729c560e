"""What the radix cache stores and evicts, as the block events a cache-aware router reads.

`BlockEvents` listens to the radix cache (kvcache/base.py's `CacheListener`): a node added
to the tree is a `BlockStored` of its pages, a leaf evicted a `BlockRemoved`. The events of
a pass of the worker loop go out as one message (kv_publisher.py) when the loop publishes.

A block is one KV page. Its hash is ours: blake2b with an 8-byte digest over the parent
block's digest (nothing for a prompt's first block) and the page's token ids as
little-endian int32, read as a big-endian unsigned integer. It names the whole prefix up to
its block, on every replica and every run. Consumers that hash tokens by a scheme of their
own (llm-d does) use ours only as an id, to match a removal to its store.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

from minisgl.kvcache.radix_cache import RadixCache, RadixNode
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.kv_publisher import KVEventPublisher
from minisgl.scheduler.scheduler import Scheduler


class BlockEvents:
    """A listener of the radix cache that collects block events until they are published."""

    def __init__(self, publisher: KVEventPublisher, page_size: int, medium: str) -> None:
        self.publisher, self.page_size, self.medium = publisher, page_size, medium
        self.pending: list[list[Any]] = []  # since the last publish

    def stored(self, node: RadixNode) -> None:
        """A node was added to the tree: its pages are new blocks."""
        tokens, hashes = self._path(node)
        n = len(node.key) // self.page_size
        parent = hashes[-n - 1] if len(hashes) > n else None
        event = ["BlockStored", hashes[-n:], parent, tokens[-len(node.key) :], self.page_size]
        self.pending.append(event + [None, self.medium, None])  # no LoRA, no LoRA name

    def removed(self, node: RadixNode) -> None:
        """A leaf was evicted (it still knows its parent, so its path is whole)."""
        _, hashes = self._path(node)
        n = len(node.key) // self.page_size
        self.pending.append(["BlockRemoved", hashes[-n:], self.medium])

    def cleared(self) -> None:
        """The cache was emptied: one event says so, instead of the removals before it."""
        self.pending = [["AllBlocksCleared"]]
        self.publish()

    def publish(self) -> None:
        """Send the events collected, if any, as one message."""
        if self.pending:
            events, self.pending = self.pending, []
            self.publisher.send(events)

    def close(self) -> None:
        """Send what is pending, then close the sockets."""
        self.publish()
        self.publisher.close()

    def _path(self, node: RadixNode) -> tuple[list[int], list[int]]:
        """The token ids from the root down to `node`'s end, and the hash of each page."""
        keys = []
        while node.parent is not None:
            keys.append(node.key)
            node = node.parent
        tokens = [t for key in reversed(keys) for t in key.tolist()]
        hashes, parent, ps = [], b"", self.page_size
        for i in range(0, len(tokens), ps):
            page = struct.pack(f"<{ps}i", *tokens[i : i + ps])
            parent = hashlib.blake2b(parent + page, digest_size=8).digest()
            hashes.append(int.from_bytes(parent, "big"))
        return tokens, hashes


def start_kv_events(config: SchedulerConfig, scheduler: Scheduler) -> BlockEvents | None:
    """Block events, listening to the scheduler's radix cache; None when they are off (or on a
    rank > 0: the ranks hold one cache between them, and rank 0 tells of it)."""
    if config.kv_events is None or config.tp_rank != 0:
        return None
    tree = scheduler.cache.cache
    if not isinstance(tree, RadixCache):
        raise ValueError("KV-cache events describe the radix prefix cache; --cache naive has none")
    medium = "GPU" if scheduler.engine.device.type == "cuda" else "CPU"
    events = BlockEvents(KVEventPublisher(config.kv_events), scheduler.cache.page_size, medium)
    tree.listeners.append(events)
    return events
