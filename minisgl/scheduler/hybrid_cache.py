"""The prefix cache of a hybrid model: the radix cache, usable only where a state was saved.

A radix hit lets a request skip its prefix's forward. For the attention layers that is
enough: the prefix's K/V is in the cached pages. A linear-attention layer needs instead its
recurrent state after exactly those tokens, which only the skipped forward would compute. So
some radix nodes also hold a *snapshot*: every linear layer's conv and SSM state after the
tokens up to the node's end, kept in the state pool beside the running slots
(kvcache/state_pool.py). A match is cut back to its deepest node with a snapshot: the K/V
further down is in the pool, the state is not. Before its first forward, a request that hit
gets a copy of the snapshot in its own slot (where one that missed gets zeros).

Where snapshots are taken: where a request's state is known to end with its cached prefix.
- A request that leaves (finished, aborted or preempted): its slot holds the state after its
  last forwarded token, and the cache keeps its sequence up to the same token (the token
  sampled last was never forwarded, and is not cached either). With pages of one token (the
  default) they always end together; with larger pages, only where the sequence stops on a
  page boundary. The next turn of a conversation resumes there, and so does a preempted
  request.
- A branch point: when a new prompt parts from a cached sequence (or is the same prompt
  again: it parts at its last token), `BRANCH_MIN` tokens or more past the deepest snapshot,
  its first forward stops where it parts (`MatchResult.stop`) and the state there is saved:
  the next prompt with that prefix (a shared system prompt, the same prompt again) resumes
  there. It costs the request one more step, and no token twice.
- With pages larger than one token, the last page boundary of a prompt that goes on from
  the end of a cached sequence (a conversation's next turn): a sequence seldom leaves on a
  page boundary, so its state there is saved on the way, `BRANCH_MIN` tokens or more past
  the deepest snapshot. The first forward stops there, and the prompt's last tokens (fewer
  than a page) take one more step; a prompt that ends on a boundary takes none. Its next
  turn resumes there, recomputing less than a page and the answer. (A prompt that matches
  nothing does not stop: a step more for every new prompt, with one prompt cut at a time,
  would slow a burst of them.) With pages of one, the state where a request leaves serves
  its next turn.

Snapshots are few (`state_snapshots`: by default a quarter of the memory the running states
leave) and big (18 MiB for Qwen3.5-0.8B, as much as 1,500 tokens of its K/V). When none is
free, the least recently saved or restored one whose node no running request holds is
dropped, its node keeping its K/V (a conversation's older states go first: its newest one
serves its next turn); the radix cache tells its listeners what it evicts, and an evicted
node frees its snapshot. A node split in two keeps its snapshot on the lower half, which
still ends where the saved state does.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch

from minisgl.core import Req
from minisgl.kvcache.base import MatchResult
from minisgl.kvcache.radix_cache import RadixCache, RadixNode
from minisgl.kvcache.state_pool import RecurrentStatePool
from minisgl.scheduler.cache import CacheManager

logger = logging.getLogger(__name__)

# The cached K/V past the deepest snapshot that a prompt stops its first forward for, to save
# the state there: shorter, and the saving is not worth a snapshot and a step.
BRANCH_MIN = 32


class Snapshots:
    """Which radix node holds which snapshot of the pool, least recently saved or restored
    first. A listener of the radix cache: a node it evicts gives its snapshot back."""

    def __init__(self, pool: RecurrentStatePool) -> None:
        self.pool = pool
        self.free = list(range(pool.num_snapshots - 1, -1, -1))  # pop() hands out low ids first
        # Not the nodes' own LRU clock: a match touches every node on its path, so a state
        # saved halfway down a conversation would look as fresh as the one at its end.
        self.held: OrderedDict[RadixNode, int] = OrderedDict()

    def stored(self, node: RadixNode) -> None:
        pass

    def removed(self, node: RadixNode) -> None:
        snapshot = self.held.pop(node, None)
        if snapshot is not None:
            self.free.append(snapshot)

    def save(self, node: RadixNode, slot: int) -> None:
        """Keep the state of running slot `slot` (the state after `node`'s end) for `node`,
        if a snapshot is free or can be freed."""
        if node in self.held:
            self.held.move_to_end(node)
            return  # the same tokens: the same state
        if not self.free and not self._drop_least_recent():
            return  # every snapshot is held by a running request's prefix
        snapshot = self.free.pop()
        self.held[node] = snapshot
        self.pool.save(slot, snapshot)

    def restore(self, node: RadixNode, slot: int) -> None:
        self.held.move_to_end(node)
        self.pool.restore(self.held[node], slot)

    @property
    def available(self) -> bool:
        """Whether a snapshot could be saved now: one is free, or can be freed."""
        return bool(self.free) or any(node.ref_count == 0 for node in self.held)

    def _drop_least_recent(self) -> bool:
        """Free the least recently used snapshot whose node no running request holds (one
        that does may be copied into its slot)."""
        node = next((node for node in self.held if node.ref_count == 0), None)
        if node is None:
            return False
        self.removed(node)
        return True


class HybridCacheManager(CacheManager):
    """The cache manager of a hybrid model: the radix cache, matched down to a snapshot."""

    def __init__(
        self, num_pages: int, page_size: int, page_table: torch.Tensor, states: RecurrentStatePool
    ) -> None:
        super().__init__(num_pages, page_size, page_table, "radix")
        self.snapshots = Snapshots(states)
        self.cache.listeners.append(self.snapshots)
        self.stops: dict[int, int] = {}  # a row's first forward stops here to save the state

    def match(self, input_ids: torch.Tensor) -> MatchResult:
        """The cached prefix down to its deepest node with a snapshot; `stop` where the
        prompt parts from the cached K/V, or else (pages larger than one token) at the
        prompt's last page boundary, if that is BRANCH_MIN or more tokens further and a
        snapshot can be had."""
        full = super().match(input_ids)
        node, length = full.node, full.length
        while not node.is_root and node not in self.snapshots.held:
            length -= len(node.key)
            node = node.parent  # type: ignore[assignment]
        parts = bool(full.node.children)  # the match ended inside an edge (now split) or at a fork
        stop = full.length if parts else None
        if not parts and full.length and self.page_size > 1:  # goes on from a sequence's end
            stop = len(input_ids) // self.page_size * self.page_size
        if stop is not None and (stop - length < BRANCH_MIN or not self.snapshots.available):
            stop = None
        return MatchResult(node, length, full.slots[:length], stop)

    def attach(self, req: Req, match: MatchResult) -> None:
        """Also give the request's slot the state its cached prefix ends with."""
        super().attach(req, match)
        if match.length:
            self.snapshots.restore(match.node, req.table_idx)
        if match.stop is not None:
            self.stops[req.table_idx] = match.stop

    def cache_req(self, req: Req, finished: bool) -> None:
        """Also save the state, where the slot's ends with the cached prefix: when the request
        leaves, or where its first forward stopped to save it."""
        super().cache_req(req, finished)
        if not finished and self.stops.get(req.table_idx) != req.cached_len:
            return  # a chunk of a prompt, or all of it: not a place to save
        self.stops.pop(req.table_idx, None)
        done = req.cached_len  # the tokens whose state the slot holds, once queued work is done
        if done == 0 or done % self.page_size or done > req.seq_len:
            return  # the cache holds whole pages of known tokens: it ends before the state
        match = self.cache.match_prefix(req.input_ids[:done])
        assert match.length == done, f"cached {match.length} tokens of {done} just inserted"
        self.snapshots.save(match.node, req.table_idx)

    def check_integrity(self, running: list[Req]) -> None:
        """Also: each snapshot is free or held by one node of the tree, never both."""
        super().check_integrity(running)
        nodes, todo = set(), [self.cache.root]
        while todo:
            nodes.add(node := todo.pop())
            todo.extend(node.children.values())
        s = self.snapshots
        assert all(node in nodes for node in s.held), "a snapshot is held by an evicted node"
        every = s.free + list(s.held.values())
        assert sorted(every) == list(range(s.pool.num_snapshots)), (
            f"snapshots leaked or shared: {len(s.free)} free + {len(s.held)} held, "
            f"{len(set(every))} distinct, pool has {s.pool.num_snapshots}"
        )


def hybrid_cache(manager: CacheManager, states: RecurrentStatePool | None) -> CacheManager:
    """The cache manager a model runs with: for a hybrid model with the radix cache, one that
    keeps state snapshots; without snapshots, the naive cache (a hit would find no state)."""
    if states is None or not isinstance(manager.cache, RadixCache):
        return manager
    args: tuple[Any, ...] = (manager.num_pages, manager.page_size, manager.page_table)
    if states.num_snapshots == 0:
        logger.info(
            "prefix cache off (naive cache): state_snapshots is 0, and a hybrid model's "
            "cached prefix is usable only where its recurrent state was saved"
        )
        return CacheManager(*args, "naive")
    logger.info(
        "prefix cache: radix, with %d recurrent-state snapshots (a hit resumes from one)",
        states.num_snapshots,
    )
    return HybridCacheManager(*args, states)


def state_counters(reqs: int, manager: CacheManager, states: RecurrentStatePool | None) -> dict:
    """What the live page shows of a hybrid model's recurrent states: the slots the `reqs`
    running requests hold and the snapshots the prefix cache holds, each of its total (no
    counters for a model without linear layers, whose page then shows none)."""
    if states is None:
        return {}
    held = len(manager.snapshots.held) if isinstance(manager, HybridCacheManager) else 0
    return {"state_slots_in_use": reqs, "state_slots": states.num_slots - 1,
            "state_snapshots_held": held, "state_snapshots": states.num_snapshots}  # fmt: skip
