"""The shapes captured by default, chosen for a short start-up: prefill buckets from 64 to
2,048 tokens (below, a prefill is launch-bound; above, graphs gain nothing), and the time
each kind of graph took, in the engine's start-up line."""

from __future__ import annotations

import logging

from helpers import TINY, need

from minisgl.llm import LLM


def test_default_prefill_buckets_and_the_start_up_line(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="minisgl.engine.engine"):
        llm = LLM(str(need(TINY["qwen3"])), device="cpu", max_running_req=4,
                  num_page_override=64, max_seq_len_override=2048, cuda_graph_max_bs=4,
                  prefill_graph="breakable")  # fmt: skip
        buckets = sorted(t for _, t in llm.engine.graph_runner.graphs("prefill"))
        small = LLM(str(need(TINY["qwen3"])), device="cpu", max_running_req=4,
                    num_page_override=64, max_seq_len_override=64, max_prefill_length=48,
                    prefill_graph="breakable")  # fmt: skip
        assert sorted(t for _, t in small.engine.graph_runner.graphs("prefill")) == [48]
        small.shutdown()
        llm.shutdown()
    assert buckets == [64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    line = next(r.getMessage() for r in caplog.records if "engine ready in" in r.getMessage())
    assert "prefill graphs (10) " in line and "decode graphs (3) " in line, line
