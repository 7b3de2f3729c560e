"""Start-up: everything the engine fixes once, before its first forward.

In order: the device (and the tensor-parallel group, whose rank decides which slice of each
weight a layer keeps), the dtypes, the context, the model and its weights, then the memory:
how many KV pages fit, the page table and the token pool. What start-up fixes is gathered
in `EngineShape`, a small value: the helpers that plan graphs, choose kernels or compare
ranks take it, never the engine itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from minisgl.core import Req, SamplingParams
from minisgl.distributed import rank_heads  # [ch21]
from minisgl.engine.config import EngineConfig, check_model_files
from minisgl.engine.limits import EngineLimits
from minisgl.engine.ranks import join_ranks  # [ch21]
from minisgl.env import ENV
from minisgl.kvcache import layout  # which layers keep what: layer groups, states  # [ch29]
from minisgl.kvcache.mha_pool import MHAKVCache
from minisgl.models.base import BaseLLMModel
from minisgl.models.config import ModelConfig
from minisgl.models.families import context_length  # [ch29]
from minisgl.models.register import create_model
from minisgl.models.weight import load_weights
from minisgl.quant.fp8 import check_device  # [ch28]
from minisgl.quant.quantize import quantize_model  # [ch28]
from minisgl.utils import cdiv

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineShape:
    """What the engine is, in plain values fixed at start-up."""

    config: EngineConfig
    model_config: ModelConfig  # its rope_context set to the context served
    device: torch.device  # this rank's
    dtype: torch.dtype  # of the weights and activations
    kv_dtype: torch.dtype  # what the KV cache stores
    max_seq_len: int  # the context served
    num_qo_heads: int  # this rank's share of the query heads
    num_kv_heads: int  # and of the KV heads
    free_memory_at_start: int  # bytes free on the GPU before the weights (0 on a CPU)

    @property
    def page_size(self) -> int:
        return self.config.page_size

    def limits(self, num_pages: int) -> EngineLimits:
        """The engine's limits once its KV pool holds `num_pages` pages."""
        mc, config = self.model_config, self.config
        return EngineLimits(
            self.max_seq_len, num_pages, config.page_size, config.max_running_req, mc.vocab_size
        )


def resolve_shape(config: EngineConfig) -> EngineShape:
    """The device, dtypes, context and heads of this engine (its rank joined, if one of many)."""
    check_model_files(config)
    model_config = ModelConfig.from_path(config.model_path)
    device = _resolve_device(config.device)
    device = join_ranks(config, model_config, device)  # [ch21]
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    dtype = config.dtype  # a name where it came from the command line
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    dtype = dtype or _default_dtype(model_config, device)
    kv_dtype = dtype
    # >>> ch28 an FP8 KV cache: keys and values in e4m3, twice the tokens in the same bytes
    if config.kv_cache_dtype == "fp8_e4m3":
        check_device(device)
        kv_dtype = torch.float8_e4m3fn
    # <<< ch28
    max_seq_len = _max_seq_len(config, model_config)
    # longrope's factors and dynamic NTK's base depend on the context served  # [ch29]
    model_config = replace(model_config, rope_context=max_seq_len)  # [ch29]
    heads = (model_config.num_heads, model_config.num_kv_heads)
    heads = rank_heads(*heads)  # this rank's share of them  # [ch21]
    return EngineShape(config, model_config, device, dtype, kv_dtype, max_seq_len, *heads, free)


def load_model(shape: EngineShape) -> BaseLLMModel:
    """The model built on its device in its dtype, with the checkpoint's weights."""
    with torch.device(shape.device), _torch_default_dtype(shape.dtype):
        model = create_model(shape.model_config)
    load_weights(model, shape.config.model_path)
    quantize_model(model, shape.config.quantization)  # FP8 projections, if asked  # [ch28]
    return model.requires_grad_(False)


