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

import torch

from minisgl.attention.base import BaseAttnBackend
from minisgl.core import Batch, Req, get_global_ctx
from minisgl.models.base import BaseLLMModel

logger = logging.getLogger(__name__)


@dataclass
class GraphCaptureBuffer:
    input_ids: torch.Tensor
    out_loc: torch.Tensor
    positions: torch.Tensor
    logits: torch.Tensor

    @classmethod
    def init(cls, bs: int, vocab_size: int, device: torch.device) -> GraphCaptureBuffer:
        return GraphCaptureBuffer(
            input_ids=torch.zeros(bs, dtype=torch.int32, device=device),
            out_loc=torch.zeros(bs, dtype=torch.int32, device=device),
            positions=torch.zeros(bs, dtype=torch.int32, device=device),
            logits=torch.empty(bs, vocab_size, dtype=torch.float32, device=device),
        )

    def set_batch(self, batch: Batch) -> None:
        """At capture: the batch's inputs become views of the buffers."""
        s = slice(batch.padded_size)
        batch.input_ids, batch.out_loc, batch.positions = (
            self.input_ids[s],
            self.out_loc[s],
            self.positions[s],
        )

    def copy_from(self, batch: Batch) -> None:
        """Before replay: this step's inputs go into the buffers."""
        s = slice(batch.padded_size)
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
    ) -> None:
        self.attn_backend, self.dummy_req, self.device = attn_backend, dummy_req, device
        self.graph_bs_list = sorted(bs_list)
        self.max_graph_bs = max(bs_list, default=0)
        self.graph_map: dict[int, torch.cuda.CUDAGraph | EmulatedGraph] = {}
        self.stream = torch.cuda.Stream(device) if _is_cuda(device) and not debug else None
        if self.graph_bs_list:
            self._capture_graphs(max_seq_len, vocab_size, model)

    def _capture_graphs(self, max_seq_len: int, vocab_size: int, model: BaseLLMModel) -> None:
        start = time.perf_counter()
        self.attn_backend.init_capture_graph(max_seq_len=max_seq_len, bs_list=self.graph_bs_list)
        _synchronize(self.device)
        free_before = _free_memory(self.device)
        self.buffer = GraphCaptureBuffer.init(self.max_graph_bs, vocab_size, self.device)
        pool = None
        with _gc_frozen(self.stream is not None):
            for bs in sorted(self.graph_bs_list, reverse=True):  # largest first: its pool is reused
                batch = Batch(reqs=[self.dummy_req] * bs, phase="decode")
                batch.padded_reqs = batch.reqs
                self.attn_backend.prepare_for_capture(batch)
                self.buffer.set_batch(batch)
                logits = self.buffer.logits[:bs]
                ctx = get_global_ctx()
                with ctx.forward_batch(batch):
                    logits.copy_(model.forward())  # warm-up: lazy initialisation stays out
                    if self.stream is not None:
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=pool, stream=self.stream):
                            logits.copy_(model.forward())
                        pool = graph.pool() if pool is None else pool
                    else:
                        graph = EmulatedGraph(
                            lambda m=model, lg=logits: lg.copy_(m.forward()), batch
                        )
                self.graph_map[bs] = graph
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

    def can_use_cuda_graph(self, batch: Batch) -> bool:
        return batch.is_decode and 0 < batch.size <= self.max_graph_bs

    def pad_batch(self, batch: Batch) -> None:
        """Round a decode batch up to the nearest captured size with dummy requests."""
        padded = (
            next(bs for bs in self.graph_bs_list if bs >= batch.size)
            if self.can_use_cuda_graph(batch)
            else batch.size
        )
        batch.padded_reqs = batch.reqs + [self.dummy_req] * (padded - batch.size)

    def replay(self, batch: Batch) -> torch.Tensor:
        assert self.can_use_cuda_graph(batch)
        self.buffer.copy_from(batch)
        self.attn_backend.prepare_for_replay(batch)
        self.graph_map[batch.padded_size].replay()
        return self.buffer.logits[: batch.size]

    def destroy_cuda_graphs(self) -> None:
        # Graphs go before anything they captured (NCCL communicators above all) is freed.
        self.graph_map.clear()
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
