"""The next projection's weights on their way into L2 while this one runs.

At one token a projection is a matrix-vector product: its time should be its weights' bytes
over the memory's bandwidth, but a small one (1-12 MB) takes the latency of a few loads one
after another instead, because each program waits for each block of weights it asks for.
A projection's weights do not depend on its input, so they can be asked for before the
kernel that reads them starts: each GEMV launch is given the next projection's weights (the
order of one decode forward, recorded at start-up) and sends their first bytes into L2 with
Hopper's bulk prefetch, an instruction of the SM's TMA unit that nothing waits for. The next
GEMV then reads from L2. This is the megakernel's idea (weights loaded ahead of the
operation that needs them) kept in ordinary kernels launched one after another.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

Prefetch = tuple[torch.Tensor, int]  # the next projection's weights, and how many bytes of them


@triton.jit
def prefetch_l2(ptr, nbytes, LANES: tl.constexpr):
    """This program's share of the `nbytes` at `ptr` (a multiple of 16), sent into L2 by one
    bulk prefetch that its first thread issues; LANES: the program's threads."""
    share = tl.cdiv(tl.cdiv(nbytes, tl.num_programs(0)), 16) * 16
    start = tl.program_id(0) * share
    lane = tl.arange(0, LANES)
    size = tl.where(lane == 0, tl.minimum(share, nbytes - start), 0)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0;"
        " @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr.to(tl.pointer_type(tl.int8)) + start + lane * 0, size],
        dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip
