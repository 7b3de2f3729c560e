"""The engine's log of Triton kernel builds: its hooks are Triton's, chained, and it tells
builds at start-up from builds after the engine is ready."""

import threading
from types import SimpleNamespace

import pytest
import torch

from minisgl.engine.jit_log import build_ahead, jit_log

knobs = pytest.importorskip("triton.knobs")


def test_hooks_record_builds_and_split_at_ready():
    log = jit_log()
    assert jit_log() is log  # one per process
    miss, built = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    fn = SimpleNamespace(name="_some_kernel")
    before = len(log.builds)
    log.mark_ready()
    assert miss(key=("a",), fn=fn, repr="", compile={}) is None  # None: Triton builds it
    built(key=("a",), fn=fn, repr="", compile={})
    miss(key=("b",), fn=fn)
    built(key=("b",), fn=fn)
    assert [b[0] for b in log.builds[before:]] == ["_some_kernel"] * 2
    assert all(s >= 0 for _, _, s in log.builds[before:])
    assert log.summary().startswith("2 kernel builds") and "_some_kernel x2" in log.summary()
    log.mark_ready()
    assert log.after_ready() == [] and log.summary() == "no kernel built"


class _Kernel:
    """Stands in for a JITFunction: `preload` builds from what Triton recorded."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.built, self.loaded = fail, [], []

    def preload(self, data: str) -> SimpleNamespace:
        if self.fail:
            raise RuntimeError("no")
        self.built.append((threading.current_thread().name, data))
        load = lambda: self.loaded.append(threading.current_thread().name)  # noqa: E731
        return SimpleNamespace(_init_handles=load)  # Triton's compiled kernel


def test_build_ahead_skips_our_unbuilt_kernels_then_builds_each_once_in_threads(caplog):
    jit_log()  # the engine's hooks are installed first; build_ahead chains to them
    before = knobs.runtime.jit_cache_hook
    gemv, broken = _Kernel(), _Kernel(fail=True)
    ours = SimpleNamespace(module="minisgl.kernels.gemv", name="_gemv_kernel", jit_function=gemv)
    bad = SimpleNamespace(module="minisgl.kernels.x", name="_x_kernel", jit_function=broken)
    theirs = SimpleNamespace(module="fla.ops.utils", name="_chunk", jit_function=_Kernel())
    answers = []

    def dry_run() -> None:
        hook = knobs.runtime.jit_cache_hook
        for fn, key in [(ours, "a"), (ours, "b"), (ours, "a"), (bad, "a"), (theirs, "c")]:
            spec = {"specialization_data": f"{fn.name} {key}"}
            answers.append(hook(key=key, fn=fn, repr="", compile=spec, is_manual_warmup=False))

    with caplog.at_level("INFO", logger="minisgl.engine.jit_log"):
        assert build_ahead(dry_run, torch.device("cpu"), threads=2) >= 0
    # ours: noted, neither built nor launched (True); another library's builds as it would
    # have (the log's hook answers None): an autotuner must not time a launch that was skipped
    assert answers == [True, True, True, True, None]
    assert sorted(d for _, d in gemv.built) == ["_gemv_kernel a", "_gemv_kernel b"]
    main = threading.current_thread().name
    assert all(t != main for t, _ in gemv.built)  # in the pool's threads
    assert len(gemv.loaded) == 2 and main not in gemv.loaded  # loaded there too
    assert "built 2 of 3 Triton kernels ahead" in caplog.text  # a failed build is only logged
    assert knobs.runtime.jit_cache_hook is before


def test_build_ahead_puts_the_hook_back_and_does_nothing_on_one_thread():
    before, ran = knobs.runtime.jit_cache_hook, []

    def dry_run() -> None:
        ran.append(1)
        raise ValueError("boom")

    with pytest.raises(ValueError):
        build_ahead(dry_run, torch.device("cpu"), threads=2)
    assert knobs.runtime.jit_cache_hook is before
    assert build_ahead(dry_run, torch.device("cpu"), threads=1) == 0.0 and ran == [1]


def test_graphs_captured_after_a_dry_run_of_every_shape_replay_as_eager(monkeypatch):
    """The capture's dry run prepares and runs every shape once before the capture does it
    again: the graphs must still replay as the eager engine decodes."""
    from helpers import SMOL, need

    from minisgl.core import SamplingParams
    from minisgl.engine.graph import GraphRunner
    from minisgl.llm import LLM

    monkeypatch.setattr(GraphRunner, "_builds_ahead", lambda self: True)  # a CPU's graphs too
    kw = dict(dtype=torch.float32, device="cpu", num_page_override=256, max_seq_len_override=64)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time"]
    outs = []
    for bs in (0, 4):
        llm = LLM(str(need(SMOL)), cuda_graph_max_bs=bs, **kw)
        if bs:
            assert "kernels built ahead" in llm.engine.graph_runner.capture_seconds
        outs.append([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.shutdown()
    assert outs[0] == outs[1]


def test_the_next_dry_run_makes_the_coming_calls_too_and_forgets_them():
    """Start-up's later calls (the graphs' forwards, the sampler's) wait in the log's `coming`:
    the next dry run makes them after its own, once, and their kernels build in its one pool;
    a dry run that drops them (the kernel choice, on a machine that built everything before)
    leaves them to their own dry runs."""
    log, kernel, order = jit_log(), _Kernel(), []
    fn = SimpleNamespace(module="minisgl.kernels.x", name="_x_kernel", jit_function=kernel)

    def launches(key: str):
        def call() -> None:
            order.append(key)
            spec = {"specialization_data": key}
            knobs.runtime.jit_cache_hook(key=key, fn=fn, repr="", compile=spec)

        return call

    graphs, sampler, choice = launches("graphs"), launches("sampler"), launches("choice")
    log.coming = [graphs, sampler, choice]  # the dry run's own calls among them: made once
    build_ahead(choice, torch.device("cpu"), threads=2)
    assert order == ["choice", "graphs", "sampler"] and log.coming == []
    assert sorted(d for _, d in kernel.built) == ["choice", "graphs", "sampler"]
    build_ahead(choice, torch.device("cpu"), threads=2)  # forgotten: not made again
    assert order[3:] == ["choice"]
    log.coming = [graphs]
    build_ahead(lambda: log.coming.clear(), torch.device("cpu"), threads=2)  # dropped
    assert order[4:] == [] and log.coming == []
    log.coming = [graphs]
    log.mark_ready()  # start-up is over: what no dry run made is dropped
    assert log.coming == []


def test_the_capture_builds_ahead_unless_the_model_started_here_before():
    """A GPU's capture makes a dry run first, but not where the kernel choice found every
    time kept (the model's kernels are in Triton's disk cache); an engine ready forgets it."""
    from minisgl.engine.graph import GraphRunner

    log, gpu = jit_log(), SimpleNamespace(stream=object())
    assert GraphRunner._builds_ahead(gpu)
    log.built_before = True
    assert not GraphRunner._builds_ahead(gpu)
    log.mark_ready()
    assert not log.built_before and GraphRunner._builds_ahead(gpu)
    assert not GraphRunner._builds_ahead(SimpleNamespace(stream=None))  # a CPU's: emulated
