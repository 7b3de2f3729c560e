"""Where the experts run in chapter 22's fused Triton kernel instead of the loop over experts.

Triton compiles the kernel for the GPU; on the CPU its interpreter runs it when asked to
(TRITON_INTERPRET=1, as the tests and the chapter's example do). Where neither holds, or
triton is not installed, `Experts` runs its reference loop.

The fused kernel is the only path a CUDA graph can hold (the loop reads the routing on
the host), and in a decode step it is several times faster. A batch of more tokens than
any captured graph runs eagerly, though, and there the loop's large per-expert matmuls
may beat our kernel: at start-up the engine times both on such batches
(`choose_moe_path`) and keeps the loop where it won by a margin.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

HAS_TRITON = importlib.util.find_spec("triton") is not None
MARGIN = 0.95  # the loop is chosen where it takes at most this share of the fused kernel's time
logger = logging.getLogger(__name__)


@dataclass
class MoEChoice:
    """Which path won, by the token count of an eager batch, measured at start-up."""

    captured: int  # batches of up to this many tokens run in graphs, which need the kernel
    fused_wins: dict[int, bool]  # tokens measured -> the fused kernel was not beaten

    def use_fused(self, tokens: int) -> bool:
        if tokens <= self.captured or not self.fused_wins:
            return True
        nearest = min(self.fused_wins, key=lambda t: abs(math.log(t / tokens)))
        return self.fused_wins[nearest]


def use_fused_moe(x: torch.Tensor) -> bool:
    return HAS_TRITON and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def loop_won(gate_up_proj: torch.Tensor, tokens: int) -> bool:
    """The start-up measurement (hung on the experts' gate_up_proj) saw the loop over experts
    beat the fused kernel at eager batches of about this many tokens."""
    choice: MoEChoice | None = getattr(gate_up_proj, "moe_choice", None)
    return choice is not None and not choice.use_fused(tokens)


def fused_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """`kernels.moe.fused_moe`, imported on first use: triton is slow to import."""
    from minisgl.kernels.moe import fused_moe

    return fused_moe(x, gate_up_proj, down_proj, experts, weights)


def choose_moe_path(
    model: nn.Module,
    captured: int,
    max_tokens: int,
    timer: Callable[[str, Callable[[], object]], float] | None = None,
) -> MoEChoice | None:
    """Time the fused kernel against the loop on one MoE layer, at token counts of 1, 4, 16,
    ... above `captured` (what graphs hold) up to `max_tokens` (the largest prefill), with
    random routing; hang the result on every MoE layer's experts. None: no MoE layer, or no
    triton to run the kernel."""
    from minisgl.layers.moe import MoEBlock

    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    if not blocks or not HAS_TRITON:
        return None
    experts, top_k = blocks[0].experts, blocks[0].top_k
    counts = [4**i for i in range(12) if captured < 4**i < max_tokens]
    counts += [max_tokens] if max_tokens > captured else []
    choice, lines = MoEChoice(captured, {}), []
    for tokens in counts:
        fused, loop = _time_both(experts, top_k, tokens, timer or _time_eager)
        choice.fused_wins[tokens] = loop > MARGIN * fused
        lines.append(f"{tokens} tokens: fused {fused * 1e3:.3f} ms, loop {loop * 1e3:.3f} ms")
    for block in blocks:
        block.experts.gate_up_proj.moe_choice = choice
    if lines:
        logger.info("MoE batches over %d tokens (eager): %s", captured, "; ".join(lines))
    return choice


@torch.inference_mode()
def _time_both(
    experts: nn.Module,
    top_k: int,
    tokens: int,
    time_it: Callable[[str, Callable[[], object]], float],
) -> tuple[float, float]:
    """(fused, loop) seconds for `tokens` tokens routed at random."""
    weight = experts.gate_up_proj
    x = torch.randn(tokens, weight.size(2), dtype=weight.dtype, device=weight.device)
    probs = torch.rand(tokens, weight.size(0), device=weight.device).softmax(-1)
    w, ids = probs.topk(top_k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
    fused = time_it(
        f"fused, {tokens} tokens", lambda: fused_experts(x, weight, experts.down_proj, ids, w)
    )
    return fused, time_it(f"loop, {tokens} tokens", lambda: experts.forward_reference(x, ids, w))


def _time_eager(label: str, run: Callable[[], object], reps: int = 3) -> float:
    """Seconds per `run()` as an eager batch runs it, host included: the median of `reps`."""
    run()  # compiles
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
