"""Decode latency: ms per output token at batch 1, and ms per decode step by batch size.

Side by side in one run: minisgl with CUDA graphs, minisgl eager (`cuda_graph_max_bs=0`),
Hugging Face `generate` with its dynamic cache, and `generate` with a static cache compiled
by torch.compile (what a user would reach for instead). Each time per token is taken as
(time for 1 + n tokens - time for 1 token) / n, so the prefill drops out. Next to each
batch-1 figure: the bandwidth it achieves reading the weights once per token. Graphs are
captured for the measured batch sizes only.

`--gemv auto,off` runs the graphs once per MINISGL_GEMV setting (our GEMV where the start-up
measurement chose it, and never), side by side.

`--variants` compares settings of MINISGL_* knobs instead, each a name and its knobs
(`plain:GEMV_MAX_ROWS=1;rows:GEMV_MAX_ROWS=16`), over `--rounds` rounds that take the
variants in turn (ABAB...), each a fresh engine: the first engine of a process pays
compiles that later ones find cached, so only alternation makes the sides comparable.
It prints every round's figures and their mean, ratios to the first variant.

    python tools/bench_latency.py --model /tmp/qwen3-0.6b --plot docs/decode_step.png
    python tools/bench_latency.py --model /tmp/qwen3-8b --gemv auto,off --skip-hf --skip-eager
    python tools/bench_latency.py --model /tmp/llama-1b --input-len 32 --output-len 128 \
        --batch-sizes 1,8 --variants "three:FUSED_DECODE=0;one:FUSED_DECODE=1" --rounds 2
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import (
    add_engine_args,
    engine_kwargs,
    parse,
    parse_variants,
    set_knobs,
    sync,
    weight_bytes,
)


def timed(fn: Callable[[], object], device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def per_token(run: Callable[[int], object], n: int, device: str) -> float:
    """ms per generated token after the first, from runs of 1 and 1 + n tokens."""
    run(1 + n)  # warm-up at full length
    return (timed(lambda: run(1 + n), device) - timed(lambda: run(1), device)) / n * 1e3


class Prompts:
    """Fresh random prompts for every run, so the prefix cache never shortens a prefill."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab, self.rng = vocab, random.Random(seed)

    def make(self, n: int, length: int) -> list[list[int]]:
        return [[self.rng.randrange(self.vocab) for _ in range(length)] for _ in range(n)]


def minisgl_llm(args: argparse.Namespace, graph_bs: int) -> object:
    from minisgl.llm import LLM

    max_bs = max(args.batch_sizes)
    tokens = args.input_len + max(args.output_len, args.step_tokens) + 8
    graphs = dict(cuda_graph_bs=sorted(set(args.batch_sizes))) if graph_bs else {}
    return LLM(
        **engine_kwargs(args),
        max_running_req=max_bs,
        num_page_override=max_bs * tokens,
        max_seq_len_override=tokens,
        cuda_graph_max_bs=graph_bs,
        prefill_graph=args.prefill_graph,
        **graphs,
    )


def decode_steps(llm: object, prompts: Prompts, args: argparse.Namespace, bs: int, n: int):
    """(step ms, forward ms) at batch size `bs`, medians over the steps where every request
    is decoding: the time between two scheduler steps as a user sees it (overlap on), and
    the forward alone with the device synchronised before and after it (the device's share;
    the rest of a step is host work the overlap did not hide)."""
    from minisgl.core import SamplingParams

    sched, engine = llm.scheduler, llm.engine
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    stamps: list[float] = []
    forwards: list[float] = []

    def step() -> list:
        out = type(sched).step(sched)
        if not sched.prefill.has_work and sched.decode.running:
            stamps.append(time.perf_counter())
        return out

    def forward(batch: object) -> object:
        sync(args.device)
        start = time.perf_counter()
        out = type(engine).forward_batch(engine, batch)
        sync(args.device)
        if batch.is_decode:
            forwards.append(time.perf_counter() - start)
        return out

    sched.step = step
    try:
        llm.generate(prompts.make(bs, args.input_len), params, use_tqdm=False)
        # The steps come from this run alone: in the next, the synchronised forward stops
        # the overlap, and its steps are host + device in series.
        gaps = [b - a for a, b in zip(stamps, stamps[1:])][2:]  # the first steps warm up
        del sched.step
        engine.forward_batch = forward
        llm.generate(prompts.make(bs, args.input_len), params, use_tqdm=False)
    finally:
        sched.__dict__.pop("step", None)
        engine.__dict__.pop("forward_batch", None)
    return statistics.median(gaps) * 1e3, statistics.median(forwards) * 1e3


