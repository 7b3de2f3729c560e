"""CUDA graphs for decode: capture once per batch size, replay with new inputs.

A decode step of a small model launches hundreds of tiny kernels and the GPU mostly waits
for the CPU to launch them. A CUDA graph records the whole forward once and replays it in
one launch. The price: the recorded kernels read and write fixed addresses, so every input
(token ids, positions, KV slots, attention metadata) must live in a static buffer that is
refilled before each replay, and a live batch is padded with dummy requests up to the
nearest captured size.

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
from typing import Any

import torch

from minisgl.attention.base import BaseAttnBackend
from minisgl.core import Batch, Req, get_global_ctx
from minisgl.engine.breakable import BoundaryBuffers, BreakableGraph  # [ch23]
from minisgl.engine.config import EngineConfig
from minisgl.models.base import BaseLLMModel

logger = logging.getLogger(__name__)
DEFAULT_PREFILL_TOKENS = 8192  # the scheduler's default prefill budget  # [ch23]


@dataclass
class GraphCaptureBuffer:
    """Inputs of every captured graph, sized for the most tokens any graph takes, and the
    logits of the most rows any graph returns. Every graph reads and writes views of them."""

    input_ids: torch.Tensor  # [tokens]
    out_loc: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]
    logits: torch.Tensor  # [rows, vocab]

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

    def copy_from(self, batch: Batch) -> None:
        """Before replay: this step's inputs go into the buffers."""
        s = slice(len(batch.input_ids))  # one per request in decode
        self.input_ids[s] = batch.input_ids
        self.out_loc[s] = batch.out_loc
        self.positions[s] = batch.positions


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


