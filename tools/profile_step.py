"""Where a decode step's time goes: on the device and on the host, three ways.

    python tools/profile_step.py --model /root/q06                     # batch 1, graphs on
    python tools/profile_step.py --model /root/q8 --tp-size 2 --trace q8_tp2.json
    python tools/profile_step.py --model models/SmolLM2-135M-Instruct --device cpu --steps 8
    python tools/profile_step.py --model /root/q06 --phases            # the host's part
    python tools/profile_step.py --model models/tiny-llama --device cpu --phases \\
        --overlap off --cuda-graph-max-bs 0 --batch-size 16 --steps 128 --repeat 5
    python tools/profile_step.py --model models/tiny-llama --device cpu --cprofile --top 25

The engine runs as the server runs it (overlap scheduling where the server has it, CUDA
graphs up to the batch size; `--overlap` and `--cuda-graph-max-bs` change that). Every
mode waits until each request of the batch is decoding and measures `--steps` scheduler
steps from the third such step on, so neither the prefill nor start-up is in the figures.

The default is a torch-profiler trace of those steps. It prints, per decode step:

- wall time, the device's kernel time and their ratio (busy): below 100% the device
  waited for the host;
- kernels and graph replays: a graph replay launches hundreds of kernels for the price of
  one call on the host;
- communication kernels (NCCL all-reduce / all-gather) with tensor parallelism, and their
  share of the device time;
- the weights one rank reads per step against the time the memory needs to move them
  (`--bandwidth`, GB/s): at batch 1 a step can be no faster than that floor;

then the kernels and the host operations that take the most time. `--trace` writes the
timeline for chrome://tracing or Perfetto. With `--tp-size N` the figures are rank 0's:
its communication kernels include the time spent waiting for the other ranks.

`--phases` runs without the profiler (which slows the host) and times the host's part of
each step by phase: scheduling, `prepare_batch`, the forward's launch (of which the graph
replay and the model's forward), sampling (of which its kernels), and processing results,
of which waiting for the device; the offline loop is the rest of the interval between
steps. Each on two clocks: wall, and this thread's CPU time, which another busy process
on the machine inflates far less. The host's own work is the interval less the device's:
on a GPU, the time the host waits for it; on a CPU, where the forward and the sampling
kernels run on this thread, their time. On a GPU, CUDA events around each step's device
work say how busy the device was. A first run (the warm-up) counts per step the torch
calls (on a GPU, most of them a kernel launch) and the engine's copies to and from the
device, outside the model's forward; `--repeat N` times N runs and keeps the one with
the least host CPU time.

`--cprofile` replaces the model's forward by fixed logits, so that it costs nothing, and
lists the `--top` Python functions that take the host's time over the steps (cProfile,
by time spent in the function itself).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch
from common import add_engine_args, engine_kwargs, parse, sync, weight_bytes
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile


def prompts(llm: Any, args: argparse.Namespace) -> list[list[int]]:
    """The batch: random token ids, the same on every call (the seed is fixed)."""
    rng = random.Random(args.seed)
    vocab = llm.engine.model_config.vocab_size
    return [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.batch_size)]


def steady(llm: Any, args: argparse.Namespace) -> bool:
    sched = llm.scheduler
    return not sched.prefill.has_work and len(sched.decode.running) == args.batch_size


UNSET = object()


@contextmanager
def patched(patches: dict[tuple[object, str], Any]) -> Iterator[None]:
    """Set attributes for the duration: instance attributes shadow methods and go again
    afterwards; module globals get their old value back."""
    old = {key: vars(key[0]).get(key[1], UNSET) for key in patches}
    for (obj, name), value in patches.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for (obj, name), value in old.items():
            if value is UNSET:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


# ---- the torch profiler ---------------------------------------------------------------


def is_comm(name: str) -> bool:
    name = name.lower()
    return "nccl" in name or "allreduce" in name or "all_reduce" in name or "allgather" in name


def profile_steps(llm: Any, args: argparse.Namespace) -> tuple[profile, float, int]:
    """Profile `args.steps` steady decode steps; returns the profiler, wall seconds, steps."""
    from minisgl.core import SamplingParams

    sched = llm.scheduler
    cuda = args.device.startswith("cuda")
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    state = {"steady": 0, "profiled": 0, "start": 0.0, "wall": 0.0}

    def step() -> list:
        is_steady = steady(llm, args)
        if is_steady and state["profiled"] == 0 and state["wall"] == 0.0:
            state["steady"] += 1
            if state["steady"] == 3:  # two steady steps first: the overlap is under way
                sync(args.device)
                prof.start()
                state["start"] = time.perf_counter()
        out = type(sched).step(sched)
        if state["start"] and not state["wall"]:
            state["profiled"] += 1
            if state["profiled"] == args.steps or not is_steady:
                sync(args.device)
                state["wall"] = time.perf_counter() - state["start"]
                prof.stop()
        return out

    params = SamplingParams(max_tokens=args.steps + 8, ignore_eos=True)
    llm.generate(prompts(llm, args), params, use_tqdm=False)  # warm-up
    with patched({(sched, "step"): step}):
        llm.generate(prompts(llm, args), params, use_tqdm=False)
    if not state["wall"]:
        raise SystemExit("the batch never decoded steadily: raise --steps or check the engine")
    return prof, state["wall"], state["profiled"]


def report(prof: profile, wall: float, steps: int, args: argparse.Namespace) -> dict:
    events = prof.key_averages()
    device = [e for e in events if e.device_type.name == "CUDA"]
    host = [e for e in events if e.device_type.name == "CPU"]
    kernel_us = sum(e.self_device_time_total for e in device)
    comm_us = sum(e.self_device_time_total for e in device if is_comm(e.key))
    step_ms = wall / steps * 1e3
    replays = sum(e.count for e in host if e.key == "cudaGraphLaunch")
    kernels = sum(e.count for e in device if not e.key.startswith("Memcpy"))
    per_rank = weight_bytes(args.model, getattr(torch, args.dtype).itemsize) / args.tp_size
    floor_ms = per_rank / (args.bandwidth * 1e9) * 1e3
    out = {
        "steps": steps,
        "batch_size": args.batch_size,
        "tp_size": args.tp_size,
        "step_ms": step_ms,
        "device_ms_per_step": kernel_us / 1e3 / steps,
        "busy": kernel_us / 1e3 / (wall * 1e3),
        "kernels_per_step": kernels / steps,
        "graph_replays_per_step": replays / steps,
        "comm_ms_per_step": comm_us / 1e3 / steps,
        "weights_gb_per_rank": per_rank / 1e9,
        "bandwidth_floor_ms": floor_ms,
    }
    a = args
    print(f"{steps} decode steps at batch {a.batch_size}, tp {a.tp_size}, {a.dtype} on {a.device}")
    print(f"  wall per step             {step_ms:8.3f} ms")
    if device:
        dev_ms, busy = out["device_ms_per_step"], out["busy"]
        print(f"  device kernels per step   {dev_ms:8.3f} ms  (busy {busy:.0%})")
        print(f"  kernels per step          {out['kernels_per_step']:8.1f}")
        print(f"  graph replays per step    {out['graph_replays_per_step']:8.2f}")
        if args.tp_size > 1:
            share = comm_us / max(kernel_us, 1)
            comm_ms = out["comm_ms_per_step"]
            print(f"  communication per step    {comm_ms:8.3f} ms  ({share:.0%} of device time)")
        print(
            f"  weights read per step     {per_rank / 1e9:8.2f} GB per rank: {floor_ms:.3f} ms at "
            f"{args.bandwidth:g} GB/s ({floor_ms / step_ms:.0%} of the step)"
        )
        print("top kernels (device time per step, launches per step, mean):")
        for e in sorted(device, key=lambda e: -e.self_device_time_total)[: args.top]:
            total, mean = e.self_device_time_total, e.self_device_time_total / max(e.count, 1)
            per_step = f"{total / 1e3 / steps:8.3f} ms {e.count / steps:6.1f}x {mean:8.2f} us"
            print(f"  {per_step}  {e.key[:90]}")
    print("top host operations (self time per step, calls per step):")
    for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[: args.top]:
        per_step = f"{e.self_cpu_time_total / 1e3 / steps:8.3f} ms {e.count / steps:6.1f}x"
        print(f"  {per_step}  {e.key[:90]}")
    return out


# ---- the host's step, without the profiler --------------------------------------------


class Meter(Protocol):
    """What `steady_window` drives: on over the steps it measures, and each step run
    through it."""

    on: bool

    def step(self, fn: Callable[[], list]) -> list: ...


def steady_window(llm: Any, args: argparse.Namespace, meter: Meter) -> tuple[int, float, float]:
    """Generate the batch once with `meter` on over `args.steps` steady decode steps (from
    the third: the overlap is under way). Returns (steps, wall seconds, this thread's CPU
    seconds), from the start of the first to the start of the step after the last: the
    offline loop's work between steps is in them."""
    from minisgl.core import SamplingParams

    sched = llm.scheduler
    step_fn = type(sched).step.__get__(sched)
    seen, steps, first, last = 0, 0, (0.0, 0.0), (0.0, 0.0)

    def step() -> list:
        nonlocal seen, steps, first, last
        now, is_steady = (time.perf_counter(), time.thread_time()), steady(llm, args)
        if meter.on and (not is_steady or steps == args.steps):
            meter.on, last = False, now
        elif is_steady and not first[0]:
            seen += 1
            if seen == 3:
                meter.on, first = True, now
        if not meter.on:
            return step_fn()
        steps += 1
        return meter.step(step_fn)

    params = SamplingParams(max_tokens=args.steps + 8, ignore_eos=True)
    with patched({(sched, "step"): step}):
        llm.generate(prompts(llm, args), params, use_tqdm=False)
    if not last[0]:
        raise SystemExit("the batch never decoded steadily: raise --steps or check the engine")
    return steps, last[0] - first[0], last[1] - first[1]


