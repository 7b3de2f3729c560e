"""EngineConfig: what to load, where, and how big the KV cache may be.

Later chapters' settings join it as one small config per concern (graphs, ranks, speculation,
quantisation), each checking its own fields; they are keyword-only, so the engine's own
fields keep their places. A config checks its values when it is built and reads no file:
what can only be checked against the model folders is `check_model_files`, run before
anything is loaded (by the command line, the offline API and the engine's start-up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from minisgl.attention import NAMES as ATTENTION_BACKENDS
from minisgl.quant.config import QuantConfig, check_checkpoint_quantization  # [ch28]
from minisgl.speculative.config import SpeculativeConfig, check_draft_model  # [ch26]

if TYPE_CHECKING:  # the config is built in the API server's process too, which has no torch
    import torch

DTYPES = ("bfloat16", "float16", "float32")  # the names a dtype may be given by


# >>> ch18 graphs: decode CUDA graphs (ch18) and prefill graphs (ch23)
@dataclass(kw_only=True)
class GraphConfig:
    # Largest captured decode batch; None: from GPU memory on CUDA, off on CPU; 0: off.
    cuda_graph_max_bs: int | None = None
    cuda_graph_bs: list[int] | None = None  # an explicit list of batch sizes wins
    debug_cuda_graph: bool = False  # run eagerly through the graph runner's buffers
    # >>> ch23 prefill graphs: "off", "breakable", "full"; None: breakable on CUDA, off on CPU
    prefill_graph: str | None = None
    prefill_graph_max_tokens: int | None = None  # top bucket; None: min(max_prefill_length, 2048)
    prefill_graph_tokens: list[int] | None = None  # an explicit list of token buckets wins
    # <<< ch23

    def check_graphs(self) -> None:
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 0:
            raise ValueError(f"cuda_graph_max_bs must be >= 0, got {self.cuda_graph_max_bs}")
        if self.cuda_graph_bs is not None and min(self.cuda_graph_bs, default=1) < 1:
            raise ValueError(f"cuda_graph_bs must hold sizes >= 1, got {self.cuda_graph_bs}")
        # >>> ch23
        if self.prefill_graph not in (None, "off", "breakable", "full"):
            raise ValueError(
                f"prefill_graph must be off, breakable or full, got {self.prefill_graph!r}"
            )
        for t in self.prefill_graph_tokens or [self.prefill_graph_max_tokens or 1]:
            if t < 1:
                raise ValueError(f"prefill graph token counts must be >= 1, got {t}")
        # <<< ch23


# <<< ch18
# >>> ch21 tensor parallelism
@dataclass(kw_only=True)
class ParallelConfig:
    tp_size: int = 1
    tp_rank: int = 0  # this process's rank; whoever starts the ranks sets it
    nnodes: int = 1  # machines the ranks are spread over, tp_size // nnodes ranks on each
    dist_init_addr: str | None = None  # host:port where the ranks meet: rank 0's machine

    def check_parallel(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is not a rank of tp_size {self.tp_size}")
        if self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ValueError(f"tp_size {self.tp_size} cannot be spread over {self.nnodes} nodes")


# <<< ch21
@dataclass
class EngineConfig(
    GraphConfig,  # [ch18]
    ParallelConfig,  # [ch21]
    SpeculativeConfig,  # the engine sizes its verify graphs by it  # [ch26]
    QuantConfig,  # [ch28]
):
    model_path: str
    # A torch dtype or its name; None: fp32 on CPU, on GPU the checkpoint's (else bf16).
    dtype: torch.dtype | str | None = None
    device: str = "auto"  # "auto" picks CUDA when present
    max_running_req: int = 256
    num_page_override: int | None = None  # KV pages; None sizes the pool from a memory budget
    max_seq_len_override: int | None = None  # None: the model's context length
    page_size: int = 1
    attention_backend: str = "auto"
    max_prefill_length: int = 8192  # the most new tokens of one forward: longer prompts are chunked

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str) and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.max_running_req < 1:
            raise ValueError(f"max_running_req must be >= 1, got {self.max_running_req}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.num_page_override is not None and self.num_page_override < 1:
            raise ValueError(f"num_page_override must be >= 1, got {self.num_page_override}")
        if self.max_seq_len_override is not None and self.max_seq_len_override < 2:
            raise ValueError(f"max_seq_len_override must be >= 2, got {self.max_seq_len_override}")
        if self.max_prefill_length < 1:
            raise ValueError(f"max_prefill_length must be >= 1, got {self.max_prefill_length}")
        if self.attention_backend not in ("auto", *ATTENTION_BACKENDS):
            raise ValueError(
                f"unknown attention backend {self.attention_backend!r}; "
                f"choose from auto, {', '.join(ATTENTION_BACKENDS)}"
            )
        self.check_graphs()  # [ch18]
        self.check_parallel()  # [ch21]
        self.check_speculative(self.tp_size)  # [ch26]
        self.check_quantization(self.attention_backend)  # [ch28]


def check_model_files(config: EngineConfig) -> None:
    """Raise ValueError where the model folders cannot take the config: before any weight is
    read or any process started."""
    check_checkpoint_quantization(config.quantization, config.model_path)  # [ch28]
    check_draft_model(config)  # [ch26]
