"""The command line of `python -m minisgl`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from minisgl.attention.registry import backend_names
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


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    p = argparse.ArgumentParser(
        prog="python -m minisgl", description="Serve a model with an OpenAI-compatible API."
    )
    p.add_argument("--model", required=True, help="a Hugging Face model folder")
    p.add_argument("--dtype", choices=list(_DTYPES), default="auto")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    # Kept in the public command line, though with one scheduler only 1 is accepted (below).
    p.add_argument("--tp-size", type=int, default=1)
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
    p.add_argument("--max-prefill-length", type=int, default=8192)
    p.add_argument("--shell", action="store_true", help="chat in the terminal instead of serving")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=1919)
    p.add_argument("--served-model-name", default=None, help="default: the model folder's name")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    if a.tp_size != 1:
        p.error("--tp-size: only 1 is supported")
    if not (Path(a.model) / "config.json").is_file():
        p.error(f"--model: {a.model} is not a model folder (no config.json); try `make models`")
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
            max_prefill_length=a.max_prefill_length,
            cache_type=a.cache,
        )
    except ValueError as e:
        p.error(str(e))
    name = a.served_model_name or Path(a.model).resolve().name
    return ServerArgs(config, a.host, a.port, a.shell, name, a.log_level.upper())
