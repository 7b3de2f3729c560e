"""What a router asks of a worker: what it serves, how loaded it is, and a cache flush.

SGLang's router (the `sglang-router` package, a Rust binary its authors call the model
gateway) was written against SGLang's server, and asks each worker for these paths:

- on registering it, GET /server_info and /model_info (then /get_server_info and
  /get_model_info, their older names): the model's name is `served_model_name`, else the
  last part of `model_path`; without them it lists the model as "unknown", and a client
  that takes the name from the router's /v1/models is refused by us;
- with the power_of_two policy, GET /get_load every few seconds (newer gateways ask
  /v1/loads first): the tokens each worker holds and has queued; the smaller wins;
- when its operator asks, POST /flush_cache on every worker.

vllm-router, a fork of it, asks /health, /flush_cache and vLLM's /reset_prefix_cache (the
same flush here), and reads its power_of_two load as a `load` field of /get_load, an
older shape than the list SGLang's router reads now, which is the one served here.

Every load figure is the scheduler's own last report (SchedulerStats, sent after every
step): its queue and its KV pages. A count kept by the HTTP process would miss what only
the scheduler sees: a preempted request back in the queue, pages a cached prefix holds.

Two Prometheus series are for llm-d's endpoint picker (the Kubernetes inference gateway),
which scores replicas by queue, running requests and KV-cache use:
`minisgl:kv_cache_usage_perc`, a fraction (0-1) despite the name, which is vLLM's, and
`minisgl:cache_config_info`, whose labels carry the page size and count.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import zmq.asyncio
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

import minisgl
from minisgl.engine.limits import EngineLimits
from minisgl.message.backend import FlushCacheMsg, SchedulerStats
from minisgl.message.frontend import RejectedMsg, TokenizeMsg
from minisgl.message.transport import AsyncWriter, address
from minisgl.sampling_params import SamplingParams
from minisgl.server.args import ServerArgs
from minisgl.server.frontend import Frontend
from minisgl.server.generate_api import add_generate_route
from minisgl.server.protocol import APIError
from minisgl.server.tokenize_api import add_tokenize_routes

FLUSH_TIMEOUT_S = 5.0  # for the scheduler's report that it flushed
PROBE_TIMEOUT_S = 30.0  # for /health_generate's one token, on a busy server


@dataclass(frozen=True)
class WorkerCard:
    """Who this worker is, in the words of SGLang's /server_info and /model_info."""

    served_model_name: str
    model_path: str  # absolute: the router loads the tokenizer from it, from its own folder
    model_type: str
    architectures: list[str]
    limits: EngineLimits
    tp_size: int
    max_prefill_tokens: int

    @classmethod
    def of(cls, args: ServerArgs, limits: EngineLimits) -> WorkerCard:
        path = Path(args.scheduler.model_path).resolve()
        hf = json.loads((path / "config.json").read_text())
        return cls(
            args.served_model_name,
            str(path),
            hf.get("model_type", ""),
            list(hf.get("architectures") or []),
            limits,
            args.scheduler.tp_size,
            args.scheduler.max_prefill_length,
        )

    def server_info(self) -> dict[str, Any]:
        lim = self.limits
        return {
            "served_model_name": self.served_model_name,
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "version": minisgl.__version__,
            "dp_size": 1,  # one replica: a router counts the replicas itself
            "tp_size": self.tp_size,
            "page_size": lim.page_size,
            "max_running_requests": lim.max_running_req,
            "max_total_num_tokens": lim.max_kv_tokens,
            "max_prefill_tokens": self.max_prefill_tokens,
            "context_length": lim.max_seq_len,
        }

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "served_model_name": self.served_model_name,
            "is_generation": True,
            "model_type": self.model_type,
            "architectures": self.architectures,
            "max_context_length": self.limits.max_seq_len,
            "vocab_size": self.limits.vocab_size,
        }

    def load(self, s: SchedulerStats) -> dict[str, Any]:
        """SGLang's /get_load entry: `num_tokens`, held and queued, is what routers compare."""
        held = s.kv_pages_in_use * self.limits.page_size
        return {
            "dp_rank": 0,
            "num_reqs": s.running + s.queued,
            "num_waiting_reqs": s.queued,
            "num_tokens": held + s.queued_tokens,
        }

    def loads(self, s: SchedulerStats) -> dict[str, Any]:
        """SGLang's /v1/loads: the same state, named as newer gateways read it."""
        held = s.kv_pages_in_use * self.limits.page_size
        entry = {
            "dp_rank": 0,
            "num_running_reqs": s.running,
            "num_waiting_reqs": s.queued,
            "num_used_tokens": held,
            "num_total_tokens": held + s.queued_tokens,
            "max_total_num_tokens": self.limits.max_kv_tokens,
            "token_usage": round(kv_usage(s), 4),
            "max_running_requests": self.limits.max_running_req,
        }
        now = datetime.now(timezone.utc).isoformat()
        return {"timestamp": now, "version": minisgl.__version__, "loads": [entry]}


