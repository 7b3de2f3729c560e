"""Each hand-written kernel only where it beats the library, measured on the device at hand.

Our GEMV (kernels/gemv.py) was tuned on one small model's projections. On a larger model's
it ran at half the matmul library's speed, and batch 1 became slower than batch 64. A
kernel's speed depends on the shape, the row count and the GPU, so here it is not assumed:
at start-up on CUDA, after the weights load and before graphs are captured, the engine

  1. runs one decode forward of the dummy request with every projection recorded (its
     weight, whether it is gated, which norm is folded in front of it), so the shapes are
     the ones the model really uses;
  2. times, for each distinct shape and each row count up to MINISGL_GEMV_MAX_ROWS, the
     matmul library's path (with the norm and SiLU-and-mul kernels around it) against
     the GEMV in each of `gemv_candidates`' block shapes;
  3. keeps the GEMV where it took at most MARGIN of the library's time, in a `GemvTable`
     that goes into the kernel plan (layers/kernel_plan.py), which installs each
     projection's row of it on the projection and on the norm that feeds it; and logs the
     table once.

Each candidate is timed as the decode step will run it: replayed from a CUDA graph (no
launch cost), over enough of the model's weights of that shape to overflow the L2 cache
several times (so they come from memory, as in a step), the median of a few replays. Only
the compilation of the candidates' kernels costs real time, and the kernels that win are
the ones the graphs would have compiled anyway. The times are kept on disk for this GPU
and software (kernel_cache.py): the next start reads them and compiles only the winners.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.engine.jit_log import build_ahead, jit_log
from minisgl.engine.kernel_cache import TimesCache
from minisgl.env import ENV
from minisgl.layers.activation import silu_and_mul
from minisgl.layers.kernel_plan import KernelPlan
from minisgl.layers.norm import RMSNorm
from minisgl.layers.triton_ops import (
    GEMV_ROWS,
    Blocks,
    GemvKey,
    GemvTable,
    ProjectionCall,
)
from minisgl.quant import fp8, fp8_choice  # [ch28]

if TYPE_CHECKING:
    from minisgl.engine.graph import GraphPlan

logger = logging.getLogger(__name__)

# (what is timed: the projection and the candidate, a function that runs it) -> seconds per run
Timer = Callable[[str, Callable[[], object]], float]
MARGIN = 0.95  # our kernel is chosen where it takes at most this share of the library's time
L2_OVERFLOW = (
    8  # weights timed per shape: at least this many times the L2 cache, if the model has them
)


@dataclass(frozen=True)
class Probe:
    """What the measurement needs of an engine: its model, where it runs, the most tokens a
    forward takes, and one decode forward of the dummy request (whose projections it records)."""

    model: nn.Module
    device: torch.device
    dtype: torch.dtype
    max_prefill_length: int
    forward_dummy: Callable[[], object]


def choose_kernels(
    engine: Probe, plan: GraphPlan, kernels: KernelPlan, timer: Timer | None = None
) -> None:
    """Measure, choose and log; the choices go into `kernels`, the plan installed next."""
    start, timed = time.perf_counter(), [0, 0.0]  # runs timed, seconds spent timing them
    cache = TimesCache.for_device(engine.device) if timer is None else TimesCache()
    base = timer or time_in_graph

    def timing(label: str, run: Callable[[], object]) -> float:
        began = time.perf_counter()
        seconds = base(label, run)
        timed[0], timed[1] = timed[0] + 1, timed[1] + time.perf_counter() - began
        return seconds

    table = choose_gemv(engine, kernels, timing, cache)
    if table is not None:
        logger.info("GEMV or the matmul library, by measurement (us per call):\n%s", table.report)
        if cache.path is not None:
            done = cache.hits + cache.changed
            logger.info("kernel choice: %d of %d from %s", cache.hits, done, cache.path)
        cache.save()
    # >>> ch22 the fused MoE kernel or the loop over experts, for batches no graph holds
    if engine.device.type == "cuda" or timer is not None:
        from minisgl.layers.fused_moe import choose_moe_path

        choose_moe_path(engine.model, plan.max_tokens, engine.max_prefill_length, timer)
    # <<< ch22
    if engine.device.type == "cuda":
        spent = time.perf_counter() - start
        logger.info("kernel choice took %.2fs (%d runs timed in %.2fs)", spent, *timed)


def choose_gemv(
    engine: Probe, kernels: KernelPlan, timer: Timer, cache: TimesCache | None = None
) -> GemvTable | None:
    """The GEMV table of the engine's model, in `kernels` (and installed with it); None
    where the GEMV cannot run here (CPU, fp32, no triton) or is forced on or off
    (MINISGL_GEMV). Times found in `cache` are not measured again; those measured go into
    it."""
    cache = cache or TimesCache()
    gemv = kernels.gemv
    if gemv is None or gemv.mode != "auto":
        return None
    from minisgl.kernels.gemv import MAX_ROWS  # imports triton: only where the GEMV may run

    rows = [r for r in GEMV_ROWS if r <= min(gemv.max_rows, MAX_ROWS)]
    planned: list[tuple[list[ProjectionCall], list[Job]]] = []
    if engine.device.type == "cuda":  # every kernel start-up needs, built at once in threads

        def dry_run() -> None:  # (jit_log.py: no kernel of ours is built or launched in it)
            engine.forward_dummy()
            planned.append(plan_jobs(engine, kernels, rows))
            runs = first_calls(planned[0][1], cache)
            if not runs:
                # Every time kept: this machine has built these kernels before. The graphs'
                # and the sampler's load from Triton's disk cache as they are met, quicker
                # than through more dry runs.
                log = jit_log()
                log.coming.clear()
                log.built_before = True
            for run in runs:
                run()

        build_ahead(dry_run, engine.device)
    calls, jobs = planned[0] if planned else plan_jobs(engine, kernels, rows)
    if engine.device.type == "cuda":  # (the interpreter of a CPU's tests is not threadsafe)
        build_first(first_calls(jobs, cache), engine.device)  # launched: built where not yet
    table, lines = GemvTable(), []  # each job's winner is kept in the table
    for job in jobs:
        times = measured(cache, job.shape, job.what, job.runs, job.count, timer)
        label = pick(times)
        for i, km in enumerate(job.keys):  # the first is set, the others where not yet
            if i == 0 or km not in table.blocks:
                table.blocks[km] = job.runs[label][0]
        lines.append(f"  {job.what}: {_show(times)} -> {label}")
    gemv.feeds = {id(c.norm_weight): c.key for c in calls if c.norm_weight is not None}
    table.report = "\n".join(lines)
    gemv.table = table
    kernels.install(engine.model)
    return table


def plan_jobs(
    engine: Probe, kernels: KernelPlan, rows: list[int]
) -> tuple[list[ProjectionCall], list[Job]]:
    """The projections of one decode forward (`record_projections`), and for each distinct
    one and row count, the candidates to time."""
    calls = record_projections(engine, kernels)
    names = {  # a tied LM head is named for the module that uses it last, the head
        id(p): name for name, m in engine.model.named_modules() for p in m.parameters(False)
    }
    owners = {id(m.weight): m for m in engine.model.modules() if hasattr(m, "fp8_block")}  # [ch28]
    by_shape: dict[tuple, list[torch.Tensor]] = {}
    for p in engine.model.parameters():
        by_shape.setdefault((p.shape, p.dtype), []).append(p)
    gemv, jobs = kernels.gemv, []  # what is measured, in order
    assert gemv is not None
    for key, call in {c.key: c for c in calls}.items():
        weights = _enough(by_shape[call.weight.shape, call.weight.dtype], engine.device)
        name = _short(names.get(id(call.weight), "?"))
        # >>> ch28 FP8 weights: their own GEMVs against their own matmul, at up to 8 rows
        if call.weight.dtype == fp8.FP8:
            layers = [owners[id(w)] for w in weights]
            for m in fp8_choice.gemv_rows():
                if m > gemv.max_rows:  # no norm is deferred to so many rows
                    key = dataclasses.replace(key, normed=False)
                    call = dataclasses.replace(call, key=key)
                runs = fp8_choice.choice_candidates(call, layers, m, engine.dtype, kernels)
                shape = f"fp8 block {layers[0].fp8_block} {engine.dtype} {_describe(key)} rows {m}"
                keys = [(key, m)]
                if key.normed:  # where the norm is not deferred after all, the same choice
                    keys.append((dataclasses.replace(key, normed=False), m))
                what = f"{name} {_describe(key)} rows {m}"
                jobs.append(Job(what, shape, runs, len(layers), keys))
            continue
        # <<< ch28
        for m in rows:
            runs = candidates(call, weights, m, kernels)
            shape = f"{call.weight.dtype} {_describe(key)} rows {m}"
            what = f"{name} {_describe(key)} rows {m}"
            jobs.append(Job(what, shape, runs, len(weights), [(key, m)]))
    return calls, jobs


def first_calls(jobs: list[Job], cache: TimesCache) -> list[Callable[[], object]]:
    """The GEMV candidates that will be timed (those of shapes the cache has no times for);
    the matmul library's runs stay out."""
    todo = [j for j in jobs if not cache.has(j.shape, j.runs)]
    return [run for j in todo for blocks, run in j.runs.values() if blocks is not None]