class Clock:
    """Wall and this thread's CPU seconds inside wrapped callables, by name, while on."""

    def __init__(self) -> None:
        self.on = False
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **kw: Any) -> Any:
            if not self.on:
                return fn(*a, **kw)
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - wall
                self.cpu[name] = self.cpu.get(name, 0.0) + time.thread_time() - cpu

        return timed

    def step(self, fn: Callable[[], list]) -> list:
        return self.wrap("step", fn)()


class Calls(TorchFunctionMode):
    """Torch calls (on a GPU, most of them a kernel launch) and the calls of the engine's
    copy helpers (each a staging buffer and a transfer), outside the model's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.on = self.paused = False
        self.counts = {"torch calls": 0, "to_device": 0, "to_host": 0}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.on and not self.paused:
            self.counts["torch calls"] += 1
        return func(*args, **(kwargs or {}))

    def step(self, fn: Callable[[], list]) -> list:
        return fn()

    def counted(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **kw: Any) -> Any:
            if self.on:
                self.counts[name] += 1
            return fn(*a, **kw)

        return call

    def uncounted(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **kw: Any) -> Any:
            self.paused = True
            try:
                return fn(*a, **kw)
            finally:
                self.paused = False

        return call


def count_calls(llm: Any, args: argparse.Namespace) -> dict[str, float]:
    """Per steady decode step: torch calls and copies outside the model's forward."""
    import minisgl.utils

    calls, model = Calls(), llm.engine.model
    patches: dict[tuple[object, str], Any] = {(model, "forward"): calls.uncounted(model.forward)}
    for name in ("to_device", "to_host"):  # wherever a module imported them
        fn = getattr(minisgl.utils, name)
        for module in [m for n, m in sys.modules.items() if n.startswith("minisgl")]:
            if getattr(module, name, None) is fn:
                patches[(module, name)] = calls.counted(name, fn)
    with patched(patches), calls:
        steps, _, _ = steady_window(llm, args, calls)
    return {k: v / steps for k, v in calls.counts.items()}


