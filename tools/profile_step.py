"""Where a decode step's time goes: a torch-profiler trace of steady decode steps.

    python tools/profile_step.py --model /root/q06                     # batch 1, graphs on
    python tools/profile_step.py --model /root/q8 --tp-size 2 --trace q8_tp2.json
    python tools/profile_step.py --model models/SmolLM2-135M-Instruct --device cpu --steps 8

The engine runs as the server runs it (overlap scheduling, CUDA graphs up to the batch
size). The profiler starts once every request of the batch is decoding and stops after
`--steps` scheduler steps, so neither the prefill nor start-up is in the figures. It
prints, per decode step:

- wall time, the device's kernel time and their ratio (busy): below 100% the device
  waited for the host;
- kernels and graph replays: a graph replay launches hundreds of kernels for the price of
  one call on the host;
- communication kernels (NCCL all-reduce / all-gather) with tensor parallelism, and their
  share of the device time;
- the weights one rank reads per step against the time the memory needs to move them
  (`--bandwidth`, GB/s): at batch 1 a step can be no faster than that floor;

then the kernels and the host operations that take the most time. `--trace` writes the
timeline for chrome://tracing or Perfetto. `--phases` runs without the profiler (which
slows the host) and times the host's part of each step by phase instead: scheduling,
`prepare_batch`, the forward's launch (of which the graph replay), sampling, and
processing the step before, of which waiting for the device; what the host spends outside
the scheduler's step (the offline loop) is the rest of the interval between steps. With
`--tp-size N` the figures are rank 0's: its communication kernels include the time spent
waiting for the other ranks.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def weight_bytes(path: str, itemsize: int) -> int:
    """Bytes of all weights in the folder's safetensors files, at `itemsize` per value."""
    from safetensors import safe_open

    total = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118
    return total * itemsize


def is_comm(name: str) -> bool:
    name = name.lower()
    return "nccl" in name or "allreduce" in name or "all_reduce" in name or "allgather" in name


