"""CUDA graphs: one plan of every shape to capture, one loop that captures them, replay.

A decode step of a small model launches hundreds of tiny kernels and the GPU mostly waits
for the CPU to launch them. A CUDA graph records the whole forward once and replays it in
one launch. The price: the recorded kernels read and write fixed addresses, so every input
(token ids, positions, KV slots, attention metadata) must live in a static buffer that is
refilled before each replay, and a live batch is padded with dummy requests up to the
nearest captured shape.

A `GraphPlan` lists the shapes, grouped by kind: decode batches here, one token per
request; later chapters add kinds of their own (prefill and verify graphs). The
`GraphRunner` captures every shape of every kind in one loop, largest first, into one
memory pool, and replays the shape a live batch pads to.

On CPU there are no CUDA graphs; `EmulatedGraph` replays the forward against the batch it
was captured with, so it sees only what is in the static buffers, just as a real graph
would - a forgotten copy gives wrong tokens here too, instead of passing silently.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from minisgl.attention.base import BaseAttnBackend
from minisgl.core import Batch, Req, get_global_ctx
from minisgl.engine.jit_log import build_ahead, jit_log  # [ch20]
from minisgl.models.base import BaseLLMModel

if TYPE_CHECKING:
    from minisgl.engine.startup import EngineShape

logger = logging.getLogger(__name__)
Graph = Any  # torch.cuda.CUDAGraph, EmulatedGraph, or a kind's own graph type


@dataclass
class GraphCaptureBuffer:
    """Inputs of every captured graph, sized for the most tokens any graph takes, and the
    logits of the most rows any graph returns. Every graph reads and writes views of them."""

    input_ids: torch.Tensor  # [tokens]
    out_loc: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]
    logits: torch.Tensor  # [rows, vocab]
    state_slots: torch.Tensor | None = None  # [requests] a hybrid's state slots  # [ch31]
    state_offsets: torch.Tensor | None = None  # [requests + 1] where their tokens start  # [ch31]

    @classmethod
    def init(
        cls, num_tokens: int, num_rows: int, vocab_size: int, device: torch.device
    ) -> GraphCaptureBuffer:
        return GraphCaptureBuffer(
            input_ids=torch.zeros(num_tokens, dtype=torch.int32, device=device),
            out_loc=torch.zeros(num_tokens, dtype=torch.int32, device=device),
            positions=torch.zeros(num_tokens, dtype=torch.int32, device=device),
            logits=torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device),
        )

    def set_batch(self, batch: Batch, num_tokens: int) -> None:
        """At capture: the batch's inputs become views of the buffers."""
        s = slice(num_tokens)
        batch.input_ids, batch.out_loc, batch.positions = (
            self.input_ids[s],
            self.out_loc[s],
            self.positions[s],
        )
        if self.state_slots is not None:  # [ch31]
            batch.state_slots = self.state_slots[: batch.size]  # [ch31]
            batch.state_offsets = self.state_offsets[: batch.size + 1]  # [ch31]

    def copy_from(self, batch: Batch) -> None:
        """Before replay: this step's inputs go into the buffers."""
        s = slice(len(batch.input_ids))  # one per request in decode
        self.input_ids[s] = batch.input_ids
        self.out_loc[s] = batch.out_loc
        self.positions[s] = batch.positions
        if self.state_slots is not None:  # padded with the dummy request's slot  # [ch31]
            self.state_slots[: len(batch.state_slots)] = batch.state_slots  # [ch31]
            self.state_offsets[: len(batch.state_offsets)] = batch.state_offsets  # [ch31]


class EmulatedGraph:
    """The CPU stand-in for torch.cuda.CUDAGraph, with the same `replay()`."""

    def __init__(self, fn: Callable[[], None], batch: Batch) -> None:
        self.fn, self.batch = fn, batch

    def replay(self) -> None:
        ctx = get_global_ctx()
        # A real graph reads no Python objects: run against the captured batch, whose fields
        # are the static buffers, never the live batch.
        saved, ctx._batch = ctx._batch, self.batch
        try:
            self.fn()
        finally:
            ctx._batch = saved