def kv_usage(s: SchedulerStats) -> float:
    return s.kv_pages_in_use / s.kv_pages_total if s.kv_pages_total else 0.0


class _CacheCollector(Collector):
    """The two series llm-d's endpoint picker reads beside the queue and running gauges."""

    def __init__(self, frontend: Frontend, card: WorkerCard) -> None:
        self.frontend, self.card = frontend, card

    def collect(self):
        yield GaugeMetricFamily(
            "minisgl:kv_cache_usage_perc",
            "KV pages held by running requests, as a fraction (0-1) of the pool.",
            value=kv_usage(self.frontend.metrics.stats),
        )
        # Both spellings of each label: vLLM's (block_size, num_gpu_blocks), which the picker
        # reads by default, and SGLang's page_size.
        pages, size = str(self.card.limits.num_pages), str(self.card.limits.page_size)
        info = GaugeMetricFamily(
            "minisgl:cache_config_info",
            "The KV cache's shape, in labels; the value is always 1.",
            labels=["block_size", "page_size", "num_gpu_blocks"],
        )
        info.add_metric([size, size, pages], 1)
        yield info


def add_worker_routes(
    app: FastAPI, frontend: Frontend, args: ServerArgs, limits: EngineLimits, ipc_dir: str
) -> None:
    card = WorkerCard.of(args, limits)
    frontend.metrics.registry.register(_CacheCollector(frontend, card))
    to_scheduler = AsyncWriter(zmq.asyncio.Context.instance(), address(ipc_dir, "scheduler"))
    names = (args.served_model_name, args.scheduler.model_path)
    add_generate_route(app, frontend, limits.vocab_size, names)
    add_tokenize_routes(app, args.scheduler.model_path, names, limits.max_seq_len)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return card.server_info()

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return card.model_info()

    @app.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        return [card.load(frontend.metrics.stats)]

    @app.get("/v1/loads")
    async def v1_loads() -> dict[str, Any]:
        return card.loads(frontend.metrics.stats)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    @app.post("/reset_prefix_cache")  # vLLM's name, which vllm-router calls
    async def flush_cache() -> JSONResponse:
        if frontend.refusal is not None:
            raise frontend.refusal
        if card.tp_size > 1:  # the other ranks' caches would keep what rank 0's dropped
            raise APIError(501, "/flush_cache is not supported with --tp-size > 1")
        if frontend.queues:
            message = f"{len(frontend.queues)} requests are running; flush when idle"
            raise APIError(400, message)
        before = frontend.metrics.stats.cache_flushes_total
        await to_scheduler.send(FlushCacheMsg())
        deadline = time.monotonic() + FLUSH_TIMEOUT_S
        while frontend.metrics.stats.cache_flushes_total <= before:
            if time.monotonic() > deadline:
                raise APIError(503, "the scheduler did not flush (a request came in); retry")
            await asyncio.sleep(0.01)
        return JSONResponse({"message": "the prefix cache is empty"})

    @app.get("/health_generate")
    async def health_generate() -> JSONResponse:
        """Healthy means a token comes out: one forward of a one-token prompt."""
        probe = TokenizeMsg(next(frontend.uids), SamplingParams(max_tokens=1), input_ids=[0])
        queue, _ = await frontend.open([probe])
        done = False
        try:
            while not done:
                reply = await asyncio.wait_for(queue.get(), PROBE_TIMEOUT_S)
                if isinstance(reply, APIError):
                    raise reply
                if isinstance(reply, RejectedMsg):
                    raise APIError(503, f"the probe was refused: {reply.message}")
                done = reply.finished
        except asyncio.TimeoutError:
            message = f"no token in {PROBE_TIMEOUT_S:.0f} s"
            raise APIError(503, message, retry_after=5) from None
        finally:
            await frontend.close([probe.uid], abort=not done)
        return JSONResponse({"status": "ok"})
