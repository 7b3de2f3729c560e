"""Our own Triton kernels (minisgl/kernels/) on the layers: what the kernel plan installs.

On a GPU in bf16/fp16 two kernels replace a chain of layer code. `qk_rope_store` takes
qkv to rotated q, with the keys rotated and the values stored in the KV cache on the way.
`gemv` does a projection of a few tokens at the memory's full speed, with the SiLU-and-mul
after it (a gated MLP) and the residual add and RMSNorm before it folded in where asked.
The kernel plan (layers/kernel_plan.py) decides once, at start-up, which layers run them,
and installs the functions below on those layers; a layer keeps its own code elsewhere
(the CPU, fp32, no triton) and, for the GEMV, above MINISGL_GEMV_MAX_ROWS tokens.

No GEMV runs blind: at start-up the engine times it against the matmul library for every
projection shape of the model (`engine/kernel_choice.py`) into a `GemvTable`; each
projection gets its row of it installed (the blocks to run at 1, 2, ... rows, or None for
the library), and so does the norm before it. MINISGL_GEMV=on|off overrides the table,
for benchmarks.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MethodType
from typing import TYPE_CHECKING

import torch

from minisgl.core import get_global_ctx
from minisgl.env import ENV
from minisgl.kvcache.window_pages import store_slots  # [ch29]

if TYPE_CHECKING:
    from minisgl.layers.attention import AttentionLayer
    from minisgl.layers.linear import Linear
    from minisgl.layers.norm import RMSNorm


@functools.cache
def _triton_kernel(module: str, name: str) -> Callable | None:
    # Imported when first asked for: triton may be missing, and it is slow to import.
    try:
        return getattr(importlib.import_module(f"minisgl.kernels.{module}"), name)
    except ImportError:  # no triton
        return None


def rope_store_kernel(fused: bool) -> Callable | None:
    """`kernels.rope_store.qk_rope_store` (q/k head norms, rotary and the KV store in one)
    where fused kernels run (the plan's `fused`: bf16/fp16 on CUDA), else None."""
    return _triton_kernel("rope_store", "qk_rope_store") if fused else None


def gemv_kernel(fused: bool) -> Callable | None:
    """`kernels.gemv.gemv` where fused kernels run, else None. Which projections run it,
    at how many rows, is the plan's `GemvPlan`."""
    return _triton_kernel("gemv", "gemv") if fused else None


def triton_argmax(logits: torch.Tensor) -> Callable | None:
    """`kernels.argmax.argmax_rows` for fp32 logits on CUDA, else None."""
    if not (logits.is_cuda and logits.dim() == 2 and logits.stride(-1) == 1):
        return None
    return _triton_kernel("argmax", "argmax_rows") if ENV.FUSED_KERNELS.value else None


# >>> ch26
def triton_accept(logits: torch.Tensor) -> Callable | None:
    """`kernels.accept.accept_greedy` (a verify's greedy walk and its write) on CUDA, else
    None."""
    if triton_argmax(logits) is None:
        return None
    return _triton_kernel("accept", "accept_greedy")


# <<< ch26


def triton_sample(logits: torch.Tensor) -> Callable | None:
    """`kernels.sample.sample_rows` (greedy and drawn rows in one read) for fp32 logits on
    CUDA, else None."""
    if triton_argmax(logits) is None or logits.dtype != torch.float32:
        return None
    return _triton_kernel("sample", "sample_rows")


# ---- attention from qkv: rotary and the KV store in one kernel, or the whole decode ------


def attention_from_qkv(rope_store: Callable, decode: Callable | None) -> Callable:
    """`AttentionLayer.forward` through `rope_store` (q normed and rotated, k normed, rotated
    and stored, v stored, in one kernel), or for a decode batch through the backend's
    `decode`, which also attends in the same kernel (`kernels/fused_decode.py`)."""

    def forward(self: AttentionLayer, qkv: torch.Tensor) -> torch.Tensor:
        ctx = get_global_ctx()
        phases = ("decode",)
        phases = ("decode", "verify")  # a verify's few tokens a request as well  # [ch26]
        if decode is not None and ctx.batch.phase in phases:  # None: not a layer it takes
            out = decode(self, qkv, ctx.batch)
            if out is not None:
                return out.reshape(-1, self.num_heads * self.head_dim)
        kv = ctx.attn_backend.kv_cache
        norms = hasattr(self, "q_norm")
        out_loc = ctx.batch.out_loc
        out_loc = store_slots(kv, out_loc, self.layer_id)  # a sliding layer's own  # [ch29]
        q = rope_store(
            qkv,
            ctx.batch.positions,
            self.rotary.cos_sin,
            self.q_norm.weight if norms else None,
            self.k_norm.weight if norms else None,
            self.q_norm.eps if norms else 0.0,
            kv.k_cache(self.layer_id),
            kv.v_cache(self.layer_id),
            out_loc,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            *kv.scales(self.layer_id),  # [ch28]
        )
        return self.attend(q, None, None).reshape(-1, self.num_heads * self.head_dim)

    return forward


# ---- the GEMV: which projections, at how many rows, in which blocks ------------------------


@dataclass(frozen=True)
class GemvKey:
    """A projection as the GEMV sees it: what its speed depends on besides the rows."""

    n: int  # output features (of each half, when gated)
    k: int  # input features
    gated: bool  # a merged [gate; up] weight, SiLU-and-mul after it
    normed: bool  # the residual add and RMSNorm before it, in the same kernel
    bias: bool

    @classmethod
    def of(cls, layer: Linear, gated: bool, normed: bool = False) -> GemvKey:
        n, k = layer.weight.shape
        return cls(n // (1 + gated), k, gated, normed, layer.bias is not None)


Blocks = tuple[int, int, int, int]  # kernels.gemv's BLOCK_M, BLOCK_N, BLOCK_K, num_warps
GEMV_ROWS = (1, 2, 4, 8)  # row counts the choice is measured at; m rows use the next one up
GEMV_ROWS = (1, 2, 4, 8, 16)  # [ch26]


@dataclass
class GemvTable:
    """One model's measured choice: for a projection and a row count, the GEMV blocks that
    beat the matmul library, or None where the library won. Not measured: the library."""

    blocks: dict[tuple[GemvKey, int], Blocks | None] = field(default_factory=dict)
    report: str = ""  # the timings behind it, one line per shape and row count

    def lookup(self, key: GemvKey, rows: int) -> Blocks | None:
        bucket = next((r for r in GEMV_ROWS if r >= rows), None)
        return self.blocks.get((key, bucket)) if bucket is not None else None


@dataclass
class ProjectionCall:
    """A projection as the model calls it, recorded by one forward at start-up."""

    key: GemvKey
    weight: torch.Tensor
    bias: torch.Tensor | None
    norm_weight: torch.Tensor | None  # the RMSNorm folded in front of it, when normed
    norm_eps: float


@dataclass
class GemvPlan:
    """The GEMV's part of the kernel plan: the knobs, read once, and what was measured."""

    kernel: Callable  # kernels.gemv.gemv
    mode: str  # MINISGL_GEMV: auto (the table decides) or on (the default blocks)
    max_rows: int  # MINISGL_GEMV_MAX_ROWS: more rows than this always go to the library
    table: GemvTable | None = None  # measured at start-up; None: not yet, the library
    feeds: dict[int, GemvKey] = field(default_factory=dict)  # id(norm weight) -> its projection
    recording: list[ProjectionCall] | None = None  # the start-up forward: record, run the library

    def blocks(self, key: GemvKey) -> tuple[Blocks | None, ...]:
        """The blocks to run a projection of `key` in at 0, 1, ... max_rows rows (None: the
        library), indexed by the rows."""
        if self.mode == "on":  # forced on, as before measurement: the default blocks
            from minisgl.kernels.gemv import gemv_blocks

            return (None,) + tuple(
                gemv_blocks(m, key.n, key.k, key.gated) for m in range(1, self.max_rows + 1)
            )
        if self.table is None:
            return (None,) * (self.max_rows + 1)
        return (None,) + tuple(self.table.lookup(key, m) for m in range(1, self.max_rows + 1))

    def defers(self, norm: RMSNorm) -> tuple[bool, ...]:
        """At 0, 1, ... max_rows rows, whether `norm` leaves itself to the projection after
        it: where that projection runs the GEMV (while recording, forced on, or the table
        says so), or where the table never saw the norm."""
        feeds = self.feeds.get(id(norm.weight))
        if self.recording is not None or self.mode == "on" or feeds is None or not self.table:
            return (False,) + (True,) * self.max_rows
        return (False,) + tuple(
            self.table.lookup(feeds, m) is not None for m in range(1, self.max_rows + 1)
        )

    def install(self, layer: Linear, gated: bool) -> None:
        """The GEMV's `matmul` on `layer` (the library where it does not take the rows), or
        while recording, one that records the call and runs the library."""
        library = type(layer).matmul
        if self.recording is not None:
            layer.matmul = MethodType(
                recording(self.recording, gemv_takes(self), gated, library), layer
            )
            return
        layer.gemv_blocks = self.blocks(GemvKey.of(layer, gated))
        layer.gemv_blocks_normed = self.blocks(GemvKey.of(layer, gated, normed=True))
        layer.matmul = MethodType(gemv_matmul(self, gated, library), layer)


def gemv_takes(plan: GemvPlan) -> Callable[[Linear, torch.Tensor], bool]:
    """Whether the GEMV can take these rows of x: few, of a matrix, read contiguously."""
    max_rows = plan.max_rows
    return lambda layer, x: x.dim() == 2 and x.size(0) <= max_rows and x.stride(1) == 1


@dataclass
class NormedInput:
    """RMSNorm(x + residual), not computed yet: the projection it feeds does the add and the
    norm in its own GEMV kernel (`deferring` hands this out where that projection will use
    the kernel), which saves a kernel and a pass over memory per norm. `residual_out`
    receives x + residual, the residual stream after the add."""

    x: torch.Tensor
    residual: torch.Tensor
    residual_out: torch.Tensor
    weight: torch.Tensor
    eps: float

    def compute(self) -> torch.Tensor:
        """The norm apart from the projection, as RMSNorm.reference computes it."""
        s = torch.add(self.x, self.residual, out=self.residual_out).float()
        return self.weight * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + self.eps)).to(
            self.x.dtype
        )


def deferring(plan: GemvPlan, forward_add: Callable) -> Callable:
    """`RMSNorm.forward_add` that, at the row counts where the norm's `gemv_defers` says so,
    returns (NormedInput, the tensor that will hold x + residual) for the projection after
    it to compute; else runs `forward_add`."""
    max_rows = plan.max_rows

    def deferred(self: RMSNorm, x: torch.Tensor, residual: torch.Tensor):
        rows = x.size(0)
        if x.dim() == 2 and rows <= max_rows and x.stride(1) == 1 and self.gemv_defers[rows]:
            out = torch.empty_like(residual)
            return NormedInput(x, residual, out, self.weight, self.eps), out
        return forward_add(self, x, residual)

    return deferred


def gemv_matmul(plan: GemvPlan, gated: bool, library: Callable) -> Callable:
    """`Linear.matmul` in the GEMV kernel, in the blocks installed on the layer for its row
    count, where it has some; else `library`. gated: the weight is a merged [gate; up] and
    the result silu(gate) * up. A NormedInput is normed in the same kernel (or, where the
    library runs after all, apart from it)."""
    kernel, max_rows = plan.kernel, plan.max_rows

    def matmul(self: Linear, x: torch.Tensor | NormedInput) -> torch.Tensor:
        if type(x) is NormedInput:
            blocks = self.gemv_blocks_normed[x.x.size(0)]
            if blocks is None:
                return library(self, x.compute())
            norm = (x.residual, x.residual_out, x.weight, x.eps)
            return kernel(x.x, self.weight, self.bias, blocks=blocks, gated=gated, norm=norm)
        rows = x.size(0)
        if x.dim() == 2 and rows <= max_rows and x.stride(1) == 1 and self.gemv_blocks[rows]:
            blocks = self.gemv_blocks[rows]
            return kernel(x, self.weight, self.bias, blocks=blocks, gated=gated)
        return library(self, x)

    return matmul


def recording(
    calls: list[ProjectionCall], takes: Callable, gated: bool, library: Callable
) -> Callable:
    """A `matmul` for the start-up forward: every call the GEMV could take is recorded
    (its key, weight, and the norm folded in front of it), and the library runs it."""

    def matmul(self: Linear, x: torch.Tensor | NormedInput) -> torch.Tensor:
        normed = type(x) is NormedInput
        rows = x.x if normed else x
        if takes(self, rows):
            norm = (x.weight, x.eps) if normed else (None, 0.0)
            key = GemvKey.of(self, gated, normed)
            calls.append(ProjectionCall(key, self.weight, self.bias, *norm))
        return library(self, x.compute() if normed else x)

    return matmul
