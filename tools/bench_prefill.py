"""Prefill latency without and with prefill graphs, and the activation peak of the largest.

One request at a time, one output token, fresh random prompts (no prefix-cache hit), for
several prompt lengths: the time of `generate` with `prefill_graph` off, breakable and
full, side by side in one run. Then one prefill of the largest captured size
(`--peak-tokens`): how much memory it allocates above what the engine already holds.

    python tools/bench_prefill.py --model /tmp/qwen3-0.6b --attn fi
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from common import add_engine_args, engine_kwargs, parse, sync


def bench_mode(args: argparse.Namespace, mode: str, rng: random.Random) -> dict[str, object]:
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    cuda = args.device.startswith("cuda")
    llm = LLM(
        **engine_kwargs(args),
        prefill_graph=mode,
        max_prefill_length=args.peak_tokens,
        max_running_req=16,
        cuda_graph_max_bs=16 if cuda else 0,
        cache_type="naive",  # every prompt is prefilled in full
        max_seq_len_override=args.peak_tokens + 8,
    )
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    def prefill(length: int) -> float:
        prompt = [rng.randrange(vocab) for _ in range(length)]
        sync(args.device)
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        sync(args.device)
        return (time.perf_counter() - start) * 1e3

    result: dict[str, object] = {"mode": mode}
    for length in args.lengths:
        for _ in range(args.warmup):
            prefill(length)
        result[str(length)] = statistics.median(prefill(length) for _ in range(args.repeat))
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        prefill(args.peak_tokens - 1)  # the scheduler's largest prefill
        result["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    result["graphs"] = len(llm.engine.graph_runner.graphs("prefill"))
    llm.shutdown()
    if cuda:
        torch.cuda.empty_cache()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(p, tp_size=None)
    p.add_argument("--modes", default="off,breakable,full")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--peak-tokens", type=int, default=8192, help="max_prefill_length")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    args = parse(p)
    args.lengths = args.lengths or [16, 64, 256, 1024, 4096]
    rng = random.Random(args.seed)
    results = [bench_mode(args, mode, rng) for mode in args.modes.split(",")]
    head = ["prompt tokens", *[r["mode"] for r in results]]
    base = results[0]
    print(f"ms per one-token request, {args.attn} attention, median of {args.repeat}")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for length in args.lengths:
        cells = [f"{base[str(length)]:.2f}"]
        for r in results[1:]:
            ms = r[str(length)]
            cells.append(f"{ms:.2f} ({base[str(length)] / ms:.2f}x)")
        print(f"| {length} | " + " | ".join(cells) + " |")
    if "peak_mib" in base:
        print(
            f"memory allocated by one {args.peak_tokens - 1}-token prefill, above the engine: "
            + ", ".join(f"{r['mode']} {r['peak_mib']:.0f} MiB" for r in results)
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
