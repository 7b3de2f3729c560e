"""SchedulerConfig: the engine's settings (its prefill budget too) plus how requests are cached."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING  # [ch27]

from minisgl.engine.config import EngineConfig

if TYPE_CHECKING:  # [ch27]
    from minisgl.scheduler.kv_events import KVEventsConfig  # [ch27]


@dataclass
class SchedulerConfig(EngineConfig):
    cache_type: str = "radix"  # "radix" shares prompt prefixes; "naive" caches nothing
    grammar_compile_timeout: float = 5.0  # seconds a JSON schema may take to compile  # [ch25]
    kv_events: KVEventsConfig | None = None  # publish what the cache stores and evicts  # [ch27]

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cache_type not in ("radix", "naive"):
            raise ValueError(f"cache_type must be 'radix' or 'naive', got {self.cache_type!r}")
        if not self.grammar_compile_timeout > 0:  # [ch25]
            raise ValueError("grammar_compile_timeout must be > 0 seconds")  # [ch25]