WAIT = "  of which waiting for the device"
FORWARD = "  of which the model's forward"
KERNELS = "  of which the sampling kernels"
HOST = "host work (the interval less the device's work)"
PHASES = [
    "step",
    "schedule",
    "prepare_batch",
    "forward (launch)",
    "  of which graph replay",
    FORWARD,
    "sample",
    KERNELS,
    "process results",
    WAIT,
]


def time_phases(llm: Any, args: argparse.Namespace) -> tuple[int, tuple[float, float], Clock, list]:
    """One run: steps, the window's (wall, CPU) seconds, the clock of each phase, and the
    pairs of CUDA events around each step's device work."""
    from minisgl.engine import sampler as sampler_module

    sched, engine = llm.scheduler, llm.engine
    clock = Clock()
    # On a GPU, CUDA events from each step's graph launch (after the attention's plan for
    # it) to the sampled tokens' copy to the host: the device is busy at least for the sum
    # of those spans (a few small copies and kernels before the launch are not counted).
    cuda = args.device.startswith("cuda")
    spans: list[list[torch.cuda.Event]] = []

    def marked(fn: Callable[..., Any], start: bool) -> Callable[..., Any]:
        def call(*a: Any, **kw: Any) -> Any:
            out = fn(*a, **kw)
            if clock.on and cuda and (start or (spans and len(spans[-1]) == 1)):
                if start:
                    spans.append([])
                spans[-1].append(torch.cuda.Event(enable_timing=True))
                spans[-1][-1].record()
            return out

        return call

    process_fn = sched.process

    def process(flight: Any) -> list:
        if clock.on and flight.output is not None and flight.output.copy_done is not None:
            clock.wrap(WAIT, flight.output.copy_done.synchronize)()
        return process_fn(flight)

    runner, backend = engine.graph_runner, engine.attn_backend
    patches = {
        (sched, "_schedule"): clock.wrap("schedule", sched._schedule),
        (sched, "process"): clock.wrap("process results", process),
        (engine, "prepare_batch"): clock.wrap("prepare_batch", engine.prepare_batch),
        (engine, "forward_logits"): clock.wrap("forward (launch)", engine.forward_logits),
        (engine, "sample_logits"): clock.wrap("sample", marked(engine.sample_logits, False)),
        (runner, "replay"): clock.wrap("  of which graph replay", runner.replay),
        (engine.model, "forward"): clock.wrap(FORWARD, engine.model.forward),
        (sampler_module, "sample"): clock.wrap(KERNELS, sampler_module.sample),
        (backend, "prepare_for_replay"): marked(backend.prepare_for_replay, True),
    }
    with patched(patches):
        steps, wall, cpu = steady_window(llm, args, clock)
    return steps, (wall, cpu), clock, [s for s in spans if len(s) == 2]


