"""The engine's log of Triton kernel builds: its hooks are Triton's, chained, and it tells
builds at start-up from builds after the engine is ready."""

from types import SimpleNamespace

import pytest

from minisgl.engine.jit_log import jit_log

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
