"""The tensor-parallel settings of the engine's config: how many ranks, which one this is, and
where they meet. Apart from ranks.py, which needs torch: the API server's process has none."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class ParallelConfig:
    tp_size: int = 1
    tp_rank: int = 0  # this process's rank; whoever starts the ranks sets it
    nnodes: int = 1  # machines the ranks are spread over, tp_size // nnodes ranks on each
    dist_init_addr: str | None = None  # host:port where the ranks meet: rank 0's machine

    def check_parallel(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is not a rank of tp_size {self.tp_size}")
        if self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ValueError(f"tp_size {self.tp_size} cannot be spread over {self.nnodes} nodes")
