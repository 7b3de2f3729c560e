"""The command line of `python -m minisgl`.

Most flags set one field of SchedulerConfig: each is named after its field and takes the
field's default, so a default lives in one place, the config class.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from minisgl.attention import NAMES as ATTENTION_BACKENDS
from minisgl.engine.config import DTYPES, check_model_files
from minisgl.quant.config import KV_CACHE_DTYPES  # [ch28]
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.kv_events import add_kv_events_options, kv_events_config  # [ch27]
from minisgl.server.auth import add_auth_options, api_keys
from minisgl.server.dp_args import Replicas, add_dp_options, check_dp_options  # [ch27]
from minisgl.server.limits import LIMITS_HELP, add_limit_options
from minisgl.server.tp_args import add_tp_options, check_tp_options  # [ch21]
from minisgl.speculative.config import add_speculative_options  # [ch26]

_FIELDS = {f.name: f for f in fields(SchedulerConfig)}
_PREFILL_GRAPHS = ["off", "breakable", "full"]  # [ch23]
_PREFILL_HELP = "prefill CUDA graphs (default: breakable on CUDA, off on CPU)"  # [ch23]
_FP8_HELP = "fp8: FP8 projections, a scale per row (an FP8 checkpoint loads without it)"  # [ch28]
_GRAMMAR_HELP = (
    "seconds a JSON schema may take to compile, off the step loop; beyond: a 400"  # [ch25]
)
_KV_HELP = "fp8_e4m3 (or fp8): keys and values stored in e4m3, twice the tokens"  # [ch28]
_SNAPSHOT_HELP = "a hybrid model's saved states (default: a quarter of the memory)"  # [ch31]
_TEXT_HELP = "/dashboard shows prompts and outputs as text (default: token counts only)"  # [ch30]


@dataclass
class ServerArgs:
    scheduler: SchedulerConfig
    host: str
    port: int
    shell: bool
    served_model_name: str
    log_level: str
    max_queued_requests: int
    max_queued_tokens: int | None  # None: twice the KV cache's tokens
    shutdown_timeout: float
    worker_timeout: float
    node_rank: int = 0  # which machine this is, when the ranks span several  # [ch21]
    replicas: Replicas | None = None  # --dp-size > 1: this process starts them  # [ch27]
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # none: every route is open
    protect_metrics: bool = False
    max_request_bytes: int = 0  # a larger body is refused (413)
    client_timeout: float = 0.0  # to send a request, or to take a byte of the answer
    dashboard: bool = True  # GET /dashboard and its routes  # [ch30]
    dashboard_text: bool = False  # the page shows prompts and outputs as text  # [ch30]


class ConfigParser(argparse.ArgumentParser):
    """An argument parser that knows which of its flags set SchedulerConfig fields."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config_fields: dict[str, str] = {}  # a flag's dest -> the field it sets

    def config_option(self, name: str, flag: str | None = None, **kwargs: Any) -> None:
        """A flag (by default --the-field-name) for the field `name`, with its default."""
        action = self.add_argument(
            flag or "--" + name.replace("_", "-"), default=_FIELDS[name].default, **kwargs
        )
        self.config_fields[action.dest] = name

    def config(self, a: argparse.Namespace) -> dict[str, Any]:
        """The SchedulerConfig fields the command line set, by name."""
        return {name: getattr(a, dest) for dest, name in self.config_fields.items()}


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    p = ConfigParser(
        prog="python -m minisgl",
        description="Serve a model with an OpenAI-compatible API.",
        epilog=LIMITS_HELP,
    )
    p.add_argument("--model", required=True, help="a Hugging Face model folder")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto")
    p.config_option("device", choices=["auto", "cpu", "cuda"])
    add_tp_options(p)  # [ch21]
    add_dp_options(p)  # [ch27]
    add_kv_events_options(p)  # [ch27]
    p.config_option("max_running_req", "--max-running-requests", type=int)
    p.config_option("max_seq_len_override", type=int)
    p.config_option(
        "num_page_override", "--num-pages", type=int, help="KV pages (default: fill memory)"
    )
    p.config_option("page_size", type=int)
    p.config_option(
        "attention_backend",
        "--attn",
        choices=["auto", *ATTENTION_BACKENDS],
        help="attention backend",
    )
    p.config_option("cache_type", "--cache", choices=["radix", "naive"])
    p.config_option("cuda_graph_max_bs", type=int, help="0 disables CUDA graphs")  # [ch18]
    p.config_option("debug_cuda_graph", action="store_true")  # [ch18]
    p.config_option("prefill_graph", choices=_PREFILL_GRAPHS, help=_PREFILL_HELP)  # [ch23]
    add_speculative_options(p)  # [ch26]
    p.config_option("quantization", choices=["fp8"], help=_FP8_HELP)  # [ch28]
    p.config_option("kv_cache_dtype", choices=list(KV_CACHE_DTYPES), help=_KV_HELP)  # [ch28]
    p.config_option("max_prefill_length", type=int)
    p.config_option("window_pages", type=int, help="sliding layers' own pages, 0: none")  # [ch29]
    p.config_option("state_snapshots", type=int, help=_SNAPSHOT_HELP)  # [ch31]
    p.config_option("grammar_compile_timeout", type=float, help=_GRAMMAR_HELP)  # [ch25]
    p.add_argument("--shell", action="store_true", help="chat in the terminal instead of serving")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=1919)
    p.add_argument("--served-model-name", default=None, help="default: the model folder's name")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--no-dashboard", action="store_true", help="no /dashboard routes")  # [ch30]
    p.add_argument("--dashboard-text", action="store_true", help=_TEXT_HELP)  # [ch30]
    add_auth_options(p)
    add_limit_options(p)
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        help="requests held beyond --max-running-requests; more get 503 (default 256)",
    )
    p.add_argument(
        "--max-queued-tokens",
        type=int,
        default=None,
        help="prompt tokens held beyond what the KV cache holds; more get 503 (default: twice"
        " the KV cache's tokens)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="on SIGTERM, seconds running requests may take to finish (default 10)",
    )
    p.add_argument(
        "--worker-timeout",
        type=float,
        default=120.0,
        help="seconds of silence from the workers, with requests open, that mean one is stuck",
    )
    a = p.parse_args(argv)
    if not (Path(a.model) / "config.json").is_file():
        p.error(f"--model: {a.model} is not a model folder (no config.json); try `make models`")
    check_tp_options(p, a)  # [ch21]
    if a.max_request_bytes < 1 or not a.client_timeout > 0:
        p.error("--max-request-bytes takes a number >= 1, --client-timeout one > 0")
    if (
        min(a.max_queued_requests, a.max_queued_tokens or 0, a.shutdown_timeout, a.worker_timeout)
        < 0
    ):
        p.error(
            "--max-queued-requests, --max-queued-tokens, --shutdown-timeout and"
            " --worker-timeout take a number >= 0"
        )
    settings = p.config(a)
    settings["kv_events"] = kv_events_config(p, a)  # [ch27]
    try:
        dtype = None if a.dtype == "auto" else a.dtype  # a name: the scheduler resolves it
        config = SchedulerConfig(model_path=a.model, dtype=dtype, **settings)
        check_model_files(config)
    except ValueError as e:
        p.error(str(e))
    keys = api_keys(p, a)
    name = a.served_model_name or Path(a.model).resolve().name
    return ServerArgs(
        config,
        a.host,
        a.port,
        a.shell,
        name,
        a.log_level.upper(),
        a.max_queued_requests,
        a.max_queued_tokens,
        a.shutdown_timeout,
        a.worker_timeout,
        a.node_rank,  # [ch21]
        check_dp_options(p, a, len(keys)),  # [ch27]
        api_keys=keys,
        protect_metrics=a.protect_metrics,
        max_request_bytes=a.max_request_bytes,
        client_timeout=a.client_timeout,
        dashboard=not a.no_dashboard,  # [ch30]
        dashboard_text=a.dashboard_text,  # [ch30]
    )
