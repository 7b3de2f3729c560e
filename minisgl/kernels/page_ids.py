"""The page ids of a batch's K/V, gathered from the page table in one kernel.

FlashInfer wants the pages each request's K/V occupies as one flat array (request i's
are `indices[starts[i]:starts[i + 1]]`). The page table holds a KV slot for every
position of a row; a page's id is its first slot over the page size. In torch that is a
dozen small operations (repeat_interleave, arange, gather, division), each a kernel
launch and tens of microseconds of host time per decode step; here it is one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _page_ids_kernel(
    PAGE_TABLE, ROWS, STARTS, OUT, stride_row, PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr
):
    i = tl.program_id(0)  # the request
    block = tl.program_id(1)  # a block of its pages
    start = tl.load(STARTS + i)
    count = tl.load(STARTS + i + 1) - start
    p = block * BLOCK + tl.arange(0, BLOCK)
    mask = p < count
    row = tl.load(ROWS + i).to(tl.int64)
    slot = tl.load(PAGE_TABLE + row * stride_row + p * PAGE_SIZE, mask=mask, other=0)
    tl.store(OUT + start + p, slot // PAGE_SIZE, mask=mask)


def gather_page_ids(
    page_table: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    total: int,
    max_pages: int,
    page_size: int,
) -> torch.Tensor:
    """[total] int32 page ids: request i (page-table row rows[i]) owns the pages numbered
    0 .. starts[i + 1] - starts[i] - 1 of its row. `rows` [bs] and `starts` [bs + 1] are
    int32 on the table's device; `max_pages` (the most pages of any request) sizes the grid."""
    out = torch.empty(total, dtype=torch.int32, device=page_table.device)
    bs = rows.numel()
    if total == 0 or bs == 0:
        return out
    block = min(1024, triton.next_power_of_2(max_pages))
    grid = (bs, triton.cdiv(max_pages, block))
    _page_ids_kernel[grid](
        page_table, rows, starts, out, page_table.stride(0), PAGE_SIZE=page_size, BLOCK=block
    )
    return out
