"""What a hybrid model (linear-attention layers with a recurrent state beside attention layers
with KV pages) cannot do yet, refused or turned off by name at start-up.

- Speculative decoding would need a verify step that keeps the state after each draft
  position and rolls it back to the accepted length: refused.
- Tensor parallelism would split the linear layers' heads and conv channels: refused.
- A radix-cache hit skips the prefix's forward, so its recurrent state would never be
  computed: without state snapshots the prefix cache is wrong. The scheduler runs a hybrid
  model with the naive cache (`prefix_cache`) and says so.
- Graphs: the model's `graph_blocker` turns them off (engine/graph.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from minisgl.engine.config import EngineConfig
from minisgl.kvcache.state_pool import RecurrentStatePool
from minisgl.models.config import ModelConfig
from minisgl.models.families import attention_layers

if TYPE_CHECKING:
    from minisgl.engine.startup import EngineShape

logger = logging.getLogger(__name__)


def check_hybrid(config: EngineConfig, model_config: ModelConfig) -> None:
    if model_config.linear is None:
        return
    arch = model_config.architecture
    if config.speculative != "off":
        raise ValueError(
            f"speculative decoding ({config.speculative!r}) is not supported for {arch} yet: "
            "its linear-attention layers' state cannot be rolled back to the accepted drafts"
        )
    if config.tp_size > 1:
        raise ValueError(
            f"tp_size {config.tp_size} is not supported for {arch} yet: its linear-attention "
            "layers are not split across ranks"
        )


def prefix_cache(model_config: ModelConfig, cache_type: str) -> str:
    """The prefix cache a model can run with: a hybrid model, none (the naive cache)."""
    if model_config.linear is not None and cache_type != "naive":
        logger.info(
            "prefix cache off (naive cache) for %s: a cached prefix's linear-attention state "
            "is not kept, so a cache hit would skip computing it",
            model_config.architecture,
        )
        return "naive"
    return cache_type


def state_pool_bytes(shape: EngineShape) -> int:
    """What a hybrid model's recurrent state pool takes: a slot for every page-table row
    (0 for a model without linear layers)."""
    mc = shape.model_config
    if mc.linear is None:
        return 0
    linear_layers = mc.num_layers - len(attention_layers(mc))
    per_slot = RecurrentStatePool.bytes_per_slot(linear_layers, mc.linear, shape.dtype)
    return per_slot * (shape.config.max_running_req + 1)


def budget_after_states(shape: EngineShape, budget: int, per_page: int) -> int:
    """The KV pages' budget once the recurrent states have theirs; an error if no page fits."""
    states = state_pool_bytes(shape)
    if states and budget - states < per_page:
        raise MemoryError(
            f"the recurrent states of {shape.config.max_running_req} requests take "
            f"{states / 2**20:.0f} MB, leaving no room for a KV page in a budget of "
            f"{budget / 2**20:.0f} MB: lower max_running_req or raise the budget"
        )
    return budget - states


def make_state_pool(shape: EngineShape, rows: int) -> RecurrentStatePool | None:
    """Slot i for page-table row i, the last for the dummy request; its size logged."""
    mc = shape.model_config
    if mc.linear is None:
        return None
    linear_layers = mc.num_layers - len(attention_layers(mc))
    pool = RecurrentStatePool(linear_layers, rows, mc.linear, shape.dtype, shape.device)
    logger.info(
        "recurrent state pool: %d linear layers x %d slots (%d requests + the dummy), "
        "%.1f MB a request, %.1f MB in all",
        linear_layers, rows, rows - 1, pool.bytes / rows / 2**20, pool.bytes / 2**20,
    )  # fmt: skip
    return pool
