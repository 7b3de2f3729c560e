"""Prefill graphs: a second kind of captured shape, by (request slots, tokens).

A prefill's shape is its token count, and a prompt may have any length: the plan captures
a ladder of token buckets, each with a number of request slots, and a prefill is padded
to the smallest bucket that holds its tokens. One filler request in the dummy row takes
the missing tokens; zero-length sentinel requests fill the empty slots.

Two modes. `breakable` (the default on CUDA) captures everything but attention, which
runs eagerly between graph segments on ordinary metadata (breakable.py); any backend
serves it. `full` captures attention too, from static prefill metadata: only backends
that list "prefill" in `cuda_graphs` keep it, and on a GPU only those.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from minisgl.attention.base import BaseAttnBackend
from minisgl.core import Batch, Req
from minisgl.engine.breakable import BoundaryBuffers, BreakableGraph
from minisgl.engine.graph import GraphKind, GraphPlan, GraphShape
from minisgl.engine.hybrid import graph_blocker  # [ch31]

if TYPE_CHECKING:
    from minisgl.attention.base import BaseAttnBackend
    from minisgl.engine.startup import EngineShape

logger = logging.getLogger(__name__)
# The default buckets' range, from the H200 (docs/benchmarks.md, Qwen3-0.6B's shape). Breakable
# graphs made a prefill 2.5-3x faster up to 256 tokens and 1.35x at 1,024, and changed nothing
# at 4,096 (0.99-1.06x): a prefill that long keeps the GPU busy without them, and buckets
# above only cost start-up time and memory and pad by up to a third of real work. Below 64
# tokens a prefill is launch-bound (16 and 64 tokens took the same 3.38 ms), so a smaller
# bucket saves nothing over padding to 64.
DEFAULT_MIN_TOKENS, DEFAULT_MAX_TOKENS = 64, 2048


def prefill_token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, 128, then steps of 1.5x and 4/3x (192, 256, 384, 512, ...) up to
    max_tokens, and max_tokens itself: a prefill is padded by less than half its size."""
    sizes, t = set(), 16
    while t < max_tokens:
        sizes.add(t)
        t = t * 2 if t < 128 else (t * 3 // 2 if t & (t - 1) == 0 else t * 4 // 3)
    return sorted(sizes | {max_tokens})


def prefill_slots(num_tokens: int, max_running_req: int) -> int:
    """Request slots of the prefill graph for `num_tokens` tokens: a bigger bucket holds
    more prompts. An empty slot costs a little metadata; a padded token costs real work."""
    return min(num_tokens, max_running_req, max(16, num_tokens // 16))


class PrefillGraphs(GraphKind):
    phase = "prefill"

    def __init__(self, shapes: list[GraphShape], dummy_req: Req, mode: str) -> None:
        super().__init__(shapes, dummy_req)
        self.mode = mode
        self.boundary = BoundaryBuffers()  # what crosses the breaks of breakable graphs
        # A zero-length request (no new token, one cached on the dummy page) fills a slot.
        self.sentinel = self.filler(0)
        self.sentinel.cached_len = self.sentinel.device_len = 1

    @property
    def graph_map(self) -> dict[tuple[int, int], Any]:  # type: ignore[override]
        """The captured graphs by (request slots, tokens)."""
        return {(s.slots, s.tokens): graph for s, graph in self.graphs.items()}

    @property
    def attention_slots(self) -> list[int]:
        return [s.slots for s in self.shapes] if self.mode == "full" else []

    def shape_for(self, batch: Batch) -> GraphShape | None:
        """The smallest bucket that holds the batch's tokens, if it has slots for its requests
        and for a filler; more tokens than the largest bucket: eager."""
        if any(r.wants_prompt_logprobs for r in batch.reqs):  # [ch25]
            return None  # every prompt token's logits, not one row per slot  # [ch25]
        tokens = sum(r.extend_len for r in batch.reqs)
        shape = next((s for s in self.shapes if s.tokens >= tokens), None)
        if shape is None or batch.size + (shape.tokens > tokens) > shape.slots:
            return None
        return shape

    def pad(self, batch: Batch, shape: GraphShape) -> list[Req]:
        tokens = sum(r.extend_len for r in batch.reqs)
        reqs = batch.reqs + ([self.filler(shape.tokens - tokens)] if shape.tokens > tokens else [])
        return reqs + [self.sentinel] * (shape.slots - len(reqs))

    def capture_batch(self, shape: GraphShape, backend: BaseAttnBackend) -> Batch:
        reqs = [self.filler(shape.tokens)] + [self.sentinel] * (shape.slots - 1)
        batch = Batch(reqs, self.phase)  # type: ignore[arg-type]
        if self.mode == "full":
            backend.prepare_for_capture(batch)
        else:  # attention runs eagerly, on ordinary metadata
            backend.prepare_metadata(batch)
        return batch

    def prepare_replay(self, batch: Batch, backend: BaseAttnBackend) -> None:
        if self.mode == "full":  # breakable graphs attend eagerly, as planned
            backend.prepare_for_replay(batch)

    def capture(
        self, shape: GraphShape, batch: Batch, forward: Callable[[], None], pool: Any, stream: Any
    ) -> Any:
        if self.mode == "full":
            return super().capture(shape, batch, forward, pool, stream)
        graph = self.graphs[shape] = BreakableGraph(self.boundary, batch, cuda=stream is not None)
        return graph.capture(forward, pool, stream)

    def filler(self, num_tokens: int) -> Req:
        """A request of `num_tokens` new tokens in the dummy row: its K/V goes to the dummy page."""
        row, params = self.dummy_req.table_idx, self.dummy_req.sampling_params
        req = Req(torch.zeros(1, dtype=torch.int32), row, 0, 1, -1, params)
        req.device_len = num_tokens
        return req


def plan_prefill_graphs(
    shape: EngineShape, plan: GraphPlan, backend: BaseAttnBackend
) -> list[PrefillGraphs]:
    """The prefill graphs to capture: none, or one kind of `prefill_graph` mode with its
    buckets. The default is breakable graphs on CUDA unless CUDA graphs are turned off
    (`cuda_graph_max_bs=0`), and none on the CPU, where asking for them gives emulated ones.
    Every prefill-graph setting is read here."""
    config, on_cuda = shape.config, shape.device.type == "cuda"
    mode = config.prefill_graph
    if mode is None:
        mode = "breakable" if on_cuda and config.cuda_graph_max_bs != 0 else "off"
    if mode == "off":
        return []
    blocker = plan.blocker
    blocker = blocker or graph_blocker(shape.model_config, shape.device.type)  # [ch31]
    if blocker is not None:
        logger.info("prefill graphs off: %s", blocker)
        return []
    if mode == "full" and on_cuda and "prefill" not in backend.cuda_graphs:
        raise ValueError(
            "prefill_graph='full' needs static prefill metadata, which the "
            f"{backend.name} attention backend does not have here; use 'breakable'"
        )
    tokens = config.prefill_graph_tokens
    if tokens is None:
        largest = config.prefill_graph_max_tokens or min(
            config.max_prefill_length, DEFAULT_MAX_TOKENS
        )
        ladder = prefill_token_buckets(largest)
        tokens = [t for t in ladder if t >= DEFAULT_MIN_TOKENS] or [largest]
    # A padding request is one sequence: its positions must stay inside the context.
    tokens = sorted({t for t in tokens if t <= plan.max_seq_len})
    shapes = [GraphShape(prefill_slots(t, config.max_running_req), t) for t in tokens]
    return [PrefillGraphs(shapes, plan.dummy_req, mode)]
