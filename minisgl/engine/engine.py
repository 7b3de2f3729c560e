"""The Engine: a model, its state pools and an attention backend on one device, and a sampler.

It knows nothing of scheduling. Given a batch whose requests already own KV pages (rows of
the page table filled in) and whose tokens are in the token pool, it builds the batch's
device tensors, runs one forward and samples one token per request. The sampled tokens
are written straight back into the token pool on the device, so the next step's inputs
can be gathered without waiting for the host to see them.

Three rooms: start-up (startup.py) fixes the device, dtypes, context, weights and memory;
this file runs the forward over the pools; the sampler (sampler.py) turns logits into tokens.
"""

from __future__ import annotations

import logging
import time  # [ch20]

import torch

from minisgl.attention.base import BaseAttnBackend
from minisgl.attention.registry import select_backend
from minisgl.core import Batch, Context, set_global_ctx
from minisgl.distributed import destroy_distributed  # [ch21]
from minisgl.engine.config import EngineConfig
from minisgl.engine.graph import GraphPlan, GraphRunner  # [ch18]
from minisgl.engine.jit_log import jit_log, sampling_calls, warm_up  # [ch20]
from minisgl.engine.kernels import install_kernels  # [ch19]
from minisgl.engine.logprobs import plan_prompt_logprobs, split_prompt_logits  # [ch25]
from minisgl.engine.prefill_graph import plan_prefill_graphs  # [ch23]
from minisgl.engine.ranks import agree_on_limits  # [ch21]
from minisgl.engine.sampler import ForwardOutput, Sampler, StepLogits
from minisgl.engine.startup import (
    Clock,
    EngineShape,
    load_model,
    make_pools,
    pages_from_budget,
    resolve_shape,
)
from minisgl.engine.verify_graph import plan_verify_graphs  # [ch26]
from minisgl.kvcache import layout  # which backend reads the pool, each layer's window  # [ch29]
from minisgl.kvcache.mha_pool import MHAKVCache
from minisgl.quant.kv_scales import use_kv_scales  # [ch28]
from minisgl.utils import to_device

logger = logging.getLogger(__name__)