@dataclass
class Job:
    """One measurement of the choice: the candidates for one shape and row count, and the
    table's keys that take the winner."""

    what: str  # for the log
    shape: str  # the times cache's entry
    runs: dict[str, tuple[Blocks | None, Callable[[], object]]]
    count: int  # calls each run makes
    keys: list[tuple[GemvKey, int]]


def build_first(runs: list[Callable[[], object]], device: torch.device) -> None:
    """Call each GEMV candidate once, several threads at a time. On a fresh machine its first
    call builds its Triton kernel, about half a second, most of it in LLVM and ptxas, which
    let other threads run; so the builds overlap, and the timing after them finds every
    kernel built. (Shapes whose times are kept on disk are not run at all, and where Triton
    kept the kernels a first call loads them in milliseconds.) The matmul library's runs
    stay out: each thread would get a cuBLAS workspace of its own, memory the KV pool has
    already been sized without. A run that fails is left to the timing, which calls it again
    and raises."""
    threads = min(ENV.BUILD_THREADS.value, len(runs), os.cpu_count() or 1)
    if threads < 2:
        return
    began, cuda = time.perf_counter(), device.type == "cuda"
    on_device = torch.cuda.set_device if cuda else lambda _: None  # the engine's GPU, each
    here = torch.cuda.current_device() if cuda else 0  # (`device` may not name its index)
    with ThreadPoolExecutor(threads, initializer=on_device, initargs=(here,)) as pool:
        for done in [pool.submit(run) for run in runs]:
            try:
                done.result()
            except Exception as e:  # noqa: BLE001 - the timing raises it where it matters
                logger.debug("a candidate's first call failed: %r", e)
    if cuda:
        torch.cuda.synchronize(device)
    spent = time.perf_counter() - began
    logger.info(
        "kernel choice: %d candidates' first calls in %.2fs, %d threads", len(runs), spent, threads
    )


