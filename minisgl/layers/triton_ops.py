"""Where the layers hand their work to our own Triton kernels (minisgl/kernels/), and when.

On a GPU in bf16/fp16 two kernels replace a chain of layer code. `qk_rope_store` takes
qkv to rotated q, with the keys rotated and the values stored in the KV cache on the way.
`gemv` does a projection of a few tokens at the memory's full speed, with the SiLU-and-mul
after it (a gated MLP) and the residual add and RMSNorm before it folded in where asked.
Each function returns None where its kernel does not apply (the CPU, fp32, more tokens
than MINISGL_GEMV_MAX_ROWS, no triton), and the layer runs its own code instead.

No GEMV runs blind: at start-up the engine times it against the matmul library for every
projection shape of the model (`engine/kernel_choice.py`) and hangs the result, a
`GemvTable`, on the weights; a projection uses the GEMV only where the table says it won.
MINISGL_GEMV=on|off overrides the table, for benchmarks.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from minisgl.core import get_global_ctx
from minisgl.env import ENV
from minisgl.layers.activation import silu_and_mul

if TYPE_CHECKING:
    from minisgl.layers.attention import AttentionLayer


@functools.cache
def _triton_kernel(module: str, name: str) -> Callable | None:
    # Imported when first asked for: triton may be missing, and it is slow to import.
    try:
        return getattr(importlib.import_module(f"minisgl.kernels.{module}"), name)
    except ImportError:  # no triton
        return None


def _on_gpu_in_half(x: torch.Tensor) -> bool:
    """bf16/fp16 on CUDA, with the fused kernels allowed: where our kernels take over."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and ENV.FUSED_KERNELS.value


def rope_store_kernel(x: torch.Tensor) -> Callable | None:
    """`kernels.rope_store.qk_rope_store` (q/k head norms, rotary and the KV store in one)
    when it can take `x` (bf16/fp16 on CUDA), else None."""
    return _triton_kernel("rope_store", "qk_rope_store") if _on_gpu_in_half(x) else None


def gemv_kernel(x: torch.Tensor) -> Callable | None:
    """`kernels.gemv.gemv` when it can take `x`, a few rows (at most MINISGL_GEMV_MAX_ROWS) of
    bf16/fp16 activations on CUDA: a decode step of a small batch. Else None. Whether it
    should, for a given weight, is the `GemvTable`'s answer."""
    if not (_on_gpu_in_half(x) and x.dim() == 2 and x.size(0) <= ENV.GEMV_MAX_ROWS.value):
        return None
    if x.stride(1) != 1 or ENV.GEMV.value == "off":  # the kernel reads rows of x contiguously
        return None
    return _triton_kernel("gemv", "gemv")


def rope_store(layer: AttentionLayer, qkv: torch.Tensor) -> torch.Tensor | None:
    """The layer's q, normed and rotated, from its qkv in one kernel that also norms and
    rotates k and stores k and v in the KV cache; None where the kernel does not take qkv."""
    kernel = rope_store_kernel(qkv)
    if kernel is None:
        return None
    ctx = get_global_ctx()
    kv = ctx.attn_backend.kv_cache
    norms = hasattr(layer, "q_norm")
    return kernel(
        qkv,
        ctx.batch.positions,
        layer.rotary.cos_sin,
        layer.q_norm.weight if norms else None,
        layer.k_norm.weight if norms else None,
        layer.q_norm.eps if norms else 0.0,
        kv.k_cache(layer.layer_id),
        kv.v_cache(layer.layer_id),
        ctx.batch.out_loc,
        layer.num_heads,
        layer.num_kv_heads,
        layer.head_dim,
        *kv.scales(layer.layer_id),  # [ch28]
    )


def triton_argmax(logits: torch.Tensor) -> Callable | None:
    """`kernels.argmax.argmax_rows` for fp32 logits on CUDA, else None."""
    if not (logits.is_cuda and logits.dim() == 2 and logits.stride(-1) == 1):
        return None
    return _triton_kernel("argmax", "argmax_rows") if ENV.FUSED_KERNELS.value else None


def triton_sample(logits: torch.Tensor) -> Callable | None:
    """`kernels.sample.sample_rows` (greedy and drawn rows in one read) for fp32 logits on
    CUDA, else None."""
    if triton_argmax(logits) is None or logits.dtype != torch.float32:
        return None
    return _triton_kernel("sample", "sample_rows")


def decode_from_qkv(layer: AttentionLayer, qkv: torch.Tensor) -> torch.Tensor | None:
    """A decode batch's attention output [tokens, heads, head_dim] straight from qkv, in one
    kernel that also does what `rope_store` does (`kernels/fused_decode.py`), where the
    backend has that kernel (ours); else None."""
    if rope_store_kernel(qkv) is None or not ENV.FUSED_DECODE.value:
        return None
    ctx = get_global_ctx()
    attend = getattr(ctx.attn_backend, "decode_from_qkv", None)
    return attend(layer, qkv, ctx.batch) if attend is not None and ctx.batch.is_decode else None


@dataclass(frozen=True)
class GemvKey:
    """A projection as the GEMV sees it: what its speed depends on besides the rows."""

    n: int  # output features (of each half, when gated)
    k: int  # input features
    gated: bool  # a merged [gate; up] weight, SiLU-and-mul after it
    normed: bool  # the residual add and RMSNorm before it, in the same kernel
    bias: bool