__all__ = ["Engine", "ForwardOutput", "StepLogits"]


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        clock = Clock()  # the start-up's phases, for one line in the log
        self.jit = jit_log()  # the Triton kernels built from here on  # [ch20]
        self.config = config
        # ---- device, dtypes, context (startup.py)
        self.shape = shape = resolve_shape(config)
        mc = shape.model_config
        self.model_config, self.device, self.dtype = shape.model_config, shape.device, shape.dtype
        self.max_seq_len, self.page_size = shape.max_seq_len, shape.page_size
        # ---- the model
        self.model = model = load_model(shape)
        clock.lap("weights")
        # ---- state pools: KV pages, page table, token pool
        num_pages = config.num_page_override or pages_from_budget(shape)
        self.limits = shape.limits(num_pages)
        self.limits = agree_on_limits(self.limits)  # every rank schedules alike  # [ch21]
        self.num_pages = self.limits.num_pages
        pools = make_pools(shape, self.num_pages)
        self.kv_cache, self.page_table = pools.kv_cache, pools.page_table
        self.token_pool, self.dummy_req = pools.token_pool, pools.dummy_req
        self.state_pool = pools.state_pool  # a hybrid model's recurrent states  # [ch31]
        use_kv_scales(self.model, self.kv_cache)  # the checkpoint's, for an FP8 cache  # [ch28]
        clock.lap("KV pool")
        # ---- attention backend
        self.attn_backend = backend = _create_backend(shape, self.kv_cache, self.page_table)
        self.ctx = Context(self.attn_backend)
        self.ctx.state_pool = self.state_pool  # [ch31]
        set_global_ctx(self.ctx)
        clock.lap("attention backend")
        # >>> ch18 graphs: every shape to capture, then one loop that captures them
        plan = GraphPlan.of(shape, model, backend, self.dummy_req)
        plan.kinds += plan_prefill_graphs(shape, plan, backend)  # [ch23]
        plan.kinds += plan_verify_graphs(shape, plan, backend)  # [ch26]
        self.graph_runner = runner = GraphRunner(model, backend, plan, mc.vocab_size, self.device)
        sampling = sampling_calls(mc.vocab_size, self.device)  # [ch20]
        self.jit.coming = [runner.dry_run, sampling]  # built with the first kernels  # [ch20]
        # the kernels each layer runs: chosen once (measured), installed on the layers  # [ch19]
        self.kernels = install_kernels(shape, model, backend, plan, self.forward_dummy)  # [ch19]
        clock.lap("kernel choice")  # [ch20]
        runner.capture()
        clock.phases.update(runner.capture_seconds)
        # <<< ch18
        # ---- the sampler
        self.sampler = Sampler(mc.vocab_size, self.token_pool)
        if self.device.type == "cuda":  # [ch20]
            clock.last = time.perf_counter()  # [ch20]
            warm_up(sampling, self.device)  # [ch20]
            clock.lap("sampling kernels")  # [ch20]
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
        # >>> ch31 a hybrid model: each request's state slot, zeroed for its first forward
        if self.state_pool is not None:
            self.state_pool.prepare(batch)
        # <<< ch31

    def forward_batch(self, batch: Batch) -> ForwardOutput:
        """One forward and one sampled token per request; each token also goes into the pool.

        A request still in the middle of its prompt (a chunk that is not its last) gets a
        token too, which is meaningless: it is written to the dummy row and ignored.
        """
        return self.sample_logits(self.forward_logits(batch))

    @torch.inference_mode()
    def forward_logits(self, batch: Batch) -> StepLogits:
        """The model's forward, and the sampling inputs as the batch stands now."""
        plan = plan_prompt_logprobs(batch, self.device) if batch.is_prefill else None  # [ch25]
        step = self.sampler.inputs(batch, self.logits(batch))
        step.logits, step.prompt_logprobs = split_prompt_logits(step.logits, plan)  # [ch25]
        return step

    @torch.inference_mode()
    def logits(self, batch: Batch) -> torch.Tensor:
        """The forward alone: the logits of the batch's live rows."""
        set_global_ctx(self.ctx)  # several engines may live in one process (tests do this)
        with self.ctx.forward_batch(batch):
            return self._logits(batch)

    def sample_logits(self, step: StepLogits) -> ForwardOutput:
        """One token per request (sampler.py); the tokens also go into the token pool."""
        return self.sampler.sample(step)

    # >>> ch19
    @torch.inference_mode()
    def forward_dummy(self) -> None:
        """One decode forward of the dummy request alone, one token (its K/V goes to the dummy
        page, as in graph capture): what start-up measures the model's projections by."""
        row = self.dummy_req.table_idx
        batch = Batch([self.dummy_req], "decode")
        batch.input_ids = self.token_pool[row, :1]
        batch.positions = torch.zeros(1, dtype=torch.int32, device=self.device)
        batch.out_loc = self.page_table[row, :1]
        self.attn_backend.prepare_metadata(batch)
        if self.state_pool is not None:  # [ch31]
            self.state_pool.prepare(batch)  # the dummy request's own slot  # [ch31]
        with self.ctx.forward_batch(batch):
            self.model.forward()

    # <<< ch19
    def _logits(self, batch: Batch) -> torch.Tensor:
        # >>> ch18
        if batch.graphed:  # prepare_batch found it a graph
            return self.graph_runner.replay(batch)
        # <<< ch18
        # >>> ch25 rows for every prompt position of some requests, not one per request
        if batch.logit_rows is not None:
            return self.model.forward()
        # <<< ch25
        return self.model.forward()[: batch.num_logit_rows]

    def shutdown(self) -> None:
        self.graph_runner.destroy_cuda_graphs()  # [ch18]
        destroy_distributed()  # after the graphs: they hold the NCCL communicator's calls  # [ch21]
        set_global_ctx(None)


def _create_backend(
    shape: EngineShape, kv_cache: MHAKVCache, page_table: torch.Tensor
) -> BaseAttnBackend:
    cls = select_backend(
        shape.config.attention_backend, shape.device, shape.dtype, shape.page_size,
        fp8_kv=shape.kv_dtype == torch.float8_e4m3fn,  # [ch28]
    )  # fmt: skip
    cls = layout.backend_for(shape, cls)  # one that reads layers of several shapes  # [ch29]
    mc = shape.model_config
    scale = mc.head_dim**-0.5
    scale = (mc.query_pre_attn_scalar or mc.head_dim) ** -0.5  # Gemma's own  # [ch29]
    backend = cls(kv_cache, page_table, scale, shape.num_qo_heads)
    backend.set_windows(layout.windows(shape))  # each pool layer's sliding window  # [ch29]
    return backend