def measured(
    cache: TimesCache,
    shape: str,
    what: str,
    runs: dict[str, tuple[Blocks | None, Callable[[], object]]],
    count: int,
    timer: Timer,
) -> dict[str, float]:
    """Seconds per call of each candidate in `runs` (each runs `count` calls): the cached
    times of `shape`, or timed now and cached."""
    times = cache.get(shape, runs)
    if times is None:
        times = {c: timer(f"{what}: {c}", run) / count for c, (_, run) in runs.items()}
        cache.put(shape, times)
    return times


def pick(times: dict[str, float]) -> str:
    """ "library", or the fastest GEMV candidate where it beats the library by the margin."""
    best = min((label for label in times if label != "library"), key=times.__getitem__)
    return best if times[best] <= MARGIN * times["library"] else "library"


def record_projections(engine: Probe, kernels: KernelPlan) -> list[ProjectionCall]:
    """Every projection of one decode forward of the dummy request, one token (its K/V goes
    to the dummy page, as in graph capture): the forward runs with `kernels` installed in
    recording mode (every projection the GEMV could take is recorded, and runs the matmul
    library; every norm before one is deferred to it), and `kernels` installed after."""
    gemv = kernels.gemv
    assert gemv is not None
    calls: list[ProjectionCall] = []
    recording = dataclasses.replace(kernels, gemv=dataclasses.replace(gemv, recording=calls))
    recording.install(engine.model)
    try:
        engine.forward_dummy()
    finally:
        kernels.install(engine.model)
    return calls


