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
from minisgl.engine.graph_config import GraphConfig  # [ch18]
from minisgl.engine.hybrid import HybridConfig, check_hybrid  # [ch31]
from minisgl.engine.tp_config import ParallelConfig  # [ch21]
from minisgl.quant.config import QuantConfig, check_checkpoint_quantization  # [ch28]
from minisgl.speculative.config import SpeculativeConfig, check_draft_model  # [ch26]

if TYPE_CHECKING:  # the config is built in the API server's process too, which has no torch
    import torch

DTYPES = ("bfloat16", "float16", "float32")  # the names a dtype may be given by


@dataclass
class EngineConfig(
    GraphConfig,  # [ch18]
    ParallelConfig,  # [ch21]
    SpeculativeConfig,  # the engine sizes its verify graphs by it  # [ch26]
    QuantConfig,  # [ch28]
    HybridConfig,  # the recurrent states' snapshots  # [ch31]
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
    window_pages: int | None = None  # sliding layers' own pages; None: sized at start-up  # [ch29]

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
    check_hybrid(config)  # what a hybrid model (Qwen3.5) cannot do yet  # [ch31]
