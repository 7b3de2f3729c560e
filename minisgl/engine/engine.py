"""The Engine: a model, its paged KV pool, an attention backend and a sampler on one device.

It knows nothing of scheduling. Given a batch whose requests already own KV pages (rows of
the page table filled in) and whose tokens are in the token pool, it builds the batch's
device tensors, runs one forward and samples one token per request. The sampled tokens
are written straight back into the token pool on the device, so the next step's inputs
can be gathered without waiting for the host to see them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from minisgl.attention.base import BaseAttnBackend
from minisgl.attention.registry import select_backend
from minisgl.core import Batch, Context, Req, SamplingParams, set_global_ctx
from minisgl.distributed import destroy_distributed, rank_heads  # [ch21]

# >>> ch25
from minisgl.engine.bias import (
    LogitBias,
    TokenMask,
    apply_logit_bias,
    apply_token_mask,
    gather_logit_bias,
)

# <<< ch25
from minisgl.engine.config import EngineConfig
from minisgl.engine.graph import GraphPlan, GraphRunner  # [ch18]
from minisgl.engine.jit_log import jit_log  # [ch20]
from minisgl.engine.kernels import install_kernels  # [ch19]

# >>> ch25
from minisgl.engine.logprobs import Logprobs, plan_prompt_logprobs, split_prompt_logits, top_to_host

# <<< ch25
from minisgl.engine.penalty import Penalties, apply_penalties, gather_penalties
from minisgl.engine.prefill_graph import plan_prefill_graphs  # [ch23]
from minisgl.engine.ranks import agree_on_limits, join_ranks  # [ch21]
from minisgl.engine.sample import (
    BatchSamplingArgs,
    prepare_sampling,
    sample,
    warm_up_sampling,  # [ch20]
)
from minisgl.engine.verify_graph import plan_verify_graphs  # [ch26]
from minisgl.env import ENV
from minisgl.kvcache.mha_pool import MHAKVCache
from minisgl.models.config import ModelConfig
from minisgl.models.families import context_length, sliding  # [ch29]
from minisgl.models.register import create_model
from minisgl.models.weight import load_weights
from minisgl.quant.fp8 import check_device  # [ch28]
from minisgl.quant.kv_scales import use_kv_scales  # [ch28]
from minisgl.quant.quantize import quantize_model  # [ch28]
from minisgl.utils import cdiv, to_device, to_host

logger = logging.getLogger(__name__)


@dataclass
class ForwardOutput:
    next_tokens: torch.Tensor  # [bs] int32 on the device
    next_tokens_cpu: torch.Tensor  # [bs] int32 on the host, valid once `copy_done` is reached
    logprobs_cpu: torch.Tensor | None  # [bs] fp32 on the host, when any request asked for them
    copy_done: torch.cuda.Event | None
    # >>> ch25 on the host too, when asked for
    top_ids_cpu: torch.Tensor | None = None  # [bs, k] int32: the likeliest tokens, best first
    top_logprobs_cpu: torch.Tensor | None = None  # [bs, k] fp32
    prompt_logprobs: Logprobs | None = None  # of the prompt tokens this forward covered
    # <<< ch25


@dataclass
class StepLogits:
    """A forward's logits and what sampling them needs, fixed when the forward is launched:
    the scheduler moves its requests on right after, before it may have sampled."""

    logits: torch.Tensor  # [bs, vocab] fp32
    reqs: list[Req]
    sampling: BatchSamplingArgs
    penalties: Penalties | None
    where: torch.Tensor  # [bs] int64: each sampled token's place in the token pool (flat)
    # >>> ch25
    bias: LogitBias | None = None
    prompt_logprobs: Logprobs | None = None
    token_mask: TokenMask | None = None  # a grammar's, set once the previous token is known
    # <<< ch25


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        clock = _Clock()  # the start-up's phases, for one line in the log
        self.jit = jit_log()  # the Triton kernels built from here on  # [ch20]
        self.config = config
        self.model_config = ModelConfig.from_path(config.model_path)
        self.device = _resolve_device(config.device)
        self.device = join_ranks(config, self.model_config, self.device)  # [ch21]
        self.free_memory_at_start = (
            torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
        )
        dtype = config.dtype  # a name where it came from the command line
        self.dtype = (
            getattr(torch, dtype) if isinstance(dtype, str) else dtype or self._default_dtype()
        )
        self.kv_dtype = self.dtype  # what the KV cache stores
        # >>> ch28 an FP8 KV cache: keys and values in e4m3, twice the tokens in the same bytes
        if config.kv_cache_dtype == "fp8_e4m3":
            check_device(self.device)
            self.kv_dtype = torch.float8_e4m3fn
        # <<< ch28
        self.max_seq_len = self._max_seq_len()
        # longrope's factors and dynamic NTK's base depend on the context served  # [ch29]
        self.model_config = replace(self.model_config, rope_context=self.max_seq_len)  # [ch29]
        self.page_size = config.page_size

        with torch.device(self.device), _default_dtype(self.dtype):
            self.model = create_model(self.model_config)
        load_weights(self.model, config.model_path)
        quantize_model(self.model, config.quantization)  # FP8 projections, if asked  # [ch28]
        self.model.requires_grad_(False)
        clock.lap("weights")

        mc = self.model_config
        heads = (mc.num_heads, mc.num_kv_heads)
        heads = rank_heads(*heads)  # this rank's share of them  # [ch21]
        self.num_qo_heads, self.num_kv_heads = heads
        self.num_pages = config.num_page_override or self._pages_from_budget()
        self.num_pages = agree_on_limits(self)  # every rank schedules alike  # [ch21]
        self.kv_cache = MHAKVCache(
            mc.num_layers,
            self.num_pages,
            self.page_size,
            self.num_kv_heads,
            mc.head_dim,
            self.kv_dtype,
            self.device,
        )
        use_kv_scales(self.model, self.kv_cache)  # the checkpoint's, for an FP8 cache  # [ch28]
        # One row per running request plus one for the dummy request; one column per
        # position of the longest sequence, plus one for the token sampled after it.
        rows = config.max_running_req + 1
        width = cdiv(self.max_seq_len + 1, self.page_size) * self.page_size
        self.page_table = torch.zeros((rows, width), dtype=torch.int32, device=self.device)
        self.token_pool = torch.zeros((rows, width), dtype=torch.int32, device=self.device)
        dummy_slots = (
            self.kv_cache.dummy_page * self.page_size + torch.arange(width) % self.page_size
        )
        self.page_table[rows - 1] = dummy_slots.to(self.device, torch.int32)
        self.dummy_req = Req(
            torch.zeros(1, dtype=torch.int32), rows - 1, 0, 1, -1, SamplingParams()
        )
        clock.lap("KV pool")

        self.attn_backend = self._create_backend()
        self.ctx = Context(self.attn_backend)
        set_global_ctx(self.ctx)
        clock.lap("attention backend")
        # >>> ch18 every shape to capture, then one loop that captures them
        plan = GraphPlan.of(self)
        plan.kinds += plan_prefill_graphs(self, plan)  # [ch23]
        plan.kinds += plan_verify_graphs(self, plan)  # [ch26]
        install_kernels(self, plan)  # chosen once, measured, installed on the layers  # [ch19]
        clock.lap("kernel choice")  # [ch20]
        self.graph_runner = GraphRunner(
            self.model, self.attn_backend, plan, mc.vocab_size, self.device
        )
        clock.phases.update(self.graph_runner.capture_seconds)
        # <<< ch18
        if self.device.type == "cuda":  # [ch20]
            warm_up_sampling(mc.vocab_size, self.device)  # [ch20]
        self.jit.mark_ready()  # [ch20]
        logger.info("Triton at start-up: %s", self.jit.summary(self.jit.builds))  # [ch20]
        logger.info(
            "engine ready in %s: %s %s on %s, %s attention, %d KV pages of %d tokens, "
            "max_seq_len %d",
            clock,
            mc.architecture,
            self.dtype,
            self.device,
            self.attn_backend.name,
            self.num_pages,
            self.page_size,
            self.max_seq_len,
        )

    def prepare_batch(self, batch: Batch) -> None:
        """Gather the batch's input ids, positions and KV slots, and its attention metadata,
        and find where each request's sampled token will go in the token pool."""
        self.graph_runner.pad_batch(batch)  # [ch18]
        reqs = batch.padded_reqs
        # The token pool and the page table have one shape, so one flat index (row * width
        # + position) finds a token's place in both; `take` gathers by it in one cheap op.
        width = self.token_pool.size(1)
        places = [r.table_idx * width + p for r in reqs for p in range(r.cached_len, r.device_len)]
        positions = [p for r in reqs for p in range(r.cached_len, r.device_len)]
        # A request whose forward covers every token it has is done with its prompt: its
        # token goes to the next place in its row. A chunk's token is moot: the dummy row's.
        dummy = self.dummy_req.table_idx * width
        dest = [dummy if r.mid_prompt else r.table_idx * width + r.device_len for r in batch.reqs]
        n = len(places)
        places_d, positions_d, batch.token_dest = to_device(
            places + positions + dest, self.device, torch.int64
        ).split([n, n, batch.size])  # one copy for all three
        batch.positions = positions_d.to(torch.int32)
        batch.input_ids = self.token_pool.take(places_d)
        batch.out_loc = self.page_table.take(places_d)
        self.attn_backend.prepare_metadata(batch)

    def forward_batch(self, batch: Batch) -> ForwardOutput:
        """One forward and one sampled token per request; each token also goes into the pool.

        A request still in the middle of its prompt (a chunk that is not its last) gets a
        token too, which is meaningless: it is written to the dummy row and ignored.
        """
        return self.sample_logits(self.forward_logits(batch))

    @torch.inference_mode()
    def forward_logits(self, batch: Batch) -> StepLogits:
        """The model's forward, and the sampling inputs as the batch stands now."""
        reqs, vocab = batch.reqs, self.model_config.vocab_size
        plan = plan_prompt_logprobs(batch, self.device) if batch.is_prefill else None  # [ch25]
        logits = self.logits(batch)
        step = StepLogits(
            logits,
            reqs,
            prepare_sampling(reqs, vocab, self.device),
            gather_penalties(reqs, self.token_pool, vocab),
            batch.token_dest,
        )
        step.logits, step.prompt_logprobs = split_prompt_logits(logits, plan)  # [ch25]
        step.bias = gather_logit_bias(reqs, self.device)  # [ch25]
        return step

    @torch.inference_mode()
    def logits(self, batch: Batch) -> torch.Tensor:
        """The forward alone: the logits of the batch's live rows."""
        set_global_ctx(self.ctx)  # several engines may live in one process (tests do this)
        with self.ctx.forward_batch(batch):
            return self._logits(batch)

    @torch.inference_mode()
    def sample_logits(self, step: StepLogits) -> ForwardOutput:
        """Penalties, then one token per request; the tokens also go into the token pool."""
        logits = step.logits
        if step.penalties is not None:
            logits = apply_penalties(logits, step.penalties)
        logits = apply_logit_bias(logits, step.bias)  # [ch25]
        logprobs = None
        if any(r.sampling_params.logprobs for r in step.reqs):
            logprobs = torch.log_softmax(logits, dim=-1)
        logits = apply_token_mask(logits, step.token_mask)  # after: the model's view  # [ch25]
        next_tokens = sample(logits, step.sampling)
        self.token_pool.put_(step.where, next_tokens)
        out = ForwardOutput(next_tokens, to_host(next_tokens), None, None)
        if logprobs is not None:
            out.logprobs_cpu = to_host(logprobs.gather(1, next_tokens.long()[:, None])[:, 0])
            out.top_ids_cpu, out.top_logprobs_cpu = top_to_host(logprobs, step.reqs)  # [ch25]
        if step.prompt_logprobs is not None:  # [ch25]
            out.prompt_logprobs = step.prompt_logprobs.to_host()  # [ch25]
        if self.device.type == "cuda":
            out.copy_done = torch.cuda.Event()
            out.copy_done.record()
        return out

    def _logits(self, batch: Batch) -> torch.Tensor:
        # >>> ch18
        if self.graph_runner.can_use_cuda_graph(batch):
            return self.graph_runner.replay(batch)
        # <<< ch18
        # >>> ch25 rows for every prompt position of some requests, not one per request
        if batch.logit_rows is not None:
            return self.model.forward()
        # <<< ch25
        return self.model.forward()[: batch.num_logit_rows]

    def _default_dtype(self) -> torch.dtype:
        # On a GPU, the checkpoint's own dtype. On a CPU, fp32: CPUs without bf16 matrix
        # units run batched bf16 matmuls several times slower than fp32 ones.
        if self.device.type == "cpu":
            return torch.float32
        return getattr(torch, self.model_config.dtype or "bfloat16")

    def _max_seq_len(self) -> int:
        mc, override = self.model_config, self.config.max_seq_len_override
        limit = mc.max_position_embeddings
        limit = context_length(mc)  # stretched by yarn or dynamic NTK  # [ch29]
        if override is not None and override > limit:
            raise ValueError(f"max_seq_len_override {override} exceeds the model's context {limit}")
        return override or limit

    def _pages_from_budget(self) -> int:
        mc = self.model_config
        per_page = MHAKVCache.bytes_per_page(
            mc.num_layers, self.page_size, self.num_kv_heads, mc.head_dim, self.kv_dtype
        )
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * ENV.MEMORY_FRACTION.value)
        else:
            budget = ENV.CPU_KV_CACHE_MB.value * 2**20
        # More pages than every row filled to the brim cannot be used.
        useful = self.config.max_running_req * cdiv(self.max_seq_len, self.page_size)
        pages = min(budget // per_page, useful)
        if pages < 1:
            raise MemoryError(f"no room for a single KV page ({per_page} bytes) in {budget} bytes")
        return pages

    def _create_backend(self) -> BaseAttnBackend:
        cls = select_backend(
            self.config.attention_backend, self.device, self.dtype, self.page_size,
            fp8_kv=self.kv_dtype == torch.float8_e4m3fn,  # [ch28]
        )  # fmt: skip
        mc = self.model_config
        scale = mc.head_dim**-0.5
        scale = (mc.query_pre_attn_scalar or mc.head_dim) ** -0.5  # Gemma's own  # [ch29]
        backend = cls(self.kv_cache, self.page_table, scale, self.num_qo_heads)
        # >>> ch29 sliding layers: a window no shorter than the context is no window
        windows = [mc.sliding_window if sliding(mc, i) else None for i in range(mc.num_layers)]
        backend.set_windows([w if w and w < self.max_seq_len else None for w in windows])
        # <<< ch29
        return backend

    def shutdown(self) -> None:
        self.graph_runner.destroy_cuda_graphs()  # [ch18]
        destroy_distributed()  # after the graphs: they hold the NCCL communicator's calls  # [ch21]
        set_global_ctx(None)


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for, but torch sees no CUDA device")
    return device


class _Clock:
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


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)