@dataclass(frozen=True)
class GraphShape:
    """What one graph is captured for: `slots` requests holding `tokens` new tokens in all."""

    slots: int
    tokens: int


class GraphKind:
    """The graphs of one batch phase: their shapes, how a batch is made to capture each, and
    which shape a live batch pads up to. Decode is this simple case: one token per request,
    padded with the dummy request. Later kinds override the methods they do differently."""

    phase = "decode"

    def __init__(self, shapes: list[GraphShape], dummy_req: Req) -> None:
        self.shapes = sorted(shapes, key=lambda s: (s.tokens, s.slots))  # smallest first
        self.dummy_req = dummy_req
        self.graphs: dict[GraphShape, Graph] = {}

    @property
    def graph_map(self) -> dict[int, Graph]:
        """The captured graphs by batch size."""
        return {shape.slots: graph for shape, graph in self.graphs.items()}

    @property
    def attention_slots(self) -> list[int]:
        """The batch sizes whose attention metadata the backend keeps in static buffers."""
        return [s.slots for s in self.shapes]

    def logit_rows(self, shape: GraphShape) -> int:
        """Rows of logits a graph of `shape` returns: one per request slot."""
        return shape.slots

    def shape_for(self, batch: Batch) -> GraphShape | None:
        """The smallest shape that holds the batch; None: the batch runs eagerly."""
        return next((s for s in self.shapes if s.slots >= batch.size), None)

    def pad(self, batch: Batch, shape: GraphShape) -> list[Req]:
        """The batch's requests, then the requests that fill it up to `shape`."""
        return batch.reqs + [self.dummy_req] * (shape.slots - batch.size)

    def capture_batch(self, shape: GraphShape, backend: BaseAttnBackend) -> Batch:
        """A batch of `shape` whose attention metadata lives in the backend's static buffers."""
        batch = Batch(reqs=[self.dummy_req] * shape.slots, phase="decode")
        backend.prepare_for_capture(batch)
        return batch

    def prepare_replay(self, batch: Batch, backend: BaseAttnBackend) -> None:
        backend.prepare_for_replay(batch)

    def capture(
        self, shape: GraphShape, batch: Batch, forward: Callable[[], None], pool: Any, stream: Any
    ) -> Any:
        """Capture `forward` as the graph of `shape`; returns the memory pool for the next."""
        if stream is None:
            self.graphs[shape] = EmulatedGraph(forward, batch)
            return pool
        graph = self.graphs[shape] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            forward()
        return graph.pool() if pool is None else pool


def graph_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64, of 16 up to 128, of 32 up to 256, of 64 beyond,
    and max_bs itself: 19 graphs up to 256 instead of 35, each costing start-up time.

    A live batch is padded to the next size. Up to 64 requests the steps are as fine as
    before, so a small batch wastes at most 7 rows. Above, a padded row costs little: on
    the H200 a decode step of Qwen3-0.6B's shape grew from 2.0 ms at 64 requests to 3.2 ms
    at 256, about 6 us a request, so the at most 19% of rows padded there (65 -> 80,
    129 -> 160) add at most about 0.2 ms to a 3 ms step."""
    sizes, bs = {1, 2, 4}, 8
    while bs < max_bs:
        sizes.add(bs)
        bs += 8 if bs < 64 else 16 if bs < 128 else 32 if bs < 256 else 64
    return sorted(s for s in sizes | {max_bs} if s <= max_bs)


@dataclass
class GraphPlan:
    """Every shape to capture, by kind, fixed once from the engine's limits."""

    kinds: list[GraphKind]
    max_seq_len: int
    emulated: bool = False  # EmulatedGraphs (CPU, or debug mode on a GPU), not CUDA graphs
    blocker: str | None = None  # why the model cannot be captured on CUDA; None: it can

    @property
    def max_tokens(self) -> int:
        """The most tokens of any captured shape (0: none): larger batches run eagerly."""
        return max((s.tokens for kind in self.kinds for s in kind.shapes), default=0)

    @property
    def dummy_req(self) -> Req:
        """The request every kind pads its batches with (the decode kind's, always planned)."""
        return self.kinds[0].dummy_req

    @classmethod
    def of(
        cls, shape: EngineShape, model: BaseLLMModel, backend: BaseAttnBackend, dummy_req: Req
    ) -> GraphPlan:
        """The decode graphs, whose settings are all read here: no sizes where the model or
        the backend cannot be captured on CUDA. Later chapters' kinds join the plan after."""
        config, device = shape.config, shape.device
        plan = cls([], shape.max_seq_len, device.type != "cuda" or config.debug_cuda_graph)
        plan.blocker = blocker = model.cuda_graph_blocker if not plan.emulated else None
        if not plan.emulated and "decode" not in backend.cuda_graphs:
            blocker = f"the {backend.name} attention backend cannot be captured"
        sizes = config.cuda_graph_bs
        if sizes is None:
            max_bs = config.cuda_graph_max_bs
            if max_bs is None and device.type == "cuda":
                max_bs = default_max_bs(shape.free_memory_at_start)
            max_bs = min(max_bs or 0, config.max_running_req)
            sizes = graph_batch_sizes(max_bs) if max_bs else []
        if blocker is not None:
            if config.cuda_graph_max_bs != 0:
                logger.info("CUDA graphs off: %s", blocker)
            sizes = []
        shapes = [GraphShape(bs, bs) for bs in sorted(set(sizes))]
        plan.kinds.append(GraphKind(shapes, dummy_req))
        return plan


