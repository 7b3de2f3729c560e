"""No kernel chosen blind: the GEMV where the start-up measurement saw it win, `auto` attention
from measured facts, and the start-up's phases in the log.

On the CPU the measurement's timer is injected (it says which candidate wins), and the GEMV
runs for real in Triton's interpreter, allowed for CPU tensors of one row: whatever the table
holds, the tokens equal those of the matmul library alone.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from helpers import TINY, need

from minisgl.attention.fi import FlashInferBackend
from minisgl.attention.registry import BACKENDS, select_backend
from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.attention.triton_backend import TritonAttnBackend
from minisgl.core import SamplingParams
from minisgl.engine.graph import graph_batch_sizes
from minisgl.engine.kernel_choice import choose_gemv, pick
from minisgl.env import ENV
from minisgl.llm import LLM

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.device("cuda")


def test_pick_keeps_the_gemv_only_where_it_wins_by_the_margin() -> None:
    assert pick({"library": 1.0, "gemv a": 0.97, "gemv b": 0.96}) == "library"  # within 5%
    assert pick({"library": 1.0, "gemv a": 0.9, "gemv b": 0.8}) == "gemv b"
    assert pick({"library": 0.5, "gemv a": 0.9}) == "library"


@pytest.mark.skipif(not INTERPRETED or torch.cuda.is_available(), reason="a CPU test")
def test_the_table_decides_and_the_tokens_stay_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """Library wins everywhere: no GEMV, no norm deferred. The GEMV wins but at the LM head:
    every projection but that one in the kernel, norms folded in. It wins at qkv only: the norm
    before gate_up is not deferred, since gate_up does not take it (the plan asks the table)."""
    import minisgl.layers.triton_ops as triton_ops
    from minisgl.kernels.gemv import gemv
    from minisgl.layers import kernel_plan
    from minisgl.layers.kernel_plan import KernelPlan

    llm = LLM(str(need(TINY["llama"])), device="cpu", max_running_req=1,
              num_page_override=64, max_seq_len_override=32)  # fmt: skip
    prompts, params = [[5, 17, 300, 41, 8, 99, 23]], SamplingParams(max_tokens=4, ignore_eos=True)
    want = llm.generate(prompts, params, use_tqdm=False)[0]["token_ids"]  # the library alone

    calls: list[tuple[int, bool, bool]] = []  # (out rows, gated, normed) of each GEMV call

    def counted(x, weight, bias=None, blocks=None, gated=False, norm=None):
        calls.append((weight.size(0), gated, norm is not None))
        return gemv(x, weight, bias, blocks=blocks, gated=gated, norm=norm)

    monkeypatch.setattr(kernel_plan, "gemv_kernel", lambda fused: counted)  # on the CPU too
    monkeypatch.setattr(ENV.GEMV, "value", "auto")
    monkeypatch.setattr(ENV.GEMV_MAX_ROWS, "value", 1)
    engine = llm.engine
    apart = []  # norms deferred and then computed apart: a norm deferred to a library matmul
    compute = triton_ops.NormedInput.compute
    monkeypatch.setattr(triton_ops.NormedInput, "compute", lambda n: apart.append(1) or compute(n))
    timed: list[str] = []

    def timer_where(wins):  # (what is timed) -> does the GEMV win there
        def timer(what: str, run) -> float:
            timed.append(what)
            return (0.5 if wins(what) else 2.0) if "gemv" in what.split(": ")[-1] else 1.0

        return timer

    cases = {
        "library": (lambda what: False, lambda c: False),
        "all but the LM head": (lambda what: "lm_head" not in what, lambda c: c[0] != 49152),
        "qkv only": (lambda what: "qkv_proj" in what, lambda c: not c[1] and c[0] == 128),
    }
    for name, (wins, expected) in cases.items():
        kernels = KernelPlan.at_start(engine.device, engine.dtype, engine.attn_backend)
        table = choose_gemv(engine, kernels, timer_where(wins))  # and installed
        assert table is not None
        calls.clear()
        apart.clear()  # the measurement's own forward computed norms apart
        got = llm.generate(prompts, params, use_tqdm=False)[0]["token_ids"]
        assert got == want, name
        assert all(expected(c) for c in calls) and not apart, (name, calls)
        if name == "library":
            assert not calls
        else:  # the decode steps ran GEMVs, and the norm before qkv (layers 1..) went with it
            assert any(normed for _, _, normed in calls), (name, calls)
    assert any("gate_up_proj" in t and "gated +norm" in t for t in timed)  # the real shapes
    assert any("self_attn.qkv_proj" in t and "+norm" not in t for t in timed)  # layer 0's qkv
    gated = {c for c in calls if c[1]}
    assert not gated  # "qkv only": gate_up stayed with the library, so its norm was not deferred
    llm.shutdown()


def test_blocks_keep_partial_sums_in_registers() -> None:
    pytest.importorskip("triton")
    from minisgl.kernels.gemv import ACC_PER_THREAD, gemv_blocks, gemv_candidates

    # Qwen3-0.6B, 8B and 14B: qkv, o, gate_up (per half), down, LM head
    shapes = [(4096, 1024), (1024, 2048), (3072, 1024), (1024, 3072), (151936, 1024)]
    shapes += [(6144, 4096), (4096, 4096), (12288, 4096), (4096, 12288), (151936, 4096)]
    shapes += [(7168, 5120), (5120, 5120), (17408, 5120), (5120, 17408)]
    for n, k in shapes:
        for m in (1, 2, 4, 8):
            for gated in (False, True):
                for blocks in gemv_candidates(m, n, k, gated):
                    if type(blocks).__name__ == "MmaBlocks":  # [ch26]
                        continue  # [ch26]
                    bm, bn, bk, warps = blocks
                    per_thread = bm * bn * bk * (1 + gated) / (32 * warps)
                    # the eight-row shape at one row is the H200 sweep's best as it is: the
                    # gated one holds twice the usual sums and did not spill there
                    most = 2 * ACC_PER_THREAD if (bm, bn) == (1, 8) else ACC_PER_THREAD
                    assert bm >= m and (per_thread <= most or bk == 128), (n, k, m)
    # The 0.6B's blocks, tuned by the H200 sweep, are kept where they already fit.
    assert gemv_blocks(1, 4096, 1024) == (1, 2, 512, 1)
    assert gemv_blocks(1, 3072, 1024, gated=True) == (1, 2, 512, 1)
    assert gemv_blocks(1, 1024, 3072) == (1, 1, 1024, 1)
    assert gemv_blocks(1, 12288, 4096, gated=True) == (1, 4, 256, 1)  # 8B gate_up: shorter K


def test_default_decode_sizes_bound_the_padding() -> None:
    sizes = graph_batch_sizes(256)
    assert len(sizes) == 19 and sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256

    def padded(bs: int) -> int:
        return next(s for s in sizes if s >= bs)

    assert all(padded(bs) - bs <= 7 for bs in range(1, 65))
    assert all(padded(bs) / bs < 1.25 for bs in range(65, 257))
    assert graph_batch_sizes(512)[-1] == 512 and graph_batch_sizes(100)[-1] == 100


def _all_available(monkeypatch: pytest.MonkeyPatch) -> None:
    for cls in BACKENDS.values():
        monkeypatch.setattr(cls, "unavailable_reason", classmethod(lambda cls, d, t, p: ""))


def test_auto_attention_follows_what_was_measured_on_the_gpu(monkeypatch, caplog) -> None:
    import minisgl.attention.registry as registry

    _all_available(monkeypatch)  # only the declarations are asked; nothing touches a GPU
    monkeypatch.setattr(registry, "gpu_model", lambda device: ("NVIDIA H200", (9, 0)))
    with caplog.at_level(logging.INFO):
        assert select_backend("auto", CUDA, torch.bfloat16, 1) is TritonAttnBackend
    assert "triton (auto; measured on the H200" in caplog.text
    assert "0.96 vs fi 1.08 ms/token" in caplog.text
    monkeypatch.setattr(
        TritonAttnBackend, "unavailable_reason", classmethod(lambda cls, d, t, p: "no triton")
    )
    assert select_backend("auto", CUDA, torch.bfloat16, 1) is FlashInferBackend  # next best
    caplog.clear()
    monkeypatch.setattr(registry, "gpu_model", lambda device: ("NVIDIA A100-SXM4-80GB", (8, 0)))
    with caplog.at_level(logging.INFO):
        assert select_backend("auto", CUDA, torch.bfloat16, 1) is FlashInferBackend
    assert "no benchmark ran on this GPU: the default order" in caplog.text
    assert select_backend("auto", torch.device("cpu"), torch.float32, 1) is TorchAttnBackend


def test_start_up_logs_its_phases(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="minisgl.engine.engine"):
        llm = LLM(str(need(TINY["qwen3"])), device="cpu", max_running_req=2,
                  num_page_override=64, max_seq_len_override=32, cuda_graph_max_bs=2)  # fmt: skip
        llm.shutdown()
    line = next(r.getMessage() for r in caplog.records if "engine ready in" in r.getMessage())
    for phase in ("weights", "KV pool", "attention backend", "kernel choice", "decode graphs (2)"):
        assert f"{phase} " in line, line


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_table_is_measured_and_logged_on_the_gpu(caplog) -> None:
    from minisgl.kernels.gemv import gemv_candidates

    with caplog.at_level(logging.INFO):
        llm = LLM(str(need(TINY["llama"])), dtype=torch.bfloat16, device="cuda",
                  max_running_req=4, cuda_graph_max_bs=4)  # fmt: skip
    layer = llm.engine.model.model.layers[1]
    qkv, norm = layer.self_attn.qkv_proj, layer.input_layernorm
    n, k = qkv.weight.shape
    for rows in range(1, len(norm.gemv_defers)):  # the norm defers where qkv runs the GEMV
        blocks = qkv.gemv_blocks_normed[rows]
        assert norm.gemv_defers[rows] == (blocks is not None)
        assert blocks is None or blocks in gemv_candidates(rows, n, k, False)
    assert "GEMV or the matmul library" in caplog.text and "kernel choice " in caplog.text
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[5, 17, 300]], params, use_tqdm=False)[0]["token_ids"]) == 4
    llm.shutdown()


def test_first_calls_overlap_and_a_failure_is_left_to_the_timing() -> None:
    """build_first calls every run once, several at a time (the builds of a fresh machine
    overlap), and a run that raises does not stop the others: the timing meets it again."""
    import threading
    import time

    from minisgl.engine.kernel_choice import build_first

    began: list[float] = []
    calls: list[str] = []
    lock = threading.Lock()

    def run(name: str, fails: bool = False):
        def call() -> None:
            with lock:
                began.append(time.perf_counter())
            time.sleep(0.3)
            with lock:
                calls.append(name)
            if fails:
                raise RuntimeError("no such kernel")

        return call

    runs = [run("a"), run("b", fails=True), run("c"), run("d")]
    start = time.perf_counter()
    build_first(runs, torch.device("cpu"))
    assert sorted(calls) == ["a", "b", "c", "d"]
    if (os.cpu_count() or 1) >= 2:  # two threads at least: two began together
        assert sorted(began)[1] - start < 0.3 and time.perf_counter() - start < 3 * 0.3
    build_first([run("e")], torch.device("cpu"))  # one alone is left to the timing
    assert "e" not in calls
    ENV.BUILD_THREADS.value, kept = 1, ENV.BUILD_THREADS.value  # MINISGL_BUILD_THREADS=1: none
    try:
        build_first([run("f"), run("g")], torch.device("cpu"))
    finally:
        ENV.BUILD_THREADS.value = kept
    assert not {"f", "g"} & set(calls)


@pytest.mark.skipif(not INTERPRETED or torch.cuda.is_available(), reason="a CPU test")
def test_on_the_gpu_one_dry_run_meets_the_forward_and_every_candidate(monkeypatch) -> None:
    """On a GPU the choice makes its calls once with Triton's builds held back (build_ahead):
    the eager forward, the recorded one, each GEMV candidate's first call; then the same
    candidates are launched (built, if the pool could not) and timed: the table is the one
    a choice without the dry run makes."""
    from minisgl.engine import kernel_choice
    from minisgl.engine.jit_log import jit_log
    from minisgl.engine.kernel_cache import TimesCache
    from minisgl.engine.kernel_choice import Probe
    from minisgl.kernels.gemv import gemv
    from minisgl.layers import kernel_plan
    from minisgl.layers.kernel_plan import KernelPlan

    llm = LLM(str(need(TINY["llama"])), device="cpu", max_running_req=1,
              num_page_override=64, max_seq_len_override=32)  # fmt: skip
    engine = llm.engine
    monkeypatch.setattr(ENV.GEMV, "value", "auto")
    monkeypatch.setattr(ENV.GEMV_MAX_ROWS, "value", 2)
    monkeypatch.setattr(kernel_plan, "gemv_kernel", lambda fused: gemv)  # on the CPU too
    monkeypatch.setattr(kernel_choice, "_enough", lambda weights, device: weights[:1])
    made, forwards, dry = [], [], []  # candidates' first calls; forwards; (is in a dry run)
    candidates = kernel_choice.candidates

    def noted(*args):  # each GEMV candidate's run, recorded instead of run
        def first_call() -> None:
            made.append((first_call, bool(dry)))

        runs = candidates(*args)
        return {c: (b, run if b is None else first_call) for c, (b, run) in runs.items()}

    def dry_run_of(calls, device):
        dry.append(1)
        try:
            calls()
        finally:
            dry.clear()
        return 0.0

    monkeypatch.setattr(kernel_choice, "candidates", noted)
    monkeypatch.setattr(kernel_choice, "build_ahead", dry_run_of)
    launched = []
    monkeypatch.setattr(kernel_choice, "build_first", lambda runs, d: launched.extend(runs))

    def forward_dummy():
        forwards.append(bool(dry))
        return engine.forward_dummy()

    timer = lambda what, run: 0.5 if "rows 1" in what and "gemv" in what else 1.0  # noqa: E731
    reports, kept, log = [], TimesCache(), jit_log()
    coming = log.coming = [lambda: None]  # the graphs' and sampler's calls, in an engine

    def choose(device: torch.device, cache: TimesCache | None = None) -> str:
        probe = Probe(engine.model, device, engine.dtype, 64, forward_dummy)
        kernels = KernelPlan.at_start(engine.device, engine.dtype, engine.attn_backend)
        kernels.install(engine.model)  # the library's (the GEMV interpreted is slow)
        return choose_gemv(probe, kernels, timer, cache).report

    for device in (torch.device("cpu"), CUDA):
        reports.append(choose(device))
        if device.type == "cpu":
            assert forwards == [False] and not made  # no dry run on a CPU
            forwards.clear()
    assert reports[0] == reports[1] and "-> gemv" in reports[1] and "-> library" in reports[1]
    assert forwards == [True, True]  # the eager forward, then the recorded one, in the dry run
    assert made and all(in_dry for _, in_dry in made)  # every candidate once, in the dry run
    assert [run for run, _ in made] == launched  # and the same ones launched after it
    assert log.coming is coming and coming and not log.built_before  # for the pool to make
    choose(torch.device("cpu"), kept)  # the times kept, as on a machine that has run before:
    assert choose(CUDA, kept) == reports[0] and log.coming == []  # nothing to build: the
    assert log.built_before  # graphs and the sampler load their kernels as they meet them
    log.built_before = False
    llm.shutdown()
