"""Decode CUDA graphs, emulated on CPU: padding, replay, and the static-buffer contract."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, SMOL, need

from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.core import Batch, SamplingParams
from minisgl.engine.graph import GraphCaptureBuffer, default_max_bs, graph_batch_sizes
from minisgl.llm import LLM

PROMPTS = [
    "The capital of France is",
    "List three prime numbers:",
    "def fibonacci(n):",
    "Once upon a time",
    "The quick brown fox",
    "import numpy as np",
    "My favourite colour is",
    "1, 1, 2, 3, 5, 8,",
    "Water boils at",
]
KW = dict(
    dtype=torch.float32,
    device="cpu",
    max_running_req=16,
    num_page_override=512,
    max_seq_len_override=128,
)
TOKENS = 6


pytestmark = pytest.mark.usefixtures("serial")  # from conftest.py


def run(llm: LLM, prompts: list[str]) -> tuple[list[list[int]], list[str]]:
    runner = llm.engine.graph_runner
    log: list[str] = []
    replay = type(runner).replay

    def logged(batch: Batch) -> torch.Tensor:
        log.append(f"{batch.size}->{batch.padded_size}")
        return replay(runner, batch)

    runner.replay = logged  # type: ignore[method-assign]
    try:
        out = llm.generate(
            prompts, SamplingParams(max_tokens=TOKENS, ignore_eos=True), use_tqdm=False
        )
    finally:
        del runner.replay
    return [o["token_ids"] for o in out], log


@pytest.fixture(scope="module")
def eager() -> LLM:
    llm = LLM(str(need(SMOL)), cuda_graph_max_bs=0, **KW)
    yield llm
    llm.shutdown()


def test_the_chapter_example() -> None:
    result = subprocess.run(
        [sys.executable, "examples/ch18_cuda_graph.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = dict(line.split(":", 1) for line in result.stdout.splitlines() if ":" in line)
    assert ast.literal_eval(lines["captured batch sizes"].strip()) == [1, 2, 4]
    log = ast.literal_eval(lines["replay per decode step (live -> padded)"].strip())
    assert log == ["3->4"] * (TOKENS - 1)  # every decode step; the prefill runs eagerly
    assert lines["same output as eager"].strip() == "True"
    assert lines["same output as eager after forgetting positions"].strip() == "False"


def test_batch_size_list() -> None:
    assert graph_batch_sizes(4) == [1, 2, 4]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(24) == [1, 2, 4, 8, 16, 24]
    llm = LLM(str(need(SMOL)), cuda_graph_bs=[3, 5], **KW)
    assert sorted(llm.engine.graph_runner.graph_map) == [3, 5]  # an explicit list wins
    llm.shutdown()


def test_graphs_are_off_on_cpu_by_default() -> None:
    llm = LLM(str(need(SMOL)), **KW)
    assert llm.engine.graph_runner.graph_map == {}
    llm.shutdown()


@pytest.mark.parametrize("page_size", [1, 16])
def test_every_bucket_and_the_eager_fallback(eager: LLM, page_size: int) -> None:
    llm = LLM(
        str(need(SMOL)),
        cuda_graph_max_bs=8,
        page_size=page_size,
        **{**KW, "num_page_override": 512 // page_size},
    )
    assert sorted(llm.engine.graph_runner.graph_map) == [1, 2, 4, 8]
    for n in range(1, 10):
        expected, _ = run(eager, PROMPTS[:n])
        got, log = run(llm, PROMPTS[:n])
        assert got == expected, f"{n} live requests: graph replay differs from eager"
        if n <= 8:
            padded = next(bs for bs in (1, 2, 4, 8) if bs >= n)
            assert log == [f"{n}->{padded}"] * (TOKENS - 1)
        else:
            assert log == []  # larger than the largest graph: eager
    llm.scheduler.check_integrity()
    llm.shutdown()


def test_forgetting_to_copy_an_input_breaks_replay(eager: LLM, monkeypatch) -> None:
    def buggy_copy_from(self: GraphCaptureBuffer, batch: Batch) -> None:
        s = slice(batch.padded_size)
        self.input_ids[s] = batch.input_ids
        self.out_loc[s] = batch.out_loc  # positions forgotten

    monkeypatch.setattr(GraphCaptureBuffer, "copy_from", buggy_copy_from)
    llm = LLM(str(need(SMOL)), cuda_graph_max_bs=4, **KW)
    got, log = run(llm, PROMPTS[:3])
    assert log and got != run(eager, PROMPTS[:3])[0]
    llm.shutdown()


def test_skipping_the_metadata_copy_breaks_replay(eager: LLM, monkeypatch) -> None:
    # Every input is copied, but the attention metadata (lengths, page table) is not.
    monkeypatch.setattr(TorchAttnBackend, "prepare_for_replay", lambda self, batch: None)
    llm = LLM(str(need(SMOL)), cuda_graph_max_bs=4, **KW)
    got, log = run(llm, PROMPTS[:3])
    assert log and got != run(eager, PROMPTS[:3])[0]
    llm.shutdown()


def test_debug_mode_equals_eager(eager: LLM) -> None:
    llm = LLM(str(need(SMOL)), cuda_graph_max_bs=4, debug_cuda_graph=True, **KW)
    got, log = run(llm, PROMPTS[:3])
    assert log == ["3->4"] * (TOKENS - 1)
    assert got == run(eager, PROMPTS[:3])[0]
    llm.shutdown()


def test_default_largest_graph_by_the_card() -> None:
    """256 on a card sold as 80 GB (an H100 has 79.2 GiB, about 78.7 free at start), 160 on
    a 40 GB one."""
    assert default_max_bs(int(78.7 * 2**30)) == 256
    assert default_max_bs(int(139.0 * 2**30)) == 256
    assert default_max_bs(int(39.0 * 2**30)) == 160


def test_the_lm_head_casts_into_the_graphs_buffer(eager: LLM) -> None:
    """A graph's logits are the LM head's cast written straight into the shared buffer (no
    float copy then a copy into it): every captured batch names its view of the buffer, and
    a replay's logits are that view, equal to eager's tokens."""
    llm = LLM(str(need(SMOL)), cuda_graph_max_bs=4, **KW)
    runner, head = llm.engine.graph_runner, llm.engine.model.lm_head
    for graph in runner.graph_map.values():
        assert graph.batch.logits_out.data_ptr() == runner.buffer.logits.data_ptr()
    wrote, project = [], head.project
    head.project = lambda hidden: wrote.append(p := project(hidden)) or p
    got, log = run(llm, PROMPTS[:3])
    assert log == ["3->4"] * (TOKENS - 1)
    into = [t.data_ptr() == runner.buffer.logits.data_ptr() for t in wrote]
    assert into.count(True) == TOKENS - 1 and into.count(False) == 1  # replays; the prefill
    assert got == run(eager, PROMPTS[:3])[0]
    llm.shutdown()
