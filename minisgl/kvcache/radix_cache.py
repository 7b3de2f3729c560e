"""The radix prefix cache: KV pages of finished (and running) prompts, shared by prefix.

A radix tree whose edges are token sequences; walking it with a new prompt finds the
longest prefix whose K/V is already in the pool. Everything works in whole pages: an
edge's length is a multiple of page_size, so a matched prefix maps to whole pages that a
new request can point its page-table row at without copying anything.

Requests *lock* the path they use (a reference count on every node up to the root);
only unlocked leaves may be evicted, least recently used first.
"""

from __future__ import annotations

import heapq
import itertools

import torch

from minisgl.kvcache.base import BasePrefixCache, CacheListener, MatchResult
from minisgl.utils import common_prefix_len

_clock = itertools.count()


# >>> ch30
def access_tick() -> int:
    """A tick of the clock that orders accesses: the live page dates a node's last use by it."""
    return next(_clock)


# <<< ch30


class RadixNode:
    def __init__(self, key: torch.Tensor, value: torch.Tensor, parent: RadixNode | None) -> None:
        self.key = key  # token ids on the edge into this node
        self.value = value  # their KV slots
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.ref_count = 0
        self.last_access = next(_clock)

    @property
    def is_root(self) -> bool:
        return self.parent is None


class RadixCache(BasePrefixCache):
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        empty = torch.empty(0, dtype=torch.int32)
        self.root = RadixNode(empty, empty, None)
        self.root.ref_count = 1  # never evicted
        self.evictable_tokens = 0
        self.protected_tokens = 0
        self.listeners: list[CacheListener] = []  # told what is stored and evicted

    def _child_key(self, tokens: torch.Tensor) -> tuple[int, ...]:
        return tuple(tokens[: self.page_size].tolist())

    def match_prefix(self, input_ids: torch.Tensor) -> MatchResult:
        node, length, values = self.root, 0, []
        input_ids = input_ids[: len(input_ids) // self.page_size * self.page_size]
        while length < len(input_ids):
            child = node.children.get(self._child_key(input_ids[length:]))
            if child is None:
                break
            same = self._common_len(child.key, input_ids[length:])
            if same < len(child.key):
                child = self._split(child, same)
            child.last_access = next(_clock)
            values.append(child.value)
            node, length = child, length + same
        slots = torch.cat(values) if values else self.root.value
        return MatchResult(node, length, slots)

    def insert(self, input_ids: torch.Tensor, slots: torch.Tensor) -> int:
        """Add a page-aligned prefix and its slots; returns how much of it was already here.

        The caller owns the slots of the part that was already cached and must free them.
        """
        assert len(input_ids) % self.page_size == 0 and len(input_ids) == len(slots)
        match = self.match_prefix(input_ids)
        if match.length < len(input_ids):
            node = match.node
            rest = RadixNode(input_ids[match.length :].clone(), slots[match.length :].clone(), node)
            node.children[self._child_key(rest.key)] = rest
            self.evictable_tokens += len(rest.key)
            for listener in self.listeners:
                listener.stored(rest)
        return match.length

    def lock(self, node: RadixNode) -> None:
        while not node.is_root:
            if node.ref_count == 0:
                self.evictable_tokens -= len(node.key)
                self.protected_tokens += len(node.key)
            node.ref_count += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: RadixNode) -> None:
        while not node.is_root:
            node.ref_count -= 1
            assert node.ref_count >= 0, "radix node unlocked more often than locked"
            if node.ref_count == 0:
                self.protected_tokens -= len(node.key)
                self.evictable_tokens += len(node.key)
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_tokens: int) -> torch.Tensor:
        """Drop unlocked leaves, least recently used first, until num_tokens are freed."""
        heap = [(n.last_access, id(n), n) for n in self._nodes() if self._evictable_leaf(n)]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        count = 0
        while count < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._child_key(leaf.key)]
            self.evictable_tokens -= len(leaf.key)
            freed.append(leaf.value)
            count += len(leaf.value)
            for listener in self.listeners:
                listener.removed(leaf)
            if self._evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return torch.cat(freed) if freed else self.root.value

    def _evictable_leaf(self, node: RadixNode) -> bool:
        return not node.is_root and not node.children and node.ref_count == 0

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut node's edge at `at` tokens; returns the new upper node (keeps node's locks)."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node.key)
        upper = RadixNode(node.key[:at], node.value[:at], parent)
        upper.ref_count, upper.last_access = node.ref_count, node.last_access
        parent.children[self._child_key(upper.key)] = upper
        node.key, node.value, node.parent = node.key[at:], node.value[at:], upper
        upper.children[self._child_key(node.key)] = node
        return upper

    def _common_len(self, key: torch.Tensor, tokens: torch.Tensor) -> int:
        # Rounded down to whole pages: a node never holds part of a page.
        return common_prefix_len(key, tokens) // self.page_size * self.page_size

    def _nodes(self) -> list[RadixNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def check_integrity(self) -> None:
        evictable = protected = 0
        for node in self._nodes():
            if node.is_root:
                continue
            locks = sum(child.ref_count for child in node.children.values())
            assert node.ref_count >= locks, f"node locked {node.ref_count}x, children {locks}x"
            assert len(node.key) % self.page_size == 0 and len(node.key) == len(node.value)
            if node.ref_count == 0:
                evictable += len(node.key)
            else:
                protected += len(node.key)
        assert (evictable, protected) == (self.evictable_tokens, self.protected_tokens), (
            f"radix sizes drifted: counted {evictable}/{protected}, "
            f"recorded {self.evictable_tokens}/{self.protected_tokens}"
        )

    def all_slots(self) -> torch.Tensor:
        values = [node.value for node in self._nodes() if not node.is_root]
        return torch.cat(values) if values else self.root.value
