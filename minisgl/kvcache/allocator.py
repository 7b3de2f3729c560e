"""Handing out whole pages of the KV pool, and turning pages into per-token slots."""

from __future__ import annotations

import torch


class PageAllocator:
    """A free list of page ids. Page `num_pages` (the dummy page) is never handed out."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_pages(self) -> list[int]:
        return list(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV pages, only {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


def page_slots(pages: list[int], page_size: int) -> torch.Tensor:
    """The slots of the given pages, in order: [len(pages) * page_size] int32."""
    base = torch.tensor(pages, dtype=torch.int32)[:, None] * page_size
    return (base + torch.arange(page_size, dtype=torch.int32)[None, :]).flatten()
