"""The cache that caches nothing: every request computes its whole prompt.

Useful as the baseline the radix cache is measured against, and to rule the prefix
cache out when hunting a bug.
"""

from __future__ import annotations

import torch

from minisgl.kvcache.base import BasePrefixCache, MatchResult

_EMPTY = torch.empty(0, dtype=torch.int32)


class NaiveCache(BasePrefixCache):
    evictable_tokens = 0
    protected_tokens = 0

    def match_prefix(self, input_ids: torch.Tensor) -> MatchResult:
        return MatchResult(None, 0, _EMPTY)

    def insert(self, input_ids: torch.Tensor, slots: torch.Tensor) -> int:
        return 0  # nothing was here before, and nothing is kept: the pages stay the caller's

    def lock(self, node: None) -> None:
        pass

    def unlock(self, node: None) -> None:
        pass

    def evict(self, num_tokens: int) -> torch.Tensor:
        return _EMPTY

    def all_slots(self) -> torch.Tensor:
        return _EMPTY

    def check_integrity(self) -> None:
        pass
