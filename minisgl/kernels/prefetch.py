"""The next projection's weights on their way to the L2 cache while this one runs.

At one row a projection reads each weight once, so its time should be its bytes over the
memory's bandwidth; on a small model it is mostly not. Every GEMV starts by asking memory
for its first blocks of W and waits a full round trip before its first multiply, and it
ends in a tail where the last programs finish while the memory sits idle, and between the
two a launch. Four projections a layer pay that four times, and the attention between
them reads little, so at batch 1 the memory is busy for a third of the step.

Yet which weights a decode step reads next never depends on the activations: layer i's
qkv, o, gate_up and down, then layer i + 1's, in the order of the forward. So each GEMV
program, before its own loads, asks the L2 cache for its share of the next projection's
first bytes (`prefetch.global.L2::evict_last`, one 128-byte line a thread: an instruction
that returns nothing, so the warp does not wait for it), and the GEMV's own loads of W are
marked evict-first, so the weights it streams past leave the cache before the ones on their
way. The next GEMV then finds its first blocks in the L2 (or already coming), and the
memory keeps working across the launch and the kernels in between.

How many bytes ahead is `MINISGL_GEMV_PREFETCH_MB` (0, the default, prefetches nothing):
the L2 of an H100 or H200 holds 50 MB, so a layer's small projections fit whole, a large
one's first part. The order is the one the start-up forward recorded (kernel_choice.py),
read round: the LM head's GEMV prefetches the first layer's qkv for the next step.

Triton's interpreter cannot run the instruction (inline assembly), so on the CPU the
kernels take the prefetch's arguments and skip it; the tests compile the kernels for a
Hopper GPU to check the instruction is there.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

LINE = 128  # bytes of an L2 cache line: one prefetch instruction each


class Prefetch(NamedTuple):
    """What a GEMV asks the L2 cache for: the first `nbytes` of `weight`."""

    weight: torch.Tensor
    nbytes: int


@triton.jit
def prefetch_l2(P, lines, per, LINE_ELEMS: tl.constexpr, CHUNK: tl.constexpr):
    """This program's share of the first `lines` cache lines from P asked of the L2 cache:
    `per` lines from pid * per on, CHUNK at a time, one a thread; a lane past the program's
    share or past `lines` asks for P's first line again (a hit, merged within its warp)."""
    first = tl.program_id(0).to(tl.int64) * per
    for c in range(0, per, CHUNK):
        line = first + c + tl.arange(0, CHUNK)
        line = tl.where((line < lines) & (line < first + per), line, 0)
        tl.inline_asm_elementwise(
            "prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
            [P + line * LINE_ELEMS], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


def share(nbytes: int, programs: int) -> tuple[int, int, int]:
    """(lines, lines a program, CHUNK) for `programs` programs asking for `nbytes`: every
    line of the first nbytes (rounded down to whole lines) by exactly one program."""
    lines = nbytes // LINE
    per = max(1, triton.cdiv(lines, programs))
    return lines, per, min(128, triton.next_power_of_2(per))


def prefetch_args(prefetch: Prefetch | None, programs: int, stand_in: torch.Tensor) -> dict:
    """The prefetch's launch arguments of a kernel of `programs` programs: PF (the weight),
    pf_lines, pf_per, PF_LINE_ELEMS, PF_CHUNK and PREFETCH (whether to: never in the
    interpreter, which cannot). Without one, PF is `stand_in`, never read."""
    on = prefetch is not None and stand_in.device.type == "cuda"
    lines, per, chunk = share(min(prefetch.nbytes, prefetch.weight.nbytes) if on else 0, programs)
    return dict(
        PF=prefetch.weight if on else stand_in,
        pf_lines=lines,
        pf_per=per,
        PF_LINE_ELEMS=LINE // prefetch.weight.element_size() if on else 1,
        PF_CHUNK=chunk,
        PREFETCH=lines > 0,
    )