Blocks = tuple[int, int, int, int]  # kernels.gemv's BLOCK_M, BLOCK_N, BLOCK_K, num_warps
GEMV_ROWS = (1, 2, 4, 8)  # row counts the choice is measured at; m rows use the next one up


@dataclass
class GemvTable:
    """One model's measured choice: for a projection and a row count, the GEMV blocks that
    beat the matmul library, or None where the library won. Not measured: the library."""

    blocks: dict[tuple[GemvKey, int], Blocks | None] = field(default_factory=dict)
    report: str = ""  # the timings behind it, one line per shape and row count

    def lookup(self, key: GemvKey, rows: int) -> Blocks | None:
        bucket = next((r for r in GEMV_ROWS if r >= rows), None)
        return self.blocks.get((key, bucket)) if bucket is not None else None


def gemv_blocks_for(table_on: torch.Tensor, key: GemvKey, rows: int) -> Blocks | None:
    """The blocks to run this projection in, or None: the matmul library. `table_on` is the
    tensor the engine hung the table on (the projection's weight, or the norm's before it)."""
    if ENV.GEMV.value == "on":  # forced on, as before measurement: the default blocks
        from minisgl.kernels.gemv import gemv_blocks

        return gemv_blocks(rows, key.n, key.k, key.gated)
    table: GemvTable | None = getattr(table_on, "gemv_table", None)
    return table.lookup(key, rows) if table is not None else None


@dataclass
class NormedInput:
    """RMSNorm(x + residual), not computed yet: the projection it feeds does the add and the
    norm in its own GEMV kernel (`RMSNorm.forward_add` hands this out where that projection
    will use the kernel), which saves a kernel and a pass over memory per norm. `residual_out`
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


def defer_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[NormedInput, torch.Tensor] | None:
    """(RMSNorm(x + residual) left to the projection after it, the tensor that will hold
    x + residual) where the GEMV kernel could take x; else None. Not where the start-up
    measurement chose the library for that projection: the norm's weight carries the
    projection's key (`engine/kernel_choice.py`); one it never saw gets the norm deferred."""
    if gemv_kernel(x) is None:
        return None
    if _recording is None and ENV.GEMV.value != "on":
        feeds: GemvKey | None = getattr(weight, "gemv_feeds", None)
        if feeds is not None and gemv_blocks_for(weight, feeds, x.size(0)) is None:
            return None
    out = torch.empty_like(residual)
    return NormedInput(x, residual, out, weight, eps), out


def gemv_projection(
    x: torch.Tensor | NormedInput,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gated: bool = False,
) -> torch.Tensor | None:
    """x @ weight.T (+ bias) in the GEMV kernel where the table chose it, else None. gated:
    weight is a merged [gate; up] and the result silu(gate) * up. A NormedInput is normed in
    the same kernel (or, where the kernel is not used after all, apart from it)."""
    normed = isinstance(x, NormedInput)
    rows = x.x if isinstance(x, NormedInput) else x
    kernel = gemv_kernel(rows) if weight.dtype == rows.dtype else None  # not quantised weights
    if kernel is None and not normed:
        return None
    key = GemvKey(weight.size(0) // (1 + gated), weight.size(1), gated, normed, bias is not None)
    blocks = None
    if kernel is not None and not record_projection(key, weight, bias, x):
        blocks = gemv_blocks_for(weight, key, rows.size(0))
    if blocks is None:  # the matmul library
        if not normed:
            return None if _recording is None else _library(x, weight, bias, gated)
        return _library(x.compute(), weight, bias, gated)
    pdl = _triton_kernel("pdl", "pdl_enabled")(rows)
    if normed:
        norm = (x.residual, x.residual_out, x.weight, x.eps)
        return kernel(x.x, weight, bias, blocks=blocks, gated=gated, norm=norm, pdl=pdl)
    return kernel(x, weight, bias, blocks=blocks, gated=gated, pdl=pdl)


def _library(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool):
    y = F.linear(x, weight, bias)
    return silu_and_mul(y) if gated else y


# ---- what the model projects: recorded by one forward at start-up ---------------------------


@dataclass
class ProjectionCall:
    key: GemvKey
    weight: torch.Tensor
    bias: torch.Tensor | None
    norm_weight: torch.Tensor | None  # the RMSNorm folded in front of it, when normed
    norm_eps: float


_recording: list[ProjectionCall] | None = None


def record_projection(
    key: GemvKey, weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor | NormedInput
) -> bool:
    """Whether projections are being recorded (`recording_projections`); if so, this one is."""
    if _recording is None:
        return False
    norm = (x.weight, x.eps) if isinstance(x, NormedInput) else (None, 0.0)
    _recording.append(ProjectionCall(key, weight, bias, *norm))
    return True


@contextmanager
def recording_projections() -> Iterator[list[ProjectionCall]]:
    """Every projection the GEMV could take, as the model calls it, with every norm before
    one deferred: the forward inside runs each through the matmul library and records it."""
    global _recording
    _recording = calls = []
    try:
        yield calls
    finally:
        _recording = None
