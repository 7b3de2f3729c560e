"""SchedulerConfig: the engine's settings plus how requests are batched and cached."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.engine.config import EngineConfig


@dataclass
class SchedulerConfig(EngineConfig):
    max_prefill_length: int = 8192  # token budget of one prefill batch; longer prompts are chunked
    cache_type: str = "radix"  # "radix" shares prompt prefixes; "naive" caches nothing

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_prefill_length < 1:
            raise ValueError(f"max_prefill_length must be >= 1, got {self.max_prefill_length}")
        # >>> ch23 the largest prefill replays a graph: its activations are then accounted for
        if self.prefill_graph_max_tokens is None:
            self.prefill_graph_max_tokens = self.max_prefill_length
        # <<< ch23
        if self.cache_type not in ("radix", "naive"):
            raise ValueError(f"cache_type must be 'radix' or 'naive', got {self.cache_type!r}")
