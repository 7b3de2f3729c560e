"""The command line of `python -m minisgl`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from minisgl.attention.registry import backend_names
from minisgl.models.config import ModelConfig  # [ch21]
from minisgl.scheduler.config import SchedulerConfig

_DTYPES = {
    "auto": None,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


@dataclass
class ServerArgs:
    scheduler: SchedulerConfig
    host: str
    port: int
    shell: bool
    served_model_name: str
    log_level: str
    node_rank: int = 0  # which machine this is, when the ranks span several  # [ch21]


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    p = argparse.ArgumentParser(
        prog="python -m minisgl", description="Serve a model with an OpenAI-compatible API."
    )
    p.add_argument("--model", required=True, help="a Hugging Face model folder")
    p.add_argument("--dtype", choices=list(_DTYPES), default="auto")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    # >>> ch21 tensor parallelism; ranks on several machines: each runs this with its --node-rank
    p.add_argument("--tp-size", type=int, default=1, help="ranks (GPUs) the model is cut over")
    p.add_argument("--nnodes", type=int, default=1, help="machines the --tp-size ranks span")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's place, from 0")
    p.add_argument("--dist-init-addr", default=None, help="host:port of node 0 for the ranks")
    # <<< ch21
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--max-seq-len-override", type=int, default=None)
    p.add_argument("--num-pages", type=int, default=None, help="KV pages (default: fill memory)")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--attn", choices=backend_names(), default="auto", help="attention backend")
    p.add_argument("--cache", choices=["radix", "naive"], default="radix")
    # >>> ch18
    p.add_argument("--cuda-graph-max-bs", type=int, default=None, help="0 disables CUDA graphs")
    p.add_argument("--debug-cuda-graph", action="store_true")
    # <<< ch18
    # >>> ch23
    p.add_argument(
        "--prefill-graph",
        choices=["off", "breakable", "full"],
        default=None,
        help="prefill CUDA graphs (default: breakable on CUDA, off on CPU)",
    )
    # <<< ch23
    p.add_argument("--max-prefill-length", type=int, default=8192)
    p.add_argument("--shell", action="store_true", help="chat in the terminal instead of serving")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=1919)
    p.add_argument("--served-model-name", default=None, help="default: the model folder's name")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    if not (Path(a.model) / "config.json").is_file():
        p.error(f"--model: {a.model} is not a model folder (no config.json); try `make models`")
    # >>> ch21
    if not 0 <= a.node_rank < a.nnodes:
        p.error(f"--node-rank {a.node_rank} is not in [0, --nnodes {a.nnodes})")
    if a.nnodes > 1 and a.dist_init_addr is None:
        p.error("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, on every node)")
    try:
        ModelConfig.from_path(a.model).check_tp(a.tp_size)
    except ValueError as e:
        p.error(f"--tp-size: {e}")
    # <<< ch21
    try:
        config = SchedulerConfig(
            model_path=a.model,
            dtype=_DTYPES[a.dtype],
            device=a.device,
            max_running_req=a.max_running_requests,
            num_page_override=a.num_pages,
            max_seq_len_override=a.max_seq_len_override,
            page_size=a.page_size,
            attention_backend=a.attn,
            cuda_graph_max_bs=a.cuda_graph_max_bs,  # [ch18]
            debug_cuda_graph=a.debug_cuda_graph,  # [ch18]
            prefill_graph=a.prefill_graph,  # [ch23]
            max_prefill_length=a.max_prefill_length,
            cache_type=a.cache,
            # >>> ch21
            tp_size=a.tp_size,
            nnodes=a.nnodes,
            dist_init_addr=a.dist_init_addr,
            # <<< ch21
        )
    except ValueError as e:
        p.error(str(e))
    name = a.served_model_name or Path(a.model).resolve().name
    return ServerArgs(
        config,
        a.host,
        a.port,
        a.shell,
        name,
        a.log_level.upper(),
        a.node_rank,  # [ch21]
    )
