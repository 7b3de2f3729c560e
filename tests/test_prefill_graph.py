"""Prefill graphs, emulated on CPU: breakable and full, against eager and Hugging Face."""

from __future__ import annotations

import pytest
import torch
from helpers import SMOL, hf_greedy, need, tokenizer

from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.core import Batch, SamplingParams
from minisgl.engine.breakable import BoundaryBuffers
from minisgl.engine.config import EngineConfig
from minisgl.engine.prefill_graph import prefill_slots, prefill_token_buckets
from minisgl.llm import LLM

# Two families of prompts sharing long prefixes (later ones hit the radix cache),
# some long enough to be chunked by the 32-token prefill budget; requests end at different
# steps, so new prompts are prefilled between the decode steps of others.
STEM_A = "The history of the city begins with a small settlement on the river, where"
STEM_B = "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n"
PROMPTS = [
    "Hi",
    "List three prime numbers:",
    "Water boils at",
    "1, 1, 2, 3, 5, 8,",
    STEM_A + " traders met",
    STEM_B + "    mid = len(items) // 2",
    STEM_A + " fishermen built boats and the first bridge was made of wood, then of stone",
    STEM_B + "    left, right = [], []",
]
TOKENS = [5, 3, 6, 3, 5, 3, 4, 6]
KW = dict(
    dtype=torch.float32,
    device="cpu",
    max_running_req=4,  # also the slots of every prefill graph here
    num_page_override=1024,
    max_seq_len_override=160,
    max_prefill_length=32,
)
BUCKETS = [8, 16, 32]


pytestmark = pytest.mark.usefixtures("serial")  # from conftest.py


def run(llm: LLM) -> tuple[list[list[int]], list[dict]]:
    """Tokens of the prompts, and one record per prefill forward: whether it replayed a
    graph, and what it held."""
    engine = llm.engine
    log: list[dict] = []
    logits = type(engine)._logits

    def logged(self, batch: Batch) -> torch.Tensor:
        if batch.is_prefill:
            log.append(
                dict(
                    graph=self.graph_runner.can_use_cuda_graph(batch),
                    reqs=batch.size,
                    tokens=sum(r.extend_len for r in batch.reqs),
                    padded=(batch.padded_size, sum(r.extend_len for r in batch.padded_reqs)),
                    cached=any(r.cached_len > 0 for r in batch.reqs),
                    chunk=any(r.mid_prompt for r in batch.reqs),
                )
            )
        return logits(self, batch)

    engine._logits = logged.__get__(engine)  # type: ignore[method-assign]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in TOKENS]
    try:
        out = [o["token_ids"] for o in llm.generate(PROMPTS, params, False)]
    finally:
        del engine._logits
    return out, log


@pytest.fixture(scope="module")
def eager() -> list[list[int]]:
    llm = LLM(str(need(SMOL)), **KW)
    assert llm.engine.graph_runner.graphs("prefill") == {}  # off on CPU unless asked for
    tokens, log = run(llm)
    llm.shutdown()
    assert not any(entry["graph"] for entry in log)
    return tokens


def graphs(mode: str) -> LLM:
    return LLM(
        str(need(SMOL)), prefill_graph=mode, prefill_graph_tokens=BUCKETS, cuda_graph_max_bs=4, **KW
    )


@pytest.mark.parametrize("mode", ["breakable", "full"])
def test_prefill_graphs_equal_eager_and_hf(eager: list[list[int]], mode: str) -> None:
    llm = graphs(mode)
    runner = llm.engine.graph_runner
    assert sorted(runner.graphs("prefill")) == [(4, 8), (4, 16), (4, 32)]
    got, log = run(llm)
    llm.scheduler.check_integrity()
    llm.shutdown()
    assert got == eager
    # What the run went through: several buckets, padding, cached prefixes and chunks in
    # graphs; and the eager fallback for more requests than slots.
    replayed = [e for e in log if e["graph"]]
    assert len({e["padded"] for e in replayed}) >= 2
    assert any(e["padded"][1] > e["tokens"] for e in replayed)
    assert any(e["cached"] for e in replayed) and any(e["chunk"] for e in replayed)
    assert any(e["reqs"] + 1 > 4 and e["tokens"] not in BUCKETS for e in log if not e["graph"])
    # Hugging Face, one prompt at a time, greedy.
    tok = tokenizer(SMOL)
    for i in (0, 4, 6):
        want = hf_greedy(SMOL, tok(PROMPTS[i])["input_ids"], TOKENS[i])
        assert got[i] == want, PROMPTS[i]


