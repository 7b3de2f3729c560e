"""Greedy acceptance of drafts in one small kernel, after the argmax of every verify row.

A verify batch is packed request by request: request i's rows start at `starts[i]` and are
its last token and its k_i drafts, so row j's argmax is the model's token after the first j
drafts, and draft j + 1 is the input id of row j + 1. The drafts taken are the longest run
where those agree; the token after them is the argmax of the row where the run stops. One
program a request does that walk, writes the token into the token pool at its place (after
the accepted drafts) and both numbers into one buffer the host reads in one copy: what the
torch version does in a dozen launches, a gather and a stack.

A verify launched ahead (speculative/step.py) is guarded by the one before it: its first row
is a guess of that verify's last token, placed as if every draft before it were taken. Its
request's rows count only where the verify before took all `EXPECT` drafts and its token
was the guess `GUESS`; elsewhere it says -1 and writes only that verify's token back over
the guess, where the guess was put in its place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _accept_greedy_kernel(
    TARGET,  # [rows] int64: each row's argmax
    IDS,  # [rows] int32: each row's input token (a request's last token, then its drafts)
    STARTS,  # [bs] int64: each request's first row
    COUNTS,  # [bs] int64: each request's drafts
    AFTER,  # [bs] int64: the flat place in the token pool of each request's first draft
    POOL,  # the token pool, flat, int32
    OUT,  # [2, bs] int64: accepted drafts, then the token after them
    BS,
    GUARD,  # [2, bs] int64: the OUT of the verify before, where this one was launched ahead
    EXPECT,  # [bs] int64: the drafts that verify had
    GUESS,  # [bs] int64: the token this one's first row assumed it would make
    WIDTH: tl.constexpr,  # a power of two >= every count
    GUARDED: tl.constexpr,
):
    i = tl.program_id(0)
    start = tl.load(STARTS + i)
    k = tl.load(COUNTS + i)
    offs = tl.arange(0, WIDTH)
    valid = offs < k
    target = tl.load(TARGET + start + offs, mask=valid, other=-1)
    guess = tl.load(IDS + start + 1 + offs, mask=valid, other=-2).to(tl.int64)
    miss = (target != guess) | (offs >= k)
    accepted = tl.minimum(tl.min(tl.where(miss, offs, WIDTH), 0), k)
    final = tl.load(TARGET + start + accepted)
    ok = accepted >= 0  # every request counts, unless the verify before it says otherwise
    if GUARDED:
        made = tl.load(GUARD + BS + i)  # the token of the verify before
        ok = (tl.load(GUARD + i) == tl.load(EXPECT + i)) & (made == tl.load(GUESS + i))
        # where the guess took that token's place in the pool, the token goes back
        tl.store(POOL + tl.load(AFTER + i) - 1, made.to(tl.int32), mask=~ok)
    tl.store(POOL + tl.load(AFTER + i) + accepted, final.to(tl.int32), mask=ok)
    tl.store(OUT + i, tl.where(ok, accepted.to(tl.int64), -1))
    tl.store(OUT + BS + i, tl.where(ok, final, -1))


def accept_greedy(
    target: torch.Tensor,
    ids: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
    after: torch.Tensor,
    pool: torch.Tensor,
    width: int,
    guard: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """target [rows] int64 (the argmax of every row), ids [rows] int32 (the batch's input ids),
    starts, counts, after [bs] int64, pool the token pool (int32, contiguous), width >= every
    count -> [2, bs] int64: each request's accepted drafts and the token after them, which
    also goes into the pool at `after + accepted`. `guard`: (the OUT of the verify before,
    its drafts, the guesses of its tokens), for a verify launched ahead of its tokens."""
    bs = starts.numel()
    out = torch.empty(2, bs, dtype=torch.int64, device=target.device)
    before, expect, guess = guard if guard is not None else (out, starts, starts)
    if bs:
        _accept_greedy_kernel[(bs,)](
            target, ids, starts, counts, after, pool, out, bs, before, expect, guess,
            WIDTH=triton.next_power_of_2(max(width, 1)), GUARDED=guard is not None,
            num_warps=1,
        )  # fmt: skip
    return out
