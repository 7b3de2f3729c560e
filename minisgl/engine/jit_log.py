"""Which Triton kernels this process builds, and when: start-up, or a user's request.

A Triton kernel is built for each new combination of its compile-time constants, launch
options and argument specialisations, the first time one is launched: compiled (seconds),
or loaded from Triton's disk cache (milliseconds) on a machine that has built it before.
A build inside a request is a stall every request in the batch waits out. The engine
starts this log before it loads anything and marks the moment it is ready; what is built
after the mark is a shape start-up did not warm, and `after_ready()` names it. Uses
Triton's runtime hooks (triton.knobs, Triton 3.4 and later); without them the log is
empty.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class JitLog:
    builds: list[tuple[str, float, float]] = field(default_factory=list)  # (kernel, at, s)
    ready_at: float | None = None
    _began: dict[object, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _on_miss(self, *, key, fn, **_kw) -> None:
        with self._lock:
            self._began[(fn.name, str(key))] = time.perf_counter()

    def _on_built(self, *, key, fn, **_kw) -> None:
        now = time.perf_counter()
        with self._lock:
            began = self._began.pop((fn.name, str(key)), now)
            self.builds.append((fn.name, now, now - began))

    def mark_ready(self) -> None:
        self.ready_at = time.perf_counter()

    def after_ready(self) -> list[tuple[str, float, float]]:
        """The builds since `mark_ready` (all of them if it was never called)."""
        return [b for b in self.builds if self.ready_at is None or b[1] >= self.ready_at]

    def summary(self, builds: list[tuple[str, float, float]] | None = None) -> str:
        """'N kernels, S s: name xK, ...' for the given builds (default: after ready)."""
        builds = self.after_ready() if builds is None else builds
        if not builds:
            return "no kernel built"
        names = Counter(name for name, _, _ in builds)
        total = sum(s for _, _, s in builds)
        listed = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in names.most_common())
        return f"{len(builds)} kernel builds, {total:.2f} s: {listed}"


_log: JitLog | None = None


def jit_log() -> JitLog:
    """The process's log, its hooks installed on first use (chained after any others)."""
    global _log
    if _log is not None:
        return _log
    _log = JitLog()
    try:
        from triton import knobs
    except ImportError:  # no Triton, or one without runtime hooks
        return _log
    runtime = knobs.runtime
    before_miss, before_built = runtime.jit_cache_hook, runtime.jit_post_compile_hook

    def on_miss(**kw):
        _log._on_miss(**kw)
        return before_miss(**kw) if before_miss else None  # True would skip the build

    def on_built(**kw):
        _log._on_built(**kw)
        return before_built(**kw) if before_built else None

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = on_miss, on_built
    return _log
