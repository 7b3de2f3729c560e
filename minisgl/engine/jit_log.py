"""Which Triton kernels this process builds, and when: start-up, or a user's request.

A Triton kernel is built for each new combination of its compile-time constants, launch
options and argument specialisations, the first time one is launched: compiled (seconds),
or loaded from Triton's disk cache (milliseconds) on a machine that has built it before.
A build inside a request is a stall every request in the batch waits out. The engine
starts this log before it loads anything and marks the moment it is ready; what is built
after the mark is a shape start-up did not warm, and `after_ready()` names it. Uses
Triton's runtime hooks (triton.knobs, Triton 3.4 and later); without them the log is
empty.

The same hooks let start-up build its kernels in threads (`build_ahead`): a dry run of the
calls about to be made (the kernel choice's first forward and its candidates, the graphs'
forwards, the sampler's warm-up), in which a kernel not built yet is only noted (neither
built nor launched), then every noted kernel built at once, several threads at a time. The
kernel choice's dry run makes all of them, so one pool builds nearly every kernel start-up
needs; the graphs' and the sampler's own dry runs later find what the choice changed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from minisgl.env import ENV

logger = logging.getLogger(__name__)


@dataclass
class JitLog:
    builds: list[tuple[str, float, float]] = field(default_factory=list)  # (kernel, at, s)
    ready_at: float | None = None
    # calls start-up makes later (the graphs' forwards, the sampler's): the next dry run of
    # `build_ahead` makes them too, so that their kernels build in its pool, all at once
    coming: list[Callable[[], None]] = field(default_factory=list)
    # the kernel choice found every time it needed kept: this model has started on this
    # machine before, so its kernels are in Triton's disk cache, and load as calls meet them
    built_before: bool = False
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
        self.ready_at, self.coming, self.built_before = time.perf_counter(), [], False

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


def build_ahead(dry_run: Callable[[], None], device: torch.device, threads: int = 0) -> float:
    """Build the Triton kernels `dry_run` would build, several threads at a time (`threads`,
    default MINISGL_BUILD_THREADS; fewer than two, or MINISGL_BUILD_AHEAD=0: nothing is run
    or built here, and the real calls build their kernels one after another); returns the
    seconds it took.

    `dry_run` makes the calls that are about to be made for real (the kernel choice's first
    forward and candidates), then the log's `coming` calls (made, and forgotten, here). While
    they run, the first launch of one of minisgl's kernels in a shape not built yet is
    noted and skipped: not built, not launched, so what it should have written stays
    garbage, harmless in a run whose results are thrown away. Then each noted kernel is
    built from what Triton recorded of it (its `preload`) in a pool of threads on the
    engine's GPU: most of a build is LLVM and ptxas, outside Python's lock, so the builds
    overlap, and the real calls find them built. Other libraries' kernels are left alone (an
    autotuner would time a skipped launch as free); they build in the dry run as they would
    have anyway. A kernel that fails to build here is built by its real call, which raises
    if it must."""
    threads = min(threads or ENV.BUILD_THREADS.value, os.cpu_count() or 1)
    if threads < 2 or not ENV.BUILD_AHEAD.value:
        return 0.0
    began = time.perf_counter()
    try:
        from triton import knobs
    except ImportError:  # no Triton, or one without runtime hooks: nothing to build ahead
        return 0.0
    noted: dict[tuple[str, str], tuple[object, str]] = {}
    before = knobs.runtime.jit_cache_hook

    def note(*, key, fn, compile, **kw):
        if str(getattr(fn, "module", "")).startswith("minisgl."):
            noted.setdefault((fn.name, str(key)), (fn.jit_function, compile["specialization_data"]))
            return True  # True: Triton neither builds nor launches it
        return before(key=key, fn=fn, compile=compile, **kw) if before else None

    log = jit_log()
    knobs.runtime.jit_cache_hook = note
    try:
        dry_run()  # (which may drop the coming calls: kernel_choice.py, on a warm machine)
        ours = len(noted)
        calls, log.coming = [c for c in log.coming if c != dry_run], []
        for call in calls:
            call()
    finally:
        knobs.runtime.jit_cache_hook = before
    dry = time.perf_counter() - began
    # the coming calls' kernels first: the graphs' attention kernels are among the slowest
    kernels = list(noted.values())
    todo = kernels[ours:] + kernels[:ours]

    def build(kernel: object, data: str) -> bool:
        try:
            built = kernel.preload(data)  # type: ignore[attr-defined]
            # and what its first launch would do, one kernel at a time: load it onto the GPU
            # and make its launcher (1.4-2.1 s of the graphs' first launches on an H100)
            getattr(built, "_init_handles", lambda: None)()
            return True
        except Exception as e:  # noqa: BLE001 - the real call builds it, or raises
            logger.warning("building a kernel ahead failed (%r); its first call builds it", e)
            return False

    here = torch.cuda.current_device() if device.type == "cuda" else None
    on_gpu = (lambda: torch.cuda.set_device(here)) if here is not None else None
    with ThreadPoolExecutor(min(threads, len(noted) or 1), initializer=on_gpu) as pool:
        built = sum(pool.map(lambda kd: build(*kd), todo))
    spent = time.perf_counter() - began
    logger.info(
        "built %d of %d Triton kernels ahead in %.2fs (the dry run %.2fs)",
        built, len(noted), spent, dry,
    )  # fmt: skip
    return spent


def sampling_calls(vocab_size: int, device: torch.device) -> Callable[[], None]:
    """Calls that build the sampler's kernels for a GPU's logits at start-up rather than in
    the first request that samples: drawn, without and with a top-k threshold, and greedy."""
    from minisgl.engine.sample import BatchSamplingArgs, argmax, sample

    logits = torch.zeros(1, vocab_size, device=device)
    ones = torch.ones(1, dtype=torch.int64, device=device)

    def calls() -> None:
        for top_k in (None, ones):
            temperatures, greedy = logits[:, :1] + 1, ones == 0
            args = BatchSamplingArgs(False, temperatures, greedy, top_k, None, ones, ones, 1)
            sample(logits, args)
        argmax(logits)

    return calls


def warm_up(calls: Callable[[], None], device: torch.device) -> None:
    """Run `calls` once, the kernels they would build built first in threads."""
    build_ahead(calls, device)
    calls()