def profile_steps(llm: object, args: argparse.Namespace) -> tuple[profile, float, int]:
    """Profile `args.steps` steady decode steps; returns the profiler, wall seconds, steps."""
    from minisgl.core import SamplingParams

    sched = llm.scheduler  # type: ignore[attr-defined]
    cuda = args.device.startswith("cuda")
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    state = {"steady": 0, "profiled": 0, "start": 0.0, "wall": 0.0}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def step() -> list:
        steady = not sched.prefill.has_work and len(sched.decode.running) == args.batch_size
        if steady and state["profiled"] == 0 and state["wall"] == 0.0:
            state["steady"] += 1
            if state["steady"] == 3:  # two steady steps first: the overlap is under way
                sync()
                prof.start()
                state["start"] = time.perf_counter()
        out = type(sched).step(sched)
        if state["start"] and not state["wall"]:
            state["profiled"] += 1
            if state["profiled"] == args.steps or not steady:
                sync()
                state["wall"] = time.perf_counter() - state["start"]
                prof.stop()
        return out

    rng = random.Random(args.seed)
    vocab = llm.engine.model_config.vocab_size  # type: ignore[attr-defined]
    prompts = [
        [rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.batch_size)
    ]
    params = SamplingParams(max_tokens=args.steps + 8, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # type: ignore[attr-defined]  # warm-up
    sched.step = step
    try:
        llm.generate(prompts, params, use_tqdm=False)  # type: ignore[attr-defined]
    finally:
        del sched.step
    if not state["wall"]:
        raise SystemExit("the batch never decoded steadily: raise --steps or check the engine")
    return prof, state["wall"], state["profiled"]


PHASES = [
    "step",
    "schedule",
    "prepare_batch",
    "forward (launch)",
    "  of which graph replay",
    "sample",
    "process the step before",
    "  of which waiting for the device",
]


def time_phases(llm: object, args: argparse.Namespace) -> dict:
    """Host seconds per steady decode step in each phase of the scheduler's step."""
    from minisgl.core import SamplingParams

    sched, engine = llm.scheduler, llm.engine  # type: ignore[attr-defined]
    runner, backend = engine.graph_runner, engine.attn_backend
    totals: dict[str, float] = {}
    state = {"steady": 0, "steps": 0, "first": 0.0, "last": 0.0, "on": False}

    def timed(name: str, fn):
        def wrapper(*a, **kw):
            if not state["on"]:
                return fn(*a, **kw)
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                totals[name] = totals.get(name, 0.0) + time.perf_counter() - start

        return wrapper

    def process(flight):
        if state["on"] and flight.output is not None and flight.output.copy_done is not None:
            start = time.perf_counter()
            flight.output.copy_done.synchronize()
            totals["  of which waiting for the device"] = (
                totals.get("  of which waiting for the device", 0.0) + time.perf_counter() - start
            )
        return inner_process(flight)

    # On a GPU, CUDA events around each step's device work from the graph's launch (after
    # the attention's plan for it) to the sampled tokens' copy to the host: the device is
    # busy at least for the sum of those spans (the few small copies and kernels before the
    # launch are not counted), and the rest of the time it waited for the host.
    cuda = args.device.startswith("cuda")
    spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def marked(fn, where: str):
        def wrapper(*a, **kw):
            out = fn(*a, **kw)
            if state["on"] and cuda and where == "start":
                spans.append((torch.cuda.Event(enable_timing=True), None))
                spans[-1][0].record()
            if state["on"] and cuda and where == "end" and spans and spans[-1][1] is None:
                spans[-1] = (spans[-1][0], torch.cuda.Event(enable_timing=True))
                spans[-1][1].record()
            return out

        return wrapper

    inner_process = timed("process the step before", type(sched)._process.__get__(sched))
    patches = {
        (sched, "_schedule"): timed("schedule", sched._schedule),
        (sched, "_process"): process,
        (engine, "prepare_batch"): timed("prepare_batch", engine.prepare_batch),
        (engine, "forward_logits"): timed("forward (launch)", engine.forward_logits),
        (engine, "sample_logits"): timed("sample", marked(engine.sample_logits, "end")),
        (runner, "replay"): timed("  of which graph replay", runner.replay),
        (backend, "prepare_for_replay"): marked(backend.prepare_for_replay, "start"),
    }
    step_fn = type(sched).step.__get__(sched)

    def step() -> list:
        steady = not sched.prefill.has_work and len(sched.decode.running) == args.batch_size
        now = time.perf_counter()
        if state["on"] and (not steady or state["steps"] == args.steps):
            state["on"] = False
            state["last"] = now
        elif steady and not state["on"] and not state["first"]:
            state["steady"] += 1
            if state["steady"] == 3:
                state["on"], state["first"] = True, now
        if state["on"]:
            state["steps"] += 1
            start = time.perf_counter()
            out = step_fn()
            totals["step"] = totals.get("step", 0.0) + time.perf_counter() - start
            return out
        return step_fn()

    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    prompts = [
        [rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.batch_size)
    ]
    params = SamplingParams(max_tokens=args.steps + 8, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # type: ignore[attr-defined]  # warm-up
    for (obj, name), fn in patches.items():
        setattr(obj, name, fn)
    sched.step = step
    try:
        llm.generate(prompts, params, use_tqdm=False)  # type: ignore[attr-defined]
    finally:
        for obj, name in [*patches, (sched, "step")]:
            delattr(obj, name)
    steps = state["steps"]
    if not steps or not state["last"]:
        raise SystemExit("the batch never decoded steadily: raise --steps or check the engine")
    interval = (state["last"] - state["first"]) / steps
    out = {k: v / steps * 1e3 for k, v in totals.items()}
    out["interval"] = interval * 1e3
    print(f"{steps} decode steps at batch {args.batch_size}, host time per step (ms), no profiler:")
    print(f"  {'interval between steps':36s} {interval * 1e3:8.3f}")
    for name in PHASES:
        print(f"  {name:36s} {out.get(name, 0.0):8.3f}")
    print(f"  {'outside the step (offline loop)':36s} {interval * 1e3 - out['step']:8.3f}")
    spans = [(a, b) for a, b in spans if b is not None]
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


def report(prof: profile, wall: float, steps: int, args: argparse.Namespace) -> dict:
    events = prof.key_averages()
    device = [e for e in events if e.device_type.name == "CUDA"]
    host = [e for e in events if e.device_type.name == "CPU"]
    kernel_us = sum(e.self_device_time_total for e in device)
    comm_us = sum(e.self_device_time_total for e in device if is_comm(e.key))
    step_ms = wall / steps * 1e3
    replays = sum(e.count for e in host if e.key == "cudaGraphLaunch")
    kernels = sum(e.count for e in device if not e.key.startswith("Memcpy"))
    per_rank = weight_bytes(args.model, torch.finfo(getattr(torch, args.dtype)).bits // 8)
    per_rank /= args.tp_size
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["bfloat16", "float16", "float32"],
        help="default: bfloat16 on GPU, float32 on CPU",
    )
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=64, help="decode steps profiled")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--attn", default="auto", help="attention backend (--attn of the server)")
    p.add_argument(
        "--bandwidth", type=float, default=4300.0, help="memory GB/s for the floor (H200: ~4300)"
    )
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", help="write the profiler timeline (Chrome trace JSON) here")
    p.add_argument("--output-json")
    p.add_argument("--phases", action="store_true", help="host time by phase, no profiler")
    args = p.parse_args()
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")

    from minisgl.llm import LLM

    tokens = args.input_len + args.steps + 16
    llm = LLM(
        args.model,
        dtype=getattr(torch, args.dtype),
        device=args.device,
        max_running_req=args.batch_size,
        num_page_override=args.batch_size * tokens,
        max_seq_len_override=tokens,
        cuda_graph_max_bs=args.batch_size,
        attention_backend=args.attn,
        tp_size=args.tp_size,
    )
    try:
        if args.phases:
            out = time_phases(llm, args)
            if args.output_json:
                Path(args.output_json).write_text(json.dumps(out, indent=1))
            return
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