def pages_from_budget(shape: EngineShape) -> int:
    """The KV pages that fit the memory budget: on a GPU a share of what is free once the
    weights are in, on a CPU a fixed size; never more than every row filled to the brim."""
    mc, config = shape.model_config, shape.config
    per_page = MHAKVCache.bytes_per_page(
        mc.num_layers, shape.page_size, shape.num_kv_heads, mc.head_dim, shape.kv_dtype
    )
    per_page = layout.bytes_per_page(shape)  # each layer group's; shared, linear: none  # [ch29]
    if shape.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(shape.device)
        budget = int(free * ENV.MEMORY_FRACTION.value)
    else:
        budget = ENV.CPU_KV_CACHE_MB.value * 2**20
    budget = layout.budget_after_windows(shape, budget, per_page)  # sliding layers'  # [ch29]
    budget = layout.budget_after_states(shape, budget, per_page)  # a hybrid's come first  # [ch31]
    useful = config.max_running_req * cdiv(shape.max_seq_len, shape.page_size)
    pages = min(budget // per_page, useful)
    if pages < 1:
        raise MemoryError(f"no room for a single KV page ({per_page} bytes) in {budget} bytes")
    return pages


@dataclass
class Pools:
    """Where a request's state lives: its KV pages, and its row of the page table (which
    slot holds each position's K/V) and of the token pool (each position's token id)."""

    kv_cache: MHAKVCache
    page_table: torch.Tensor  # [rows, width] int32
    token_pool: torch.Tensor  # [rows, width] int32
    dummy_req: Req  # the padding request of a graph batch: the last row, the dummy page
    state_pool: layout.RecurrentStatePool | None = None  # a hybrid's: a slot a row  # [ch31]


def make_pools(shape: EngineShape, num_pages: int) -> Pools:
    """One row per running request plus one for the dummy request; one column per position
    of the longest sequence, plus one for the token sampled after it."""
    device, page_size = shape.device, shape.page_size
    new_kv_pool = every_layer_pool
    new_kv_pool = layout.new_pool  # a storage per group of layers of one shape  # [ch29]
    kv_cache = new_kv_pool(shape, num_pages)
    rows = shape.config.max_running_req + 1
    width = cdiv(shape.max_seq_len + 1, page_size) * page_size
    page_table = torch.zeros((rows, width), dtype=torch.int32, device=device)
    token_pool = torch.zeros((rows, width), dtype=torch.int32, device=device)
    dummy_slots = kv_cache.dummy_page * page_size + torch.arange(width) % page_size
    page_table[rows - 1] = dummy_slots.to(device, torch.int32)
    dummy_req = Req(torch.zeros(1, dtype=torch.int32), rows - 1, 0, 1, -1, SamplingParams())
    pools = Pools(kv_cache, page_table, token_pool, dummy_req)
    pools.state_pool = layout.make_state_pool(shape, rows)  # a hybrid's recurrent states  # [ch31]
    return pools


def every_layer_pool(shape: EngineShape, num_pages: int) -> MHAKVCache:
    """Keys and values of every layer, all of one shape."""
    mc = shape.model_config
    return MHAKVCache(
        mc.num_layers, num_pages, shape.page_size, shape.num_kv_heads, mc.head_dim,
        shape.kv_dtype, shape.device,
    )  # fmt: skip


class Clock:
    """Seconds per named phase since the last lap; printed as the total and the phases."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase], self.last = now - self.last, now

    def __str__(self) -> str:
        parts = ", ".join(f"{phase} {s:.1f}s" for phase, s in self.phases.items())
        return f"{time.perf_counter() - self.start:.1f}s ({parts})"


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for, but torch sees no CUDA device")
    return device


def _default_dtype(model_config: ModelConfig, device: torch.device) -> torch.dtype:
    # On a GPU, the checkpoint's own dtype. On a CPU, fp32: CPUs without bf16 matrix
    # units run batched bf16 matmuls several times slower than fp32 ones.
    if device.type == "cpu":
        return torch.float32
    return getattr(torch, model_config.dtype or "bfloat16")


def _max_seq_len(config: EngineConfig, mc: ModelConfig) -> int:
    override = config.max_seq_len_override
    limit = mc.max_position_embeddings
    limit = context_length(mc)  # stretched by yarn or dynamic NTK  # [ch29]
    if override is not None and override > limit:
        raise ValueError(f"max_seq_len_override {override} exceeds the model's context {limit}")
    return override or limit


@contextmanager
def _torch_default_dtype(dtype: torch.dtype) -> Iterator[None]:
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)
