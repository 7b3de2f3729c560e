"""FP8 projections in the start-up measurement and the kernel plan: the candidates timed
against the matmul (engine/kernel_choice.py measures them with chapter 20's), and the
choices installed on each FP8 layer, by whether a norm is folded in and by the rows."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import MethodType
from typing import TYPE_CHECKING

import torch
from torch import nn

from minisgl.layers.activation import silu_and_mul
from minisgl.layers.triton_ops import (
    GEMV_ROWS,
    Blocks,
    GemvKey,
    GemvPlan,
    GemvTable,
    NormedInput,
    ProjectionCall,
    recording,
)
from minisgl.quant.fp8 import (
    GEMV_MAX_ROWS,
    Choice,
    _kernels,
    fp8_projection,
    library,
    matmul,
    mma_projection,
)

if TYPE_CHECKING:
    from minisgl.layers.kernel_plan import KernelPlan


def gemv_choices(table: GemvTable, key: GemvKey) -> tuple[Choice, ...]:
    """What the start-up measurement (engine/kernel_choice.py) chose for a projection of
    `key` at 0, 1, ... GEMV_MAX_ROWS rows: GEMV blocks, or "matmul"; None (the GEMV's first
    guess) at a row count it did not try."""

    def chosen(m: int) -> Choice:
        bucket = next((r for r in GEMV_ROWS if r >= m), None)
        found = table.blocks.get((key, bucket), "unmeasured")
        return None if found == "unmeasured" else found or "matmul"

    return tuple(chosen(m) for m in range(GEMV_MAX_ROWS + 1))


def install(layer: nn.Module, gated: bool, gemv: GemvPlan | None) -> None:
    """The kernel plan's FP8 `matmul` on `layer`, with the measured choices installed where
    there is a table; while the start-up forward records, one that records and runs the
    matmul."""
    if layer.gemv_choice is not None and gemv is not None:
        if gemv.recording is not None:
            run = recording(gemv.recording, _gemv_takes, gated, lambda m, x: library(x, m, gated))
            layer.matmul = MethodType(run, layer)
            return
        if gemv.table is not None:
            layer.gemv_choice = tuple(
                gemv_choices(gemv.table, GemvKey.of(layer, gated, normed))
                for normed in (False, True)
            )
    layer.matmul = functools.partial(fp8_projection, layer=layer, gated=gated)


def gemv_rows() -> list[int]:
    """The row counts at which the start-up measurement times the FP8 GEMV."""
    return [r for r in GEMV_ROWS if r <= GEMV_MAX_ROWS]


def choice_candidates(
    call: ProjectionCall, layers: list[nn.Module], m: int, dtype: torch.dtype, kernels: KernelPlan
) -> dict[str, tuple[Blocks | None, Callable[[], object]]]:
    """For the start-up measurement: label -> (GEMV blocks or None for the matmul, a run of
    it over `layers`, FP8 layers of the call's shape), as chapter 20's `candidates`; the
    matmul's path runs the norm in the kernel `kernels` gives it."""
    from minisgl.layers.norm import RMSNorm

    key, first = call.key, layers[0]
    x = torch.randn(m, key.k, dtype=dtype, device=first.weight.device)
    residual, out = torch.randn_like(x), torch.empty_like(x)
    norm = fold = None
    if key.normed:
        norm = RMSNorm(key.k, call.norm_eps)
        norm.weight = nn.Parameter(call.norm_weight, requires_grad=False)
        kernels.install(norm)
        fold = (residual, out, call.norm_weight, call.norm_eps)

    def library() -> None:  # the norm's own kernel, x quantised, _scaled_mm, SiLU-and-mul
        for layer in layers:
            h = norm.forward_add(x, residual)[0] if norm is not None else x
            y = matmul(h, layer.weight, layer.weight_scale, layer.fp8_block, layer.bias)
            if key.gated:
                silu_and_mul(y)

    def gemv(blocks: Blocks) -> Callable[[], None]:
        def run() -> None:
            for layer in layers:
                w, s, block = layer.weight, layer.weight_scale, layer.fp8_block
                _kernels().fp8_gemv(x, w, s, block, layer.bias, key.gated, fold, blocks)

        return run

    def mma(blocks: Blocks) -> Callable[[], None]:
        def run() -> None:
            for layer in layers:
                h = NormedInput(x, residual, out, call.norm_weight, call.norm_eps) if norm else x
                mma_projection(h, layer, key.gated, blocks)

        return run

    block, kernels = first.fp8_block, _kernels()
    row_scales = block[0] == 1 and block[1] >= key.k
    runs: dict[str, tuple[Blocks | None, Callable[[], object]]] = {"library": (None, library)}
    for blocks in kernels.fp8_gemv_candidates(
        m, key.n, key.k, 1 if row_scales else block[0], key.gated
    ):
        label = "fp8 gemv " + "x".join(map(str, blocks[:3])) + f"w{blocks[3]}"
        runs[label] = (blocks, gemv(blocks))
    if row_scales and m <= kernels.MMA_MAX_ROWS:  # the tensor cores: x quantised too
        for blocks in kernels.fp8_mma_candidates(key.n, key.k):
            label = "fp8 gemv mma " + "x".join(map(str, blocks[:2])) + "w{}s{}".format(*blocks[2:])
            runs[label] = (blocks, mma(blocks))
    return runs


def _gemv_takes(layer: nn.Module, x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.size(0) <= GEMV_MAX_ROWS and x.stride(1) == 1
