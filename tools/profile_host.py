"""Host time per decode step: what the scheduler and engine cost beside the forward.

A decode step is the model's forward and sampling (device work on a GPU) plus the Python
around them: scheduling the batch, `prepare_batch`, attention metadata, sampling inputs,
copies, appending tokens, building messages. On a GPU the device runs the forward while
the host prepares the next step, so a step takes max(host, device): when the host is the
slower, the device idles. This tool measures the host part on any machine.

It runs the offline `LLM` on a small model and times every scheduler step of a steady
decode (every request decoding, none finished), with the model's forward and the sampling
kernels timed apart and subtracted: on CPU they run synchronously, on a GPU they would be
queued. What is left, per step, is host work. Then, unless --no-profile, a cProfile of
the same run with the forward replaced by fixed logits (so that it costs nothing) lists
where that host time goes.

    python tools/profile_host.py --model models/tiny-llama --batch-sizes 1,16
    python tools/profile_host.py --overlap off --cuda-graph-max-bs 16 --top 30
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def clocks() -> tuple[float, float]:
    """(wall, this thread's CPU) seconds. CPU time counts only what this thread ran, so
    another busy process on the machine inflates it far less than it does wall time."""
    return time.perf_counter(), time.thread_time()


class Timer:
    """Wall and CPU seconds spent inside wrapped callables since the last `take()`."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            wall, cpu = clocks()
            try:
                return fn(*args, **kwargs)
            finally:
                end_wall, end_cpu = clocks()
                self.wall += end_wall - wall
                self.cpu += end_cpu - cpu

        return timed

    def take(self) -> tuple[float, float]:
        spent, self.wall, self.cpu = (self.wall, self.cpu), 0.0, 0.0
        return spent


def make_llm(args: argparse.Namespace, overlap: bool) -> Any:
    from minisgl.env import ENV
    from minisgl.llm import LLM

    ENV.DISABLE_OVERLAP_SCHEDULING.value = not overlap  # read when the scheduler is built
    max_bs = max(args.batch_sizes)
    return LLM(
        args.model,
        device="cpu",
        dtype=torch.float32,
        max_running_req=max_bs,
        max_seq_len_override=args.input_len + args.output_len + 8,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        page_size=args.page_size,
    )


def prompts(llm: Any, n: int, length: int, rng: random.Random) -> list[list[int]]:
    vocab = llm.engine.model_config.vocab_size
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def steady_steps(
    llm: Any, args: argparse.Namespace, bs: int, rng: random.Random
) -> list[dict[str, float]]:
    """Seconds of each steady decode step at batch size `bs`: wall and host CPU time.

    A step runs from the start of one scheduler step to the start of the next, so the
    offline loop's own work on the results is in it. Its host time is what is left after
    the model's forward and the sampling kernels (timed apart) are taken out."""
    from minisgl.core import SamplingParams
    from minisgl.engine import engine as engine_module

    sched, engine = llm.scheduler, llm.engine
    device = Timer()
    steps: list[tuple[tuple[float, float], tuple[float, float], bool]] = []

    def step() -> list:
        start = clocks()
        out = type(sched).step(sched)
        steady = not sched.prefill.has_work and len(sched.decode.running) == bs
        steps.append((start, device.take(), steady))
        return out

    params = SamplingParams(
        max_tokens=args.output_len, ignore_eos=True, temperature=args.temperature
    )
    model, sample = engine.model, engine_module.sample
    sched.step = step
    # Also what an emulated graph replays: it looks the forward up at every replay.
    model.forward = device.wrap(fixed_logits(llm) if args.stub_forward else model.forward)
    engine_module.sample = device.wrap(sample)
    try:
        llm.generate(prompts(llm, bs, args.input_len, rng), params, use_tqdm=False)
    finally:
        del sched.step, model.forward
        engine_module.sample = sample
    rows = []
    for (start, (dev_wall, dev_cpu), steady), (end, _, _) in zip(steps, steps[1:]):
        if steady:
            wall, cpu = end[0] - start[0], end[1] - start[1]
            rows.append({"wall": wall, "host_wall": wall - dev_wall, "host_cpu": cpu - dev_cpu})
    return rows[4:]  # the first steps after the prefill warm up


def report(rows: list[dict[str, float]]) -> dict[str, float]:
    """Medians over the steps, in microseconds."""
    return {key: statistics.median(r[key] for r in rows) * 1e6 for key in rows[0]}


class CallCounter(TorchFunctionMode):
    """Counts torch calls (each one a kernel launch or more on a GPU) and the engine's
    host-to-device and device-to-host copies (each one a page-locked staging buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = {"torch calls": 0, "to_device": 0, "to_host": 0}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts["torch calls"] += 1
        return func(*args, **(kwargs or {}))

    @contextmanager
    def copies(self) -> Iterator[None]:
        """Count the calls of minisgl.utils' copy helpers, wherever they were imported."""
        import minisgl.utils

        originals = {name: getattr(minisgl.utils, name) for name in ("to_device", "to_host")}
        patched = []
        for module in [m for name, m in sys.modules.items() if name.startswith("minisgl")]:
            for name, fn in originals.items():
                if getattr(module, name, None) is fn:
                    setattr(module, name, self._counted(name, fn))
                    patched.append((module, name, fn))
        try:
            yield
        finally:
            for module, name, fn in patched:
                setattr(module, name, fn)

    def _counted(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[name] += 1
            return fn(*args, **kwargs)

        return counted


def count_calls(
    llm: Any, args: argparse.Namespace, bs: int, rng: random.Random
) -> dict[str, float]:
    """Per steady decode step (median): torch calls and copies, forward stubbed."""
    from minisgl.core import SamplingParams

    sched, model = llm.scheduler, llm.engine.model
    counter = CallCounter()
    per_step: list[dict[str, int]] = []

    def step() -> list:
        before = dict(counter.counts)
        out = type(sched).step(sched)
        if not sched.prefill.has_work and len(sched.decode.running) == bs:
            per_step.append({k: counter.counts[k] - before[k] for k in before})
        return out

    params = SamplingParams(
        max_tokens=args.output_len, ignore_eos=True, temperature=args.temperature
    )
    batch = prompts(llm, bs, args.input_len, rng)
    sched.step, model.forward = step, fixed_logits(llm)
    try:
        with counter.copies(), counter:
            llm.generate(batch, params, use_tqdm=False)
    finally:
        del sched.step, model.forward
    return {k: statistics.median(c[k] for c in per_step[4:]) for k in counter.counts}


def fixed_logits(llm: Any) -> Callable[[], torch.Tensor]:
    """A stand-in for the model's forward that costs next to nothing: the same random
    logits every step, one row per request (decode only: every prompt's last token)."""
    from minisgl.core import get_global_ctx

    engine = llm.engine
    logits = torch.randn(engine.config.max_running_req + 8, engine.model_config.vocab_size)
    return lambda: logits[: get_global_ctx().batch.padded_size]


def profile(llm: Any, args: argparse.Namespace, bs: int, rng: random.Random) -> str:
    """cProfile of a decode run whose forward returns fixed logits, top `args.top` by self time."""
    from minisgl.core import SamplingParams

    model = llm.engine.model
    params = SamplingParams(
        max_tokens=args.output_len, ignore_eos=True, temperature=args.temperature
    )
    batch = prompts(llm, bs, args.input_len, rng)
    model.forward = fixed_logits(llm)
    profiler = cProfile.Profile()
    try:
        profiler.enable()
        llm.generate(batch, params, use_tqdm=False)
        profiler.disable()
    finally:
        del model.forward
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out).strip_dirs().sort_stats("tottime")
    stats.print_stats(args.top)
    return out.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="models/tiny-llama")
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128, help="tokens per request (ignore_eos)")
    p.add_argument("--overlap", choices=["on", "off", "both"], default="both")
    p.add_argument("--cuda-graph-max-bs", type=int, default=0, help="> 0: emulated graphs")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: seeded sampling")
    p.add_argument(
        "--stub-forward", action="store_true", help="time with fixed logits instead of the model"
    )
    p.add_argument("--repeat", type=int, default=5, help="runs per batch size; the best counts")
    p.add_argument("--top", type=int, default=25, help="cProfile rows")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    torch.set_num_threads(1)  # steadier timings; the forward is timed apart anyway
    rng = random.Random(args.seed)
    print(
        f"{args.model}, cpu fp32, prompt {args.input_len}, {args.output_len} tokens out, "
        f"graphs up to bs {args.cuda_graph_max_bs}, page size {args.page_size}, "
        f"temperature {args.temperature} (torch {torch.__version__})"
    )
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.overlap]
    for overlap in modes:
        llm = make_llm(args, overlap)
        steady_steps(llm, args, 1, rng)  # warm-up
        mode = f"overlap {'on' if overlap else 'off'}"
        for bs in args.batch_sizes:
            runs = [report(steady_steps(llm, args, bs, rng)) for _ in range(args.repeat)]
            calls = count_calls(llm, args, bs, rng)
            best = min(runs, key=lambda r: r["host_cpu"])
            all_runs = ", ".join(f"{r['host_cpu']:.0f}" for r in runs)
            print(
                f"{mode}, batch {bs:3d}: host CPU {best['host_cpu']:.0f} us/step, best of "
                f"{len(runs)} runs ({all_runs}); wall: step {best['wall']:.0f}, host "
                f"{best['host_wall']:.0f}; per step: "
                + ", ".join(f"{v:.0f} {k}" for k, v in calls.items())
            )
        if not args.no_profile:
            for bs in args.batch_sizes:
                print(f"\ncProfile, {mode}, batch {bs}, forward stubbed:")
                print(profile(llm, args, bs, rng))
        llm.shutdown()


if __name__ == "__main__":
    main()
