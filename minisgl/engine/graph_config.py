"""The graph settings of the engine's config, kept apart from graph.py, which needs torch:
the config is built in the API server's process too, which has none."""

from __future__ import annotations

from dataclasses import dataclass


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