def phases(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Host time per steady decode step by phase, on both clocks; the best of `--repeat`."""
    calls = count_calls(llm, args)  # also the warm-up
    cuda = args.device.startswith("cuda")
    best: tuple[int, dict[str, dict[str, float]], list] | None = None
    for _ in range(args.repeat):
        steps, interval, clock, spans = time_phases(llm, args)
        table = {}
        for name, spent, whole in (
            ("wall", clock.wall, interval[0]),
            ("cpu", clock.cpu, interval[1]),
        ):
            t = {"interval between steps": whole} | {p: spent.get(p, 0.0) for p in PHASES}
            t["outside the step (offline loop)"] = whole - t["step"]
            # The device's work: on a GPU, the host's wait for it; on a CPU, also the
            # forward and the sampling kernels, which ran on this thread.
            device = t[WAIT] + (0.0 if cuda else t[FORWARD] + t[KERNELS])
            t[HOST] = whole - device
            table[name] = {k: v / steps * 1e3 for k, v in t.items()}
        if best is None or table["cpu"][HOST] < best[1]["cpu"][HOST]:
            best = steps, table, spans
    assert best is not None
    steps, table, spans = best
    overlap = "on" if llm.scheduler.overlap else "off"
    print(
        f"{steps} decode steps at batch {args.batch_size}, {args.dtype} on {args.device}, "
        f"overlap {overlap}, graphs up to batch {args.cuda_graph_max_bs}; no profiler, "
        f"best of {args.repeat} by host CPU time"
    )
    print(f"  {'per step (ms)':48s} {'wall':>8s} {'CPU':>8s}")
    for row, wall in table["wall"].items():
        print(f"  {row:48s} {wall:8.3f} {table['cpu'][row]:8.3f}")
    print(
        "per step, outside the model's forward: "
        + ", ".join(f"{v:.0f} {k}" for k, v in calls.items())
    )
    out: dict[str, Any] = {"steps": steps, "batch_size": args.batch_size, "overlap": overlap}
    for name, t in table.items():
        out[f"{name}_ms"] = {k.strip(): v for k, v in t.items()}
    out["calls_per_step"] = calls
    if len(spans) > 1:
        torch.cuda.synchronize()
        busy_ms = sum(a.elapsed_time(b) for a, b in spans)
        whole_ms = spans[0][0].elapsed_time(spans[-1][1])
        out["device_busy"] = busy_ms / whole_ms
        print(
            f"device busy (CUDA events): {busy_ms / len(spans):.3f} ms of device work per step, "
            f"{out['device_busy']:.1%} of the {whole_ms / len(spans):.3f} ms per step"
        )
    return out


# ---- where the host's time goes, by Python function -------------------------------------


class HostProfile:
    """cProfile while on: the steps and the offline loop between them."""

    def __init__(self) -> None:
        self.profile, self._on = cProfile.Profile(), False

    @property
    def on(self) -> bool:
        return self._on

    @on.setter
    def on(self, value: bool) -> None:
        self._on = value
        (self.profile.enable if value else self.profile.disable)()

    def step(self, fn: Callable[[], list]) -> list:
        return fn()


def cprofile(llm: Any, args: argparse.Namespace) -> None:
    """cProfile of the steady steps with a forward that costs nothing: the same random
    logits every step, one row per request of the (padded) batch."""
    from minisgl.core import get_global_ctx

    engine = llm.engine
    rows, vocab = engine.config.max_running_req + 8, engine.model_config.vocab_size
    logits = torch.randn(rows, vocab, device=engine.device)
    fixed = lambda: logits[: get_global_ctx().batch.padded_size]
    host = HostProfile()
    with patched({(engine.model, "forward"): fixed}):
        steady_window(llm, args, HostProfile())  # warm-up
        steps, _, _ = steady_window(llm, args, host)
    text = io.StringIO()
    pstats.Stats(host.profile, stream=text).strip_dirs().sort_stats("tottime").print_stats(args.top)
    print(f"cProfile of {steps} decode steps at batch {args.batch_size}, the forward stubbed:")
    print(text.getvalue())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(p)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=64, help="decode steps measured")
    p.add_argument("--overlap", choices=["on", "off"], help="default: the server's (on on a GPU)")
    p.add_argument("--cuda-graph-max-bs", type=int, help="default: the batch size; 0: no graphs")
    p.add_argument(
        "--bandwidth", type=float, default=4300.0, help="memory GB/s for the floor (H200: ~4300)"
    )
    p.add_argument("--top", type=int, default=15, help="rows of each top list")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", help="write the profiler timeline (Chrome trace JSON) here")
    p.add_argument("--output-json")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--phases", action="store_true", help="host time by phase, no profiler")
    mode.add_argument("--cprofile", action="store_true", help="host time by Python function")
    p.add_argument("--repeat", type=int, default=1, help="--phases: runs, the best one counts")
    args = parse(p)
    if args.cuda_graph_max_bs is None:
        args.cuda_graph_max_bs = args.batch_size

    from minisgl.env import ENV
    from minisgl.llm import LLM

    if args.overlap is not None:  # read when the scheduler is built
        ENV.DISABLE_OVERLAP_SCHEDULING.value = args.overlap == "off"
    tokens = args.input_len + args.steps + 16
    llm = LLM(
        **engine_kwargs(args),
        max_running_req=args.batch_size,
        num_page_override=args.batch_size * tokens,
        max_seq_len_override=tokens,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
    )
    try:
        if args.cprofile:
            cprofile(llm, args)
        elif args.phases:
            out = phases(llm, args)
        else:
            prof, wall, steps = profile_steps(llm, args)
            out = report(prof, wall, steps, args)
            if args.trace:
                prof.export_chrome_trace(args.trace)
                print(f"trace: {args.trace}")
        if args.output_json:
            Path(args.output_json).write_text(json.dumps(out, indent=1))
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
