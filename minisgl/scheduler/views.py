"""What a snapshot shows of the KV pool and the radix tree (chapter 30's page).

Both read the scheduler's own structures, never a copy kept on the side: the pool view
marks every page by its owner as `CacheManager.check_integrity` counts them, and the tree
view walks the radix tree. Each is written to stay cheap on big pools and trees: pages are
marked by whole lists in numpy, and only the largest subtrees are sent.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from minisgl.kvcache.radix_cache import RadixCache, RadixNode
from minisgl.utils import cdiv

if TYPE_CHECKING:
    from minisgl.scheduler.scheduler import Scheduler

TREE_NODES = 80  # radix nodes drawn: the largest subtrees
GRID_CELLS = 4096  # cells of the page grid; a bigger pool shares cells among pages
NODE_IDS = 12  # a node's first token ids, sent for its text when asked
FREE, RUNNING, CACHED, LOCKED = b"frcl"  # a page's state, as the grid's letters


def pool_view(s: Scheduler) -> dict[str, Any]:
    """Every page's owner, as check_integrity finds it: the cache's nodes (locked by a running
    request or evictable), the running requests' own pages, and free for the rest."""
    cm, ps = s.cache, s.cache.page_size
    state = np.full(cm.num_pages, FREE, dtype=np.uint8)
    if isinstance(cm.cache, RadixCache):
        nodes = _nodes(cm.cache.root)[1:]
        if nodes:
            pages = (torch.cat([n.value for n in nodes])[::ps] // ps).numpy()
            locked = [LOCKED if n.ref_count else CACHED for n in nodes]
            counts = [len(n.value) // ps for n in nodes]
            state[pages] = np.repeat(np.array(locked, dtype=np.uint8), counts)
    for req in s.reqs.values():
        own = cm.host_table[req.table_idx, req.shared_len : req.alloc_len][::ps] // ps
        state[own.numpy()] = RUNNING
    counts = {name: int((state == code).sum()) for name, code in _STATES.items()}
    cell = cdiv(cm.num_pages, GRID_CELLS)
    grid = state
    if cell > 1:  # each cell shows the state most of its pages are in
        padded = np.full(cdiv(cm.num_pages, cell) * cell, FREE, dtype=np.uint8)
        padded[: cm.num_pages] = state
        per = np.stack([(padded.reshape(-1, cell) == c).sum(1) for c in _STATES.values()])
        grid = np.frombuffer(bytes(_STATES.values()), dtype=np.uint8)[per.argmax(0)]
    return {"pages": cm.num_pages, "page_size": ps, "cell_pages": cell, **counts,
            "grid": grid.tobytes()}  # fmt: skip


_STATES = {"free": FREE, "running": RUNNING, "cached": CACHED, "locked": LOCKED}


def _nodes(root: RadixNode) -> list[RadixNode]:
    """Every node, each after its parent."""
    out, todo = [], [root]
    while todo:
        node = todo.pop()
        out.append(node)
        todo.extend(node.children.values())
    return out


def tree_view(root: RadixNode, last_used: Any, text: bool) -> dict[str, Any]:
    """The tree's largest subtrees, at most TREE_NODES nodes, each drawn after its parent:
    from the root, the shown node whose hidden child holds the most tokens shows it next."""
    nodes = _nodes(root)
    size = {id(n): len(n.key) for n in nodes}
    for node in reversed(nodes):  # children before parents
        if node.parent is not None:
            size[id(node.parent)] += size[id(node)]
    index = {id(root): 0}
    shown, frontier = [root], []
    order = itertools.count()  # ties go to the older entry

    def offer(node: RadixNode) -> None:
        for child in node.children.values():
            heapq.heappush(frontier, (-size[id(child)], next(order), child))

    offer(root)
    while frontier and len(shown) < TREE_NODES:
        best = heapq.heappop(frontier)[2]
        index[id(best)] = len(shown)
        shown.append(best)
        offer(best)
    views = []
    for node in shown:
        kids = node.children.values()
        view = {
            "id": index[id(node)],
            "parent": index[id(node.parent)] if node.parent is not None else None,
            "tokens": len(node.key),
            "subtree_tokens": size[id(node)],
            "refs": node.ref_count if node.parent is not None else 0,
            "children": len(kids),
            "hidden_children": sum(id(k) not in index for k in kids),
            "last_used_s": last_used(node) if node.parent is not None else None,
        }
        if text and node.parent is not None:
            view["ids"] = node.key[:NODE_IDS].tolist()
        views.append(view)
    return {"nodes": views, "total_nodes": len(nodes) - 1, "total_tokens": size[id(root)]}