def graph_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_bs, and max_bs itself."""
    sizes = {bs for bs in (1, 2, 4) if bs <= max_bs} | set(range(8, max_bs + 1, 8)) | {max_bs}
    return sorted(sizes)


def decode_graph_sizes(
    config: EngineConfig,
    model: BaseLLMModel,
    attn_backend: BaseAttnBackend,
    device: torch.device,
    free_memory: int,
) -> list[int]:
    """The decode batch sizes to capture: none where the model or the backend cannot be
    captured on CUDA, an explicit list if given, else `graph_batch_sizes` up to a maximum."""
    on_cuda = device.type == "cuda"
    if on_cuda and not config.debug_cuda_graph:
        blocker = model.cuda_graph_blocker
        if not attn_backend.supports_cuda_graphs:
            blocker = f"the {attn_backend.name} attention backend cannot be captured"
        if blocker is not None:
            if config.cuda_graph_max_bs != 0:
                logger.info("CUDA graphs off: %s", blocker)
            return []
    if config.cuda_graph_bs is not None:
        return sorted(set(config.cuda_graph_bs))
    max_bs = config.cuda_graph_max_bs
    if max_bs is None and on_cuda:
        max_bs = 256 if free_memory > 80 * 2**30 else 160
    max_bs = min(max_bs or 0, config.max_running_req)
    return graph_batch_sizes(max_bs) if max_bs else []


# >>> ch23 prefill graphs
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


# <<< ch23
class GraphRunner:
    def __init__(
        self,
        model: BaseLLMModel,
        attn_backend: BaseAttnBackend,
        dummy_req: Req,
        bs_list: list[int],
        max_seq_len: int,
        vocab_size: int,
        device: torch.device,
        debug: bool = False,  # run eagerly through the same buffers, padding and metadata
        prefill_mode: str = "off",  # "breakable" or "full" with prefill_shapes  # [ch23]
        prefill_shapes: list[tuple[int, int]] | None = None,  # (slots, tokens)  # [ch23]
    ) -> None:
        self.attn_backend, self.dummy_req, self.device = attn_backend, dummy_req, device
        self.graph_bs_list = sorted(bs_list)
        self.max_graph_bs = max(bs_list, default=0)
        self.graph_map: dict[int, torch.cuda.CUDAGraph | EmulatedGraph] = {}
        self.stream = torch.cuda.Stream(device) if _is_cuda(device) and not debug else None
        # >>> ch23 prefill graphs, by (request slots, tokens), and what pads a prefill to them
        self.prefill_shapes = sorted(prefill_shapes or [], key=lambda shape: shape[1])
        self.prefill_mode = prefill_mode if self.prefill_shapes else "off"
        self.prefill_graph_map: dict[tuple[int, int], Any] = {}
        self.boundary = BoundaryBuffers()  # what crosses the breaks of breakable graphs
        # A zero-length request (no new token, one cached on the dummy page) fills a slot.
        self.sentinel = self._filler(0)
        self.sentinel.cached_len = self.sentinel.device_len = 1
        if self.prefill_shapes:
            self._capture_graphs(max_seq_len, vocab_size, model)
            return
        # <<< ch23
        if self.graph_bs_list:
            self._capture_graphs(max_seq_len, vocab_size, model)

    def _capture_graphs(self, max_seq_len: int, vocab_size: int, model: BaseLLMModel) -> None:
        start = time.perf_counter()
        if self.graph_bs_list:
            self.attn_backend.init_capture_graph(max_seq_len, self.graph_bs_list)
        tokens = rows = self.max_graph_bs
        # >>> ch23 prefill graphs take more tokens, and return one row per request slot
        if self.prefill_mode == "full":
            self.attn_backend.init_capture_prefill(max_seq_len, self.prefill_shapes)
        tokens = max([tokens, *(t for _, t in self.prefill_shapes)])
        rows = max([rows, *(s for s, _ in self.prefill_shapes)])
        # <<< ch23
        _synchronize(self.device)
        free_before = _free_memory(self.device)
        self.buffer = GraphCaptureBuffer.init(tokens, rows, vocab_size, self.device)
        pool = None
        with _gc_frozen(self.stream is not None):
            # >>> ch23 the largest prefill first: every later graph reuses its memory pool
            for slots, tokens in reversed(self.prefill_shapes):
                batch = Batch([self._filler(tokens)] + [self.sentinel] * (slots - 1), "prefill")
                if self.prefill_mode == "full":
                    self.attn_backend.prepare_for_capture(batch)
                else:  # attention runs eagerly, on ordinary metadata
                    self.attn_backend.prepare_metadata(batch)
                self.buffer.set_batch(batch, tokens)
                graph, pool = self._capture(model, batch, self.buffer.logits[:slots], pool)
                self.prefill_graph_map[slots, tokens] = graph
            # <<< ch23
            for bs in sorted(self.graph_bs_list, reverse=True):  # largest first: its pool is reused
                batch = Batch(reqs=[self.dummy_req] * bs, phase="decode")
                batch.padded_reqs = batch.reqs
                self.attn_backend.prepare_for_capture(batch)
                self.buffer.set_batch(batch, bs)
                logits = self.buffer.logits[:bs]
                self.graph_map[bs], pool = self._capture(model, batch, logits, pool)
        _synchronize(self.device)
        mode = "CUDA graphs" if self.stream is not None else "emulated graphs"
        logger.info(
            "captured %s for batch sizes %s in %.2fs%s",
            mode,
            self.graph_bs_list,
            time.perf_counter() - start,
            f", graph memory {(free_before - _free_memory(self.device)) / 2**20:.0f} MiB"
            if _is_cuda(self.device)
            else "",
        )
        # >>> ch23
        if self.prefill_shapes:
            logger.info(
                "%s prefill graphs for %s tokens (up to %d requests), boundary buffers %.0f MiB",
                self.prefill_mode,
                [t for _, t in self.prefill_shapes],
                max(s for s, _ in self.prefill_shapes),
                self.boundary.nbytes / 2**20,
            )
        # <<< ch23

    def _capture(
        self, model: BaseLLMModel, batch: Batch, logits: torch.Tensor, pool: Any
    ) -> tuple[torch.cuda.CUDAGraph | EmulatedGraph, Any]:
        """Warm up, then capture one forward writing `logits`; returns the graph and the pool."""

        def forward() -> None:
            logits.copy_(model.forward())

        with get_global_ctx().forward_batch(batch):
            forward()  # warm-up: lazy initialisation stays out of the graph
            # >>> ch23
            if batch.is_prefill and self.prefill_mode == "breakable":
                graph = BreakableGraph(self.boundary, batch, cuda=self.stream is not None)
                return graph, graph.capture(forward, pool, self.stream)  # type: ignore[return-value]
            # <<< ch23
            if self.stream is None:
                return EmulatedGraph(forward, batch), pool
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=self.stream):
                forward()
            return graph, graph.pool() if pool is None else pool

    def can_use_cuda_graph(self, batch: Batch) -> bool:
        # >>> ch23
        if batch.is_prefill:
            fits = self._prefill_key(batch) in self.prefill_graph_map
            fits = fits and batch.logit_rows is None  # every prompt token's logits  # [ch25]
            return fits
        # <<< ch23
        return batch.is_decode and 0 < batch.size <= self.max_graph_bs

    def pad_batch(self, batch: Batch) -> None:
        """Round a decode batch up to the nearest captured size with dummy requests."""
        # >>> ch23
        if batch.is_prefill:
            self._pad_prefill(batch)
            return
        # <<< ch23
        padded = (
            next(bs for bs in self.graph_bs_list if bs >= batch.size)
            if self.can_use_cuda_graph(batch)
            else batch.size
        )
        batch.padded_reqs = batch.reqs + [self.dummy_req] * (padded - batch.size)

    def replay(self, batch: Batch) -> torch.Tensor:
        assert self.can_use_cuda_graph(batch)
        self.buffer.copy_from(batch)
        # >>> ch23
        if batch.is_prefill:
            if self.prefill_mode == "full":  # breakable graphs attend eagerly, as planned
                self.attn_backend.prepare_for_replay(batch)
            self.prefill_graph_map[self._prefill_key(batch)].replay()
            return self.buffer.logits[: batch.size]
        # <<< ch23
        self.attn_backend.prepare_for_replay(batch)
        self.graph_map[batch.padded_size].replay()
        return self.buffer.logits[: batch.size]

    # >>> ch23
    @staticmethod
    def prefill_plan(
        config: EngineConfig,
        model: BaseLLMModel,
        attn_backend: BaseAttnBackend,
        device: torch.device,
        max_seq_len: int,
    ) -> tuple[str, list[tuple[int, int]]]:
        """(mode, [(request slots, tokens), ...]) of the prefill graphs to capture.

        The default is breakable graphs on CUDA (emulated ones in debug mode, which then
        pads and replays alike) unless CUDA graphs are turned off (`cuda_graph_max_bs=0`),
        and none on the CPU, where asking for them gives emulated ones. `full` needs a
        backend whose prefill metadata has static buffers."""
        mode, emulated = config.prefill_graph, device.type != "cuda" or config.debug_cuda_graph
        if mode is None:
            on = device.type == "cuda" and config.cuda_graph_max_bs != 0
            mode = "breakable" if on else "off"
        if mode == "off":
            return "off", []
        if not emulated and model.cuda_graph_blocker is not None:
            logger.info("prefill graphs off: %s", model.cuda_graph_blocker)
            return "off", []
        hooks = type(attn_backend).init_capture_prefill is not BaseAttnBackend.init_capture_prefill
        if mode == "full" and not (hooks and (emulated or attn_backend.supports_prefill_graphs)):
            raise ValueError(
                "prefill_graph='full' needs static prefill metadata, which the "
                f"{attn_backend.name} attention backend does not have here; use 'breakable'"
            )
        tokens = config.prefill_graph_tokens
        if tokens is None:
            max_tokens = config.prefill_graph_max_tokens or DEFAULT_PREFILL_TOKENS
            tokens = prefill_token_buckets(max_tokens)
        # A padding request is one sequence: its positions must stay inside the context.
        tokens = sorted({t for t in tokens if t <= max_seq_len})
        return mode, [(prefill_slots(t, config.max_running_req), t) for t in tokens]

    def _pad_prefill(self, batch: Batch) -> None:
        """Pad a prefill to the smallest token bucket that holds it: one request in the
        dummy row takes the missing tokens, zero-length sentinels fill the other slots.
        More tokens than the largest bucket or more requests than its slots: eager."""
        if any(r.wants_prompt_logprobs for r in batch.reqs):  # [ch25]
            return  # [ch25]
        tokens = sum(r.extend_len for r in batch.reqs)
        shape = next((s for s in self.prefill_shapes if s[1] >= tokens), None)
        if shape is None:
            return
        slots, bucket = shape
        filler = [self._filler(bucket - tokens)] if bucket > tokens else []
        if batch.size + len(filler) > slots:
            return
        batch.padded_reqs = batch.reqs + filler
        batch.padded_reqs += [self.sentinel] * (slots - len(batch.padded_reqs))

    def _prefill_key(self, batch: Batch) -> tuple[int, int]:
        return batch.padded_size, sum(r.extend_len for r in batch.padded_reqs)

    def _filler(self, num_tokens: int) -> Req:
        """A request of `num_tokens` new tokens in the dummy row: its K/V goes to the dummy page."""
        row, params = self.dummy_req.table_idx, self.dummy_req.sampling_params
        req = Req(torch.zeros(1, dtype=torch.int32), row, 0, 1, -1, params)
        req.device_len = num_tokens
        return req

    # <<< ch23
    def destroy_cuda_graphs(self) -> None:
        # Graphs go before anything they captured (NCCL communicators above all) is freed.
        self.graph_map.clear()
        self.prefill_graph_map.clear()  # [ch23]
        gc.collect()
        if _is_cuda(self.device):
            torch.cuda.empty_cache()


def _is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def _synchronize(device: torch.device) -> None:
    if _is_cuda(device):
        torch.cuda.synchronize(device)


def _free_memory(device: torch.device) -> int:
    return torch.cuda.mem_get_info(device)[0] if _is_cuda(device) else 0


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
