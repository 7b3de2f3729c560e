"""The attention registry, and the FlashInfer backend's plumbing, on CPU.

FlashInfer needs CUDA, so here a stand-in module takes its place: wrappers with FlashInfer's
constructor and `plan()` signatures whose `run()` computes attention in plain torch from
exactly the arrays that were planned (read back from the fixed buffers in CUDA-graph mode,
as the real kernels do). What is tested is ours: the page arithmetic, which wrapper is
planned when, and that a graph replay sees this step's metadata. The kernels themselves
are tested on the GPU (tests/test_gpu.py).
"""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch
from flashinfer_stub import fake_fi, fake_flashinfer, use_fi  # noqa: F401 (a fixture)
from helpers import SMOL, TINY, Driver, all_logits, make_engine, need

from minisgl.attention.fi import FlashInferBackend, paged_kv_layout
from minisgl.attention.registry import BACKENDS, select_backend
from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.core import SamplingParams
from minisgl.engine.config import EngineConfig
from minisgl.utils import cdiv

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


# ---- the registry ---------------------------------------------------------------------------


def test_registry_declares_devices_and_graph_support() -> None:
    assert BACKENDS["torch"].devices == ("cpu", "cuda")
    assert BACKENDS["fi"].devices == ("cuda",) and BACKENDS["fi"].cuda_graphs == ("decode",)
    assert BACKENDS["torch"].cuda_graphs == ()


def test_auto_is_torch_on_cpu() -> None:
    assert select_backend("auto", CPU, torch.float32, 1) is TorchAttnBackend
    assert select_backend("torch", CPU, torch.bfloat16, 16) is TorchAttnBackend


def test_fi_on_cpu_says_it_needs_cuda() -> None:
    with pytest.raises(ValueError, match="FlashInfer needs a CUDA device.*cpu"):
        select_backend("fi", CPU, torch.bfloat16, 1)


def test_unknown_backend_is_refused_with_the_choices() -> None:
    with pytest.raises(
        ValueError, match="unknown attention backend 'flash'; choose from auto, fi, .*torch"
    ):
        select_backend("flash", CPU, torch.float32, 1)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        EngineConfig("x", attention_backend="flash")


def test_auto_on_cuda_prefers_fi_and_says_why_not(monkeypatch, caplog) -> None:
    # Only the declarations are asked; nothing touches a GPU (and no GPU's measured order).
    monkeypatch.setattr("minisgl.attention.registry.gpu_model", lambda device: None)
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer())
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    assert select_backend("auto", CUDA, torch.bfloat16, 16) is FlashInferBackend
    with caplog.at_level(logging.INFO):
        assert select_backend("auto", CUDA, torch.float32, 16) is not FlashInferBackend
    assert "fi passed over: FlashInfer's kernels take bfloat16 or float16" in caplog.text
    with pytest.raises(ValueError, match="cannot run here: FlashInfer's kernels take bfloat16"):
        select_backend("fi", CUDA, torch.float32, 1)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ValueError, match="flashinfer package is not installed"):
        select_backend("fi", CUDA, torch.bfloat16, 1)


# ---- FlashInfer's page arrays ---------------------------------------------------------------


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # tests/conftest.py, without a GPU
KERNEL = [False] + ([True] if torch.cuda.is_available() or INTERPRETED else [])


@pytest.mark.parametrize("kernel", KERNEL)
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_kv_layout_equals_a_plain_loop(page_size: int, kernel: bool) -> None:
    """By torch operations, and by our page-id kernel (in Triton's interpreter on CPU)."""
    gen = torch.Generator().manual_seed(page_size)
    rows, width = 6, 64
    table = torch.zeros(rows, width, dtype=torch.int32)
    pages = torch.randperm(rows * width // page_size, generator=gen)
    for r in range(rows):  # each row: whole pages in a random order, as the allocator gives
        own = pages[r * width // page_size : (r + 1) * width // page_size]
        table[r] = (own[:, None] * page_size + torch.arange(page_size)).flatten()[:width]
    seq_lens, req_rows = [1, 17, 64, page_size, 33, 2], [5, 0, 3, 1, 2, 5]  # row 5 twice: dummy
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    indptr, indices, last = paged_kv_layout(seq_lens, req_rows, table.to(device), page_size, kernel)

    want_indptr, want_indices, want_last = [0], [], []
    for n, r in zip(seq_lens, req_rows):
        count = cdiv(n, page_size)
        want_indices += [int(table[r, p * page_size]) // page_size for p in range(count)]
        want_indptr.append(want_indptr[-1] + count)
        want_last.append(n - (count - 1) * page_size)
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    assert indptr.tolist() == want_indptr
    assert indices.tolist() == want_indices
    assert last.tolist() == want_last
    assert all(1 <= x <= page_size for x in last.tolist())


# ---- the backend against the reference, with a stand-in FlashInfer (flashinfer_stub.py) -----


def forced(engine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Teacher-forced logits: a prefix, an extension over it, then decode steps, batched."""
    driver = Driver(engine)
    reqs = [driver.add(ids, SamplingParams(max_tokens=1), row=i) for i, ids in enumerate(prompts)]
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    for start, end in ((0, 4), (4, 9)):
        for req in reqs:
            req.device_len = end
        for rows, piece in zip(got, all_logits(engine, reqs, "prefill").split(end - start)):
            rows.append(piece)
    while live := [r for r, p in zip(reqs, prompts) if r.device_len <= len(p)]:
        for req, row in zip(live, all_logits(engine, live, "decode")):
            got[req.table_idx].append(row[None])
    return [torch.cat(rows) for rows in got]


@pytest.mark.parametrize("page_size", [1, 16])
def test_fi_backend_equals_torch_backend_under_teacher_forcing(fake_fi, page_size: int) -> None:  # noqa: F811
    path = need(TINY["qwen3"])
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (14, 23, 10)]
    ref = forced(make_engine(path, page_size=page_size), prompts)
    engine = make_engine(path, page_size=page_size)
    use_fi(engine, [])
    for got, want in zip(forced(engine, prompts), ref):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_fi_graph_replay_plans_each_step_through_the_fixed_buffers(fake_fi) -> None:  # noqa: F811
    path = need(SMOL)  # a real model: its next token depends on the context it attends to
    prompts = [[504, 3575, 282, 4649, 314], [1971, 1377, 4159, 3054, 28], [504], [1, 2, 3, 4]]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    eager = make_engine(path, page_size=4)
    use_fi(eager, [])
    want = Driver(eager).generate(prompts, params)

    engine = make_engine(path, page_size=4)
    fi = use_fi(engine, [1, 2, 4])
    runner = engine.graph_runner
    assert sorted(runner.graph_map) == [1, 2, 4] and set(fi.graph_wrappers) == {1, 2, 4}
    plans_at_capture = fi.graph_wrappers[4][None].plans
    assert Driver(engine).generate(prompts, params) == want
    # 4 decode steps of 4 requests: the bs-4 graph's wrapper was planned before each replay,
    # and the eager decode wrapper never ran
    assert fi.graph_wrappers[4][None].plans == plans_at_capture + 4
    assert fi.decode_wrappers[None].plans == 0

    # A replay that skips the plan reads the last step's page arrays: wrong tokens.
    engine = make_engine(path, page_size=4)
    fi = use_fi(engine, [1, 2, 4])
    fi.prepare_for_replay = lambda batch: None  # type: ignore[method-assign]
    assert Driver(engine).generate(prompts, params) != want