def bench_minisgl(args: argparse.Namespace, prompts: Prompts, graphs: bool) -> dict[str, object]:
    llm = minisgl_llm(args, max(args.batch_sizes) if graphs else 0)
    decode_steps(llm, prompts, args, 1, 8)  # warm-up
    result: dict[str, object] = {"steps": {}}
    result["batch1_ms"], result["batch1_forward_ms"] = decode_steps(
        llm, prompts, args, 1, args.output_len
    )
    for bs in args.batch_sizes:
        result["steps"][bs] = decode_steps(llm, prompts, args, bs, args.step_tokens)
    llm.shutdown()
    return result


def bench_hf(args: argparse.Namespace, prompts: Prompts, compiled: bool) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    ids = torch.tensor(prompts.make(1, args.input_len), device=args.device)
    extra = {"cache_implementation": "static"} if compiled else {}

    def run(n: int) -> None:
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
                **extra,
            )

    if compiled:
        run(1 + args.output_len)  # compilation happens on the first static-cache calls
    return per_token(run, args.output_len, args.device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(p)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256, help="tokens for the batch-1 figure")
    p.add_argument("--step-tokens", type=int, default=64, help="decode steps per batch size")
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-compile", action="store_true", help="no static-cache compiled HF run")
    p.add_argument("--plot", default=None, help="write the ms-per-step plot to this PNG")
    p.add_argument("--output-json", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-eager", action="store_true", help="minisgl with CUDA graphs only")
    p.add_argument("--gemv", default="auto", help="MINISGL_GEMV settings to run, e.g. auto,off")
    p.add_argument("--prefill-graph", help="off: no prefill graphs (decode is what is timed)")
    p.add_argument("--variants", help="NAME:KNOB=V,KNOB=V;NAME:...: MINISGL_* settings, ABAB")
    p.add_argument("--rounds", type=int, default=2, help="with --variants: rounds of them all")
    args = parse(p)
    args.batch_sizes = args.batch_sizes or [1, 8, 32, 128, 256]
    modes = args.gemv.split(",")
    if not set(modes) <= {"auto", "on", "off"}:
        p.error(f"--gemv takes auto, on and off, got {args.gemv!r}")

    from minisgl.models.config import ModelConfig

    prompts = Prompts(ModelConfig.from_path(args.model).vocab_size, args.seed)
    weights = weight_bytes(args.model, getattr(torch, args.dtype).itemsize)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(
        f"{name}, {args.dtype}, prompt {args.input_len} tokens, "
        f"{weights / 1e9:.2f} GB of weights (torch {torch.__version__})"
    )
    from minisgl.env import ENV

    if args.variants:
        return compare_variants(args, prompts, weights, parse_variants(args.variants))
    results = {}
    for mode in modes:  # the first is "graphs", the rest "graphs, GEMV <mode>"
        ENV.GEMV.value = mode
        results["graphs" if mode == modes[0] else f"graphs, GEMV {mode}"] = bench_minisgl(
            args, prompts, True
        )
    ENV.GEMV.value = modes[0]
    label = f"minisgl, CUDA graphs ({args.attn}{f', GEMV {modes[0]}' if len(modes) > 1 else ''})"
    rows = [(label, results["graphs"]["batch1_ms"])]
    for m in modes[1:]:
        ms = results[f"graphs, GEMV {m}"]["batch1_ms"]
        rows.append((f"minisgl, CUDA graphs ({args.attn}, GEMV {m})", ms))
    if not args.skip_eager:
        results["eager"] = bench_minisgl(args, prompts, False)
        rows.append(("minisgl, eager", results["eager"]["batch1_ms"]))
    if not args.skip_hf:
        rows.append(("HF generate, dynamic cache", bench_hf(args, prompts, compiled=False)))
        torch.cuda.empty_cache()
    if not args.skip_hf and not args.skip_compile:
        try:
            ms = bench_hf(args, prompts, compiled=True)
            rows.append(("HF generate, static cache + torch.compile", ms))
        except Exception as e:  # report it rather than lose the other rows
            print(f"HF static + compile failed: {type(e).__name__}: {e}")
    print(f"\nbatch 1, {args.output_len} tokens out\n")
    print("| engine | ms/token | weights GB/s | vs minisgl graphs |\n|---|---|---|---|")
    base = rows[0][1]
    for name, ms in rows:
        print(f"| {name} | {ms:.3f} | {weights / ms / 1e6:.0f} | {ms / base:.2f}x |")
    print(
        f"\ndecode step by batch size ({args.step_tokens} tokens, prompt {args.input_len}); "
        "forward = the forward alone, device synchronised; busy = forward / step\n"
    )
    others = [f"GEMV {m}" for m in modes[1:]]
    print(
        "| batch | graphs step ms | graphs forward ms | graphs busy | eager step ms "
        "| eager forward ms | eager / graphs | graphs tok/s |"
        + "".join(f" {o} step ms | {o} / graphs |" for o in others)
        + "\n|---|---|---|---|---|---|---|---|"
        + "---|---|" * len(others)
    )
    for bs in args.batch_sizes:
        g, gf = results["graphs"]["steps"][bs]
        e, ef = results["eager"]["steps"][bs] if "eager" in results else (math.nan, math.nan)
        extra = ""
        for name in others:
            step_ms = results[f"graphs, {name}"]["steps"][bs][0]
            extra += f" {step_ms:.3f} | {step_ms / g:.2f}x |"
        print(
            f"| {bs} | {g:.3f} | {gf:.3f} | {100 * min(gf / g, 1):.0f}% | {e:.3f} | {ef:.3f} "
            f"| {e / g:.2f}x | {bs / g * 1e3:.0f} |{extra}"
        )
    results["batch1"] = dict(rows)
    results["weight_bytes"] = weights
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    if args.plot:
        plot(args, results)


def compare_variants(
    args: argparse.Namespace, prompts: Prompts, weights: int, variants: dict[str, dict[str, str]]
) -> None:
    from minisgl.env import ENV

    saved = {k: getattr(ENV, k).value for v in variants.values() for k in v}
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for name, settings in variants.items():
            set_knobs(settings)
            runs[name].append(bench_minisgl(args, prompts, True))
            res = runs[name][-1]
            steps = ", ".join(f"bs {b} {res['steps'][b][0]:.3f}" for b in args.batch_sizes)
            print(f"round {r + 1} {name}: batch 1 {res['batch1_ms']:.3f} ms/token; {steps} ms/step")
    for knob, value in saved.items():
        getattr(ENV, knob).value = value
    mean = {
        name: {
            "batch1_ms": statistics.mean(x["batch1_ms"] for x in rs),
            **{bs: statistics.mean(x["steps"][bs][0] for x in rs) for bs in args.batch_sizes},
        }
        for name, rs in runs.items()
    }
    first = next(iter(mean))
    print(
        f"\nmeans of {args.rounds} alternating rounds; batch 1: {args.output_len} tokens out, "
        f"prompt {args.input_len}; ratio = first variant's time / this one's\n"
    )
    print("| variant | knobs | batch 1 ms/token | weights GB/s | vs " + first + " |"
          + "".join(f" bs {b} ms/step |" for b in args.batch_sizes)
          + "\n|---|---|---|---|---|" + "---|" * len(args.batch_sizes))  # fmt: skip
    for name, m in mean.items():
        knobs = " ".join(f"{k}={v}" for k, v in variants[name].items())
        ms = m["batch1_ms"]
        cells = "".join(f" {m[b]:.3f} |" for b in args.batch_sizes)
        print(f"| {name} | {knobs} | {ms:.3f} | {weights / ms / 1e6:.0f} "
              f"| {mean[first]['batch1_ms'] / ms:.3f}x |{cells}")  # fmt: skip
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"variants": variants, "runs": runs, "mean": mean}, f, indent=1, default=str)


def plot(args: argparse.Namespace, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in [m for m in ("graphs", "eager") if m in results]:
        steps = results[mode]["steps"]
        ax.plot(args.batch_sizes, [steps[bs][0] for bs in args.batch_sizes], "o-", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("ms per decode step")
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    ax.set_title(f"minisgl decode step, {Path(args.model).name}, {where}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
