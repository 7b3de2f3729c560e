"""What a prefix cache offers the cache manager (match, insert, lock, evict), and its listeners."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class MatchResult:
    node: Any  # handle to lock while a request uses the prefix
    length: int  # matched tokens, a multiple of page_size
    slots: torch.Tensor  # their KV slots, [length] int32
    stop: int | None = None  # a hybrid's first forward ends here, to save its state  # [ch31]


class CacheListener(Protocol):
    """Told what a prefix cache stores and evicts: a node of it (KV-cache events listen)."""

    def stored(self, node: Any) -> None: ...

    def removed(self, node: Any) -> None: ...


class BasePrefixCache(ABC):
    evictable_tokens: int  # cached and unlocked: can be freed on demand
    protected_tokens: int  # cached and locked by running requests

    @abstractmethod
    def match_prefix(self, input_ids: torch.Tensor) -> MatchResult: ...

    @abstractmethod
    def insert(self, input_ids: torch.Tensor, slots: torch.Tensor) -> int:
        """Cache a page-aligned prefix; returns the length that was cached already."""

    @abstractmethod
    def lock(self, node: Any) -> None: ...

    @abstractmethod
    def unlock(self, node: Any) -> None: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> torch.Tensor:
        """Free at least num_tokens of unlocked cache (if there are); returns their slots."""

    @abstractmethod
    def all_slots(self) -> torch.Tensor: ...

    @abstractmethod
    def check_integrity(self) -> None: ...