def default_max_bs(free_bytes: int) -> int:
    """The largest decode graph on a card with `free_bytes` free at start: 256 on a card sold
    as 80 GB or more (10^9 bytes: an 80 GB H100 has 79 GiB), else 160."""
    return 256 if free_bytes > 80 * 10**9 else 160


class GraphRunner:
    """Captures every shape of a `GraphPlan` and replays the one a live batch pads to."""

    def __init__(
        self,
        model: BaseLLMModel,
        attn_backend: BaseAttnBackend,
        plan: GraphPlan,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        """The shapes to capture and the buffers they read and write; `capture` records them
        (once the layers' kernels are installed)."""
        self.model, self.attn_backend, self.device = model, attn_backend, device
        self.kinds = {kind.phase: kind for kind in plan.kinds}
        self.stream = torch.cuda.Stream(device) if not plan.emulated else None
        self.capture_seconds: dict[str, float] = {}  # "decode graphs (19)" -> seconds
        # Largest first: every later graph reuses the memory pool of the first.
        self.todo = [(kind, s) for kind in plan.kinds for s in kind.shapes]
        self.todo.sort(key=lambda ks: (ks[1].tokens, ks[1].slots), reverse=True)
        if not self.todo:
            return
        slots = sorted({n for kind in plan.kinds for n in kind.attention_slots})
        if slots:
            self.attn_backend.init_capture_graph(plan.max_seq_len, slots)
        rows = max(kind.logit_rows(s) for kind, s in self.todo)
        tokens = max(s.tokens for _, s in self.todo)
        self.buffer = GraphCaptureBuffer.init(tokens, rows, vocab_size, self.device)
        if (states := get_global_ctx().state_pool) is not None:  # [ch31]
            n, buf = max(s.slots for _, s in self.todo), self.buffer  # [ch31]
            buf.state_slots, buf.state_offsets = states.graph_buffers(n, plan.dummy_req)  # [ch31]

    @property
    def graph_map(self) -> dict[int, Graph]:
        """The decode graphs by batch size."""
        return self.graphs("decode")

    def capture(self) -> None:
        """Capture every shape of the plan, each after one eager forward (its warm-up)."""
        if not self.todo:
            return
        start, free_before = time.perf_counter(), _free_memory(self.device)
        pool, ctx = None, get_global_ctx()
        with _gc_frozen(self.stream is not None):
            if self._builds_ahead():  # [ch20]
                ahead = build_ahead(self.dry_run, self.device)  # [ch20]
                self.capture_seconds["kernels built ahead"] = ahead  # [ch20]
            for kind, shape in self.todo:
                batch, forward = self._prepare(kind, shape)
                began = time.perf_counter()
                with ctx.forward_batch(batch):
                    forward()  # warm-up: lazy initialisation stays out of the graph
                    pool = kind.capture(shape, batch, forward, pool, self.stream)
                _synchronize(self.device)
                phase = f"{kind.phase} graphs ({len(kind.shapes)})"
                spent = self.capture_seconds.get(phase, 0.0) + time.perf_counter() - began
                self.capture_seconds[phase] = spent
        used, kinds = (free_before - _free_memory(self.device)) / 2**20, self.kinds.values()
        logger.info(
            "captured %s (%d) in %.2fs%s: %s",
            "emulated graphs" if self.stream is None else "CUDA graphs",
            len(self.todo),
            time.perf_counter() - start,
            f" ({used:.0f} MiB)" if self.device.type == "cuda" else "",
            "; ".join(f"{k.phase} {[(s.slots, s.tokens) for s in k.shapes]}" for k in kinds),
        )

    def _prepare(self, kind: GraphKind, shape: GraphShape) -> tuple[Batch, Callable[[], None]]:
        """The batch a graph of `shape` is captured with, its inputs in the buffer, and the
        forward to capture."""
        batch = kind.capture_batch(shape, self.attn_backend)
        self.buffer.set_batch(batch, shape.tokens)
        batch.logits_out = logits = self.buffer.logits[: kind.logit_rows(shape)]

        def forward() -> None:
            out = self.model.forward()  # the LM head's cast writes into the buffer...
            if out.data_ptr() != logits.data_ptr():  # ...unless a model's head goes on
                logits.copy_(out)

        return batch, forward

    # >>> ch20
    def _builds_ahead(self) -> bool:  # a GPU's capture, where the model has not started before
        return self.stream is not None and not jit_log().built_before

    def dry_run(self) -> None:
        """Every graph's forward once, eagerly: the calls whose Triton kernels `build_ahead`
        (jit_log.py) builds in threads first. On a fresh machine each takes about a second,
        and the capture would build them one after another as its forwards met them."""
        ctx = get_global_ctx()
        for kind, shape in self.todo:
            batch, forward = self._prepare(kind, shape)
            with ctx.forward_batch(batch):
                forward()
        _synchronize(self.device)

    # <<< ch20
    def graphs(self, phase: str) -> dict[Any, Graph]:
        """The captured graphs of one kind, by its own key ({} for a kind not planned)."""
        kind = self.kinds.get(phase)
        return kind.graph_map if kind is not None else {}

    def _find(self, batch: Batch) -> tuple[GraphKind, GraphShape] | None:
        """The kind and captured shape a batch pads to, or None: it runs eagerly."""
        kind = self.kinds.get(batch.phase)
        shape = kind.shape_for(batch) if kind is not None else None
        return (kind, shape) if kind is not None and shape in kind.graphs else None

    def can_use_cuda_graph(self, batch: Batch) -> bool:
        return self._find(batch) is not None

    def pad_batch(self, batch: Batch) -> None:
        """Round a batch up to the nearest captured shape of its kind (with dummy requests
        in decode); a batch no graph holds keeps its requests and runs eagerly."""
        found = self._find(batch)
        batch.padded_reqs = found[0].pad(batch, found[1]) if found else batch.reqs
        batch.graphed = found is not None

    def replay(self, batch: Batch) -> torch.Tensor:
        found = self._find(batch)
        assert found is not None and batch.padded_size == found[1].slots
        kind, shape = found
        self.buffer.copy_from(batch)
        kind.prepare_replay(batch, self.attn_backend)
        kind.graphs[shape].replay()
        return self.buffer.logits[: batch.num_logit_rows]

    def destroy_cuda_graphs(self) -> None:
        # Graphs go before anything they captured (NCCL communicators above all) is freed.
        for kind in self.kinds.values():
            kind.graphs.clear()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_memory(device: torch.device) -> int:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0


@contextmanager
def _gc_frozen(active: bool) -> Iterator[None]:
    # A collection in the middle of a capture could free memory the graph is recording into.
    if not active:
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
