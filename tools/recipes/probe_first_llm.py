"""Is the first engine of a process slower than the ones built after it?

    python tools/recipes/probe_first_llm.py --model /tmp/qwen3-0.6b --attn torch

Four engines, one after the other in one process, alternating the two configurations of
the table that first showed the effect: the defaults, and `cuda_graph_max_bs=0`. For
each: how long its first request takes (a process's first forward pays for lazy CUDA
initialisation and JIT builds), then, after that warm-up, ms per output token at batch
1 as tools/bench_latency.py measures it (1 + n tokens minus 1 token, over n). If only the
first engine is slow, the cause is once per process; if the slow ones share a
configuration, it is the configuration.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/
from bench_latency import Prompts, timed  # noqa: E402
from common import add_engine_args, engine_kwargs, parse  # noqa: E402


def measure(llm: object, prompts: Prompts, args: argparse.Namespace) -> tuple[float, float]:
    """(seconds of the engine's first request, ms per token at batch 1 after it)."""
    from minisgl.core import SamplingParams

    def run(n: int) -> None:
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        llm.generate(prompts.make(1, args.input_len), params, use_tqdm=False)  # type: ignore[attr-defined]

    first = timed(lambda: run(1), args.device)
    n = args.output_len
    run(1 + n)  # warm-up at full length
    ms = (timed(lambda: run(1 + n), args.device) - timed(lambda: run(1), args.device)) / n * 1e3
    return first, ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(p, attn="torch", tp_size=None)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    args = parse(p)
    from minisgl.llm import LLM

    prompts = None
    rows = []
    for i, graphs in enumerate([None, 0, None, 0]):
        start = time.perf_counter()
        kw = {} if graphs is None else {"cuda_graph_max_bs": graphs}
        llm = LLM(**engine_kwargs(args), **kw)
        built = time.perf_counter() - start
        prompts = prompts or Prompts(llm.engine.model_config.vocab_size, seed=0)
        first, ms = measure(llm, prompts, args)
        label = "defaults" if graphs is None else f"cuda_graph_max_bs={graphs}"
        rows.append((i + 1, label, built, first, ms))
        print(f"engine {i + 1} ({label}): built in {built:.1f} s, first request {first:.3f} s, "
              f"{ms:.3f} ms/token", flush=True)  # fmt: skip
        llm.shutdown()
        del llm
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print(f"\n{args.attn} attention, batch 1, prompt {args.input_len}, {args.output_len} tokens")
    print("\n| engine in the process | configuration | built (s) | first request (s) | ms/token |")
    print("|---|---|---|---|---|")
    for i, label, built, first, ms in rows:
        print(f"| {i} | {label} | {built:.1f} | {first:.3f} | {ms:.3f} |")


if __name__ == "__main__":
    main()