def candidates(
    call: ProjectionCall, weights: list[torch.Tensor], m: int, kernels: KernelPlan
) -> dict[str, tuple[Blocks | None, Callable[[], object]]]:
    """label -> (GEMV blocks or None for the library, a run of it over `weights`). The
    library's path runs the norm in the kernel `kernels` gives it."""
    from minisgl.kernels.gemv import gemv, gemv_candidates

    key, w0 = call.key, call.weight
    x = torch.randn(m, key.k, dtype=w0.dtype, device=w0.device)
    residual, out = torch.randn_like(x), torch.empty_like(x)
    norm = None
    if call.norm_weight is not None:
        norm = RMSNorm(key.k, call.norm_eps)
        norm.weight = torch.nn.Parameter(call.norm_weight, requires_grad=False)
        kernels.install(norm)  # not deferred: into_gemv is off

    def library() -> None:
        for w in weights:  # the layers' own path: a norm kernel, the matmul, SiLU-and-mul
            h = norm.forward_add(x, residual)[0] if norm is not None else x
            y = F.linear(h, w, call.bias)
            if key.gated:
                silu_and_mul(y)

    def ours(blocks: Blocks) -> Callable[[], None]:
        fold = (residual, out, call.norm_weight, call.norm_eps) if norm is not None else None

        def run() -> None:
            for w in weights:
                gemv(x, w, call.bias, blocks=blocks, gated=key.gated, norm=fold)

        return run

    runs: dict[str, tuple[Blocks | None, Callable[[], object]]] = {"library": (None, library)}
    for blocks in gemv_candidates(m, key.n, key.k, key.gated):
        runs[gemv_label(blocks)] = (blocks, ours(blocks))
    return runs


def gemv_label(blocks: Blocks) -> str:
    """How the log and the times cache name a GEMV launch: gemv 1x2x512w1 (rows, features and
    K per program, warps), gemv mma 32x128w2s3 (features, K, warps, stages) on the tensor cores."""
    # >>> ch26
    if type(blocks).__name__ == "MmaBlocks":
        return "gemv mma " + "x".join(map(str, blocks[:2])) + "w{}s{}".format(*blocks[2:])
    # <<< ch26
    return "gemv " + "x".join(map(str, blocks[:3])) + f"w{blocks[3]}"


def time_in_graph(label: str, run: Callable[[], object], reps: int = 5) -> float:
    """Seconds per `run()`, replayed from a CUDA graph: the median of `reps` replays."""
    run()  # compiles, and keeps lazy set-up out of the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    times = []
    for _ in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _enough(weights: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The first weights of a shape whose bytes overflow the L2 cache L2_OVERFLOW times."""
    if device.type != "cuda":
        return weights[:1]
    budget = L2_OVERFLOW * torch.cuda.get_device_properties(device).L2_cache_size
    count, size = 0, 0
    while count < len(weights) and size < budget:
        size += weights[count].nbytes
        count += 1
    return weights[:count]


def _short(name: str) -> str:
    """model.layers.3.self_attn.qkv_proj -> self_attn.qkv_proj"""
    parts = name.split(".")
    return ".".join(parts[3:]) if parts[:2] == ["model", "layers"] else name


def _describe(key: GemvKey) -> str:
    extras = [
        s for s, on in (("gated", key.gated), ("+norm", key.normed), ("+bias", key.bias)) if on
    ]
    return f"[{key.n}x{key.k}{' ' if extras else ''}{' '.join(extras)}]"


def _show(times: dict[str, float]) -> str:
    return " | ".join(f"{label} {t * 1e6:.1f}" for label, t in times.items())
