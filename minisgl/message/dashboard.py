"""The messages behind the live page of chapter 30: a watch from the API server, a snapshot back.

The API server asks for snapshots only while someone looks at the page: a `WatchMsg` is a
lease of a few seconds, renewed while a page stays connected, so a page that vanishes
without a word stops the recording soon after. The scheduler answers with a
`DashboardSnapshot` inside its usual `SchedulerOutput`, and the tokenizer worker, which owns
the tokenizer, turns the token ids in it into text when the server shows text.

A snapshot carries plain containers (dicts and lists of numbers and strings, the page grid
as bytes), not nested dataclasses: msgpack encodes those in C, while a dataclass is walked
field by field in Python. The fields are documented in docs/ch30_dashboard.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class WatchMsg:
    """From the API server straight to the scheduler: record and publish for `seconds` more."""

    seconds: float
    text: bool = False  # send the requests' and the tree's token ids, for their text


@dataclass
class DashboardSnapshot:
    """What the page draws, as the scheduler saw it after one of its steps."""

    seq: int  # numbers the snapshots of one scheduler, from 1
    time: float  # Unix time it was taken
    engine: dict[str, Any]  # what does not change: device, pool size, graph sizes, ...
    counters: dict[str, Any]  # rates and totals
    steps: dict[str, list[Any]]  # the last forwards, one column per field, oldest first
    running: list[dict[str, Any]]  # admitted requests, in admission order
    waiting: list[dict[str, Any]]  # queued requests, the next to be admitted first
    finished: list[dict[str, Any]]  # the latest finished requests, the newest first
    pool: dict[str, Any]  # page counts by state, and the grid (bytes: one letter a cell)
    tree: dict[str, Any]  # the radix tree's largest subtrees, as a list of nodes
    graphs: list[list[Any]] = field(default_factory=list)  # [kind, size, padded, replays, steps]

    def with_text(self, decode: Callable[[list[int]], str]) -> DashboardSnapshot:
        """Replace the token ids the scheduler put in (only when asked for text) by text."""
        for req in self.running + self.waiting + self.finished:
            for key in ("prompt", "output"):
                if (ids := req.pop(f"{key}_ids", None)) is not None:
                    req[f"{key}_text"] = decode(ids)
        for node in self.tree.get("nodes", []):
            if (ids := node.pop("ids", None)) is not None:
                node["text"] = decode(ids)
        return self
