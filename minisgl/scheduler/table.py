"""The table manager: rows of the page table and token pool, one per running request."""

from __future__ import annotations

import torch

from minisgl.utils import to_device


class TableManager:
    def __init__(self, max_running_req: int, token_pool: torch.Tensor) -> None:
        self.token_pool = token_pool
        self._free = list(range(max_running_req - 1, -1, -1))  # the dummy row is never free

    @property
    def available(self) -> int:
        return len(self._free)

    def alloc(self, input_ids: torch.Tensor) -> int:
        """Take a row and write the known tokens into it (the engine reads inputs from here)."""
        row = self._free.pop()
        self.token_pool[row, : len(input_ids)] = to_device(input_ids, self.token_pool.device)
        return row

    def free(self, row: int) -> None:
        self._free.append(row)
