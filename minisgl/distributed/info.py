"""TPInfo: this process's rank among the tensor-parallel ranks, readable from anywhere.

Layers read it when they are built, to decide which slice of each weight they hold; the
scheduler reads it to know whether it is rank 0, the one that talks to the outside world.
A process that never joins a group is rank 0 of 1, so single-device code needs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TPInfo:
    rank: int
    size: int

    @property
    def is_primary(self) -> bool:
        """Rank 0: it receives the requests, shares them, and alone sends the replies."""
        return self.rank == 0

    def slice_of(self, slices: int) -> int:
        """Which of `slices` equal slices of a tensor this rank keeps. With as many slices as
        ranks, its own; with fewer (KV heads fewer than ranks), neighbours share one."""
        return self.rank * slices // self.size


_tp_info = TPInfo(0, 1)


def get_tp_info() -> TPInfo:
    return _tp_info


def set_tp_info(rank: int, size: int) -> None:
    global _tp_info
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} is outside [0, {size})")
    _tp_info = TPInfo(rank, size)


def rank_heads(num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """This rank's attention heads: its share of the query heads, and its share of the KV
    heads, or one KV head where the ranks outnumber them."""
    size = get_tp_info().size
    return num_heads // size, max(num_kv_heads // size, 1)


@dataclass(frozen=True)
class Split:
    """How one weight is cut across the ranks: along `dim`, each of its `parts` (the sizes of
    the tensors merged into it, e.g. q, k and v) into `slices` equal slices, of which every
    rank keeps one. Layers attach it to their parameters; the weight loader reads it."""

    dim: int
    parts: tuple[int, ...]
    slices: tuple[int, ...]

    def __post_init__(self) -> None:
        for part, slices in zip(self.parts, self.slices):
            if part % slices:
                raise ValueError(f"{part} features cannot be cut into {slices} equal slices")

    @classmethod
    def even(cls, dim: int, *parts: int) -> Split:
        """Every part cut into one slice per rank."""
        return cls(dim, parts, (get_tp_info().size,) * len(parts))

    @classmethod
    def qkv(cls, num_heads: int, num_kv_heads: int, head_dim: int) -> Split:
        """q by heads, one share per rank; k and v the same, or, with fewer KV heads than
        ranks, one KV head per rank, shared by the ranks whose query heads attend to it."""
        size = get_tp_info().size
        kv = min(num_kv_heads, size)
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        return cls(0, (q_size, kv_size, kv_size), (size, kv, kv))

    @property
    def local_size(self) -> int:
        """The size of this rank's slice along `dim`, all parts together."""
        return sum(p // s for p, s in zip(self.parts, self.slices))

    def ranges(self, held: range | tuple[int, ...]) -> list[tuple[int, int]]:
        """Where this rank's slices lie (start, end) in a checkpoint tensor that holds the
        parts `held`, one after the other: all of them, or one piece such as k_proj alone."""
        out, offset = [], 0
        for i in held:
            size = self.parts[i] // self.slices[i]
            start = offset + get_tp_info().slice_of(self.slices[i]) * size
            out.append((start, start + size))
            offset += self.parts[i]
        return out
