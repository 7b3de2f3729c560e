"""Breakable CUDA graphs: one forward captured as graph segments joined by eager calls.

Some steps of a forward cannot live in a CUDA graph, or are better left out: prefill
attention reads each request's length on the host to plan its work. Marking such a
function with `@eager_on_graph` (core.py) makes the capture stop right before it, run it eagerly,
and resume in a new graph segment after it. A replay then runs segment 0, the first eager
call, segment 1, ... in the same order.

The segments read and write fixed addresses, so whatever crosses a break must too. The
tensor arguments of a marked function are copied, inside the segment before it, into
persistent *boundary* buffers, and the eager call reads those; its result is copied into
another boundary buffer, which the next segment was captured reading. Boundary buffers
are shared by every break of every captured shape (each is sized by the largest): a
marked function's result must therefore be used up before the next break, as an
attention output is by the projection after it.

On CPU there are no graphs. `BreakableGraph` then replays like `EmulatedGraph`: the
forward runs against the batch it was captured with, except inside marked functions,
which see the live batch. Every tensor still goes through the boundary buffers, so a
forgotten copy gives wrong tokens here as it would on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from minisgl.core import Batch, get_global_ctx


class BoundaryBuffers:
    """Persistent tensors that carry values across breaks: one per argument position and
    one for results, each a flat buffer that every break and shape takes a view of."""

    def __init__(self) -> None:
        self.flat: dict[str, torch.Tensor] = {}

    def view(self, name: str, like: torch.Tensor) -> torch.Tensor:
        buf = self.flat.get(name)
        if buf is None:
            # The first capture is the largest shape; its breaks size every buffer.
            buf = self.flat[name] = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
        if buf.dtype != like.dtype or buf.numel() < like.numel():
            raise RuntimeError(
                f"boundary buffer {name!r} holds {buf.numel()} {buf.dtype}, a break needs "
                f"{like.numel()} {like.dtype}: capture the largest shape first"
            )
        return buf[: like.numel()].view(like.shape)

    def stage(self, name: str, value: torch.Tensor) -> torch.Tensor:
        buf = self.view(name, value)
        buf.copy_(value)
        return buf

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.flat.values())


@dataclass
class _Break:
    fn: Callable[..., torch.Tensor]
    args: tuple[Any, ...]  # tensors among them are boundary buffers
    kwargs: dict[str, Any]
    out: torch.Tensor  # the boundary buffer its result is copied into


class BreakableGraph:
    """A captured shape: CUDA-graph segments (none on CPU) and the eager calls between them."""

    def __init__(self, boundary: BoundaryBuffers, batch: Batch, cuda: bool) -> None:
        self.boundary, self.batch, self.cuda = boundary, batch, cuda
        self.segments: list[torch.cuda.CUDAGraph] = []
        self.breaks: list[_Break] = []
        self._pool: Any = None
        self._forward: Callable[[], None] = lambda: None
        self._live: Batch | None = None
        self._replaying = False  # CPU: inside replay(), breaks call the live batch

    def capture(self, forward: Callable[[], None], pool: Any, stream: Any) -> Any:
        """Run `forward` once, capturing it in segments on `stream`; returns the memory pool
        every segment shares (pass it to the next capture)."""
        ctx = get_global_ctx()
        self._pool, self._forward = pool, forward
        ctx.breakable = self
        try:
            if self.cuda:
                torch.cuda.synchronize()  # as torch.cuda.graph: inputs ready before the side stream
                with torch.cuda.stream(stream):
                    self._begin()
                    forward()
                    self._end()
                # The eager calls ran for real on the side stream: let them finish before
                # anything (the next shape's attention plan) reuses what they read.
                torch.cuda.synchronize()
            else:
                forward()  # sizes the boundary buffers, as a capture would
        finally:
            ctx.breakable = None
        return self._pool

    def break_at(self, fn: Callable[..., torch.Tensor], args: tuple, kwargs: dict) -> torch.Tensor:
        # Tensor arguments move into boundary buffers inside the segment that made them.
        # Every layer's attention of one geometry (a token's shape) shares the same buffers.
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        name = fn.__qualname__ + (str(tuple(first.shape[1:])) if first is not None else "")
        staged = tuple(
            self.boundary.stage(f"{name}:{i}", a) if isinstance(a, torch.Tensor) else a
            for i, a in enumerate(args)
        )
        if self._replaying:  # CPU replay: the eager call sees the live batch, as on a GPU
            return self.boundary.stage(f"{name}:out", self._call_live(fn, staged, kwargs))
        if self.cuda:
            self._end()
        out = self.boundary.stage(f"{name}:out", fn(*staged, **kwargs))
        self.breaks.append(_Break(fn, staged, kwargs, out))
        if self.cuda:
            self._begin()
        return out

    def replay(self) -> None:
        if not self.cuda:
            self._emulated_replay()
            return
        for i, segment in enumerate(self.segments):
            segment.replay()
            if i < len(self.breaks):
                brk = self.breaks[i]
                brk.out.copy_(brk.fn(*brk.args, **brk.kwargs))

    def _emulated_replay(self) -> None:
        ctx = get_global_ctx()
        saved, ctx._batch = ctx._batch, self.batch
        self._live, self._replaying, ctx.breakable = saved, True, self
        try:
            self._forward()
        finally:
            ctx._batch, self._replaying, ctx.breakable = saved, False, None

    def _call_live(self, fn: Callable[..., torch.Tensor], args: tuple, kwargs: dict) -> Any:
        ctx = get_global_ctx()
        captured, ctx._batch = ctx._batch, self._live
        try:
            return fn(*args, **kwargs)
        finally:
            ctx._batch = captured

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._pool)
        self.segments.append(graph)

    def _end(self) -> None:
        graph = self.segments[-1]
        graph.capture_end()
        self._pool = graph.pool() if self._pool is None else self._pool