def test_a_replay_that_skips_the_sentinel_rewrite_differs(eager, monkeypatch) -> None:
    replay = TorchAttnBackend.prepare_for_replay

    def stale_sentinels(self: TorchAttnBackend, batch: Batch) -> None:
        if not batch.is_prefill:
            return replay(self, batch)
        # Only the live requests and the padding request are written; the slots after them
        # keep whatever an earlier prefill of this shape left there.
        live, md, cap = batch.size + 1, batch.attn_metadata, self.capture
        cap.cu_seqlens_q[: live + 1].copy_(md.cu_seqlens_q[: live + 1])
        cap.seq_lens[:live].copy_(md.cache_seqlens[:live])
        cap.page_table[:live, : md.page_table.size(1)].copy_(md.page_table[:live])

    monkeypatch.setattr(TorchAttnBackend, "prepare_for_replay", stale_sentinels)
    llm = graphs("full")
    try:
        got, log = run(llm)
        assert any(e["graph"] for e in log) and got != eager
    except RuntimeError as e:  # or a stale slot's offsets no longer make sense at all
        assert "inconsistent" in str(e)
    llm.shutdown()


def test_a_replay_that_skips_a_boundary_copy_differs(eager, monkeypatch) -> None:
    def no_result_copy(self: BoundaryBuffers, name: str, value: torch.Tensor) -> torch.Tensor:
        if name.endswith(":out"):  # the eager part's result never reaches the next segment
            return self.view(name, value)
        return self.view(name, value).copy_(value)

    monkeypatch.setattr(BoundaryBuffers, "stage", no_result_copy)
    llm = graphs("breakable")
    got, log = run(llm)
    llm.shutdown()
    assert any(e["graph"] for e in log) and got != eager


def test_more_tokens_than_the_largest_bucket_run_eagerly() -> None:
    llm = graphs("full")
    runner, dummy = llm.engine.graph_runner, llm.engine.dummy_req
    for tokens, graph in ((32, True), (33, False), (7, True)):
        req = runner.kinds["prefill"].filler(tokens)  # any request of that many new tokens
        batch = Batch([req], "prefill")
        runner.pad_batch(batch)
        assert runner.can_use_cuda_graph(batch) == graph
        assert batch.padded_size == (4 if graph else 1) and dummy.table_idx == req.table_idx
    llm.shutdown()


def test_buckets_slots_and_settings() -> None:
    assert prefill_token_buckets(8192) == [
        16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192,
    ]  # fmt: skip
    assert prefill_token_buckets(100) == [16, 32, 64, 100]
    assert prefill_token_buckets(8) == [8]
    # Every bucket pads by less than half: the next one is at most 2x, from 128 on 1.5x.
    buckets = prefill_token_buckets(1 << 16)
    assert all(b / a <= 1.5 for a, b in zip(buckets[3:], buckets[4:]))
    assert prefill_slots(16, 256) == 16 and prefill_slots(8192, 256) == 256
    assert prefill_slots(1024, 256) == 64 and prefill_slots(8, 4) == 4
    with pytest.raises(ValueError, match="prefill_graph must be"):
        EngineConfig("m", prefill_graph="always")
    with pytest.raises(ValueError, match="token counts must be >= 1"):
        EngineConfig("m", prefill_graph_tokens=[16, 0])
