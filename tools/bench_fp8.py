"""FP8 weights, measured: the kernels against bf16 by shape and rows, and greedy agreement.

    python tools/bench_fp8.py kernels --model /tmp/qwen3-8b            # H200: us per call
    python tools/bench_fp8.py kernels --model /tmp/qwen3-8b --sweep    # + every GEMV block
    python tools/bench_fp8.py agreement --model models/SmolLM2-135M-Instruct --device cpu

`kernels` reads a model folder's config.json for its projection shapes (qkv, o, gate_up,
down; random weights, nothing is loaded) and times, for each and each row count, one
projection in: bf16 through the matmul library, FP8 in our GEMV (kernels/fp8_gemv.py),
and FP8 through torch._scaled_mm with x quantised per row. As in tools/bench_gemv.py
each shape gets enough distinct weights to overflow the L2 cache several times over, one
CUDA graph runs them all, and "GB/s" is the weights' bytes over the time. The fastest FP8
path per row count is what GEMV_MAX_ROWS (quant/fp8.py) should follow.

`agreement` generates greedily from the same chat prompts with the model as it is and
with FP8 weights (`--quantization fp8`, or a folder from make_fp8_model.py given as
--fp8-model), and reports how much of the text stays the same: prompts identical to the
end, the tokens before the first difference, and the share of equal tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from common import add_device_args, parse

ROWS = [1, 2, 4, 8, 16, 64]
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "What is 17 times 23?",
    "Give me a short tip for learning a new language.",
    "Describe a cat to someone who has never seen one.",
    "Why do we have seasons?",
]


def time_graph(fn: Callable[[], object], reps: int = 20) -> float:
    """Seconds per call of `fn`, replayed from a CUDA graph."""
    fn()  # compiles, outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def shapes(model: str) -> dict[str, tuple[int, int, bool]]:
    """name -> (out features, in features, gated) of a model's projections, from its config."""
    c = json.loads((Path(model) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    h, i = c["hidden_size"], c["intermediate_size"]
    return {
        "qkv": ((heads + 2 * kv) * head_dim, h, False),
        "o": (h, heads * head_dim, False),
        "gate_up": (2 * i, h, True),
        "down": (h, i, False),
    }


def gemv_candidates(m: int, n: int, k: int, gated: bool) -> list[tuple[int, int, int, int]]:
    """GEMV blocks worth trying: accumulators of 16-128 fp32 per thread, K runs <= k."""
    from minisgl.kernels.fp8_gemv import fp8_gemv_blocks

    out = {fp8_gemv_blocks(m, n, k, 1, gated)}
    for block_n in (1, 2, 4, 8):
        for block_k in (256, 512, 1024, 2048):
            for warps in (1, 2, 4, 8):
                per_thread = m * block_n * block_k * (2 if gated else 1) // (32 * warps)
                if 16 <= per_thread <= 128 and block_k <= max(256, k):
                    out.add((1 << (m - 1).bit_length(), block_n, block_k, warps))
    return sorted(out)


def bench_kernels(args: argparse.Namespace) -> None:
    from minisgl.quant.fp8 import quantize_rows

    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, model {args.model}")
    print(
        "\n| shape | rows | bf16 library us | FP8 GEMV us | FP8 GEMV GB/s | FP8 _scaled_mm us "
        "| best FP8 | FP8 / bf16 |\n|---|---|---|---|---|---|---|---|"
    )
    for name, (n, k, gated) in shapes(args.model).items():
        copies = max(1, min(args.layers, -(-8 * l2 // (n * k))))  # FP8 bytes: n * k
        w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        w8 = [quantize_rows(w) for w in w16]
        for m in args.rows:
            lib, mm, gemv, best = time_shape(torch.randn(m, k, device=dev).bfloat16(), w16, w8,
                                             gated, args.sweep)  # fmt: skip
            shown = "-" if gemv is None else f"{gemv * 1e6:.1f}" + (f" {best}" if best else "")
            rate = "-" if gemv is None else f"{n * k / gemv / 1e9:.0f}"
            fp8 = mm if gemv is None else min(gemv, mm)
            print(
                f"| {name} {n}x{k} | {m} | {lib * 1e6:.1f} | {shown} | {rate} | {mm * 1e6:.1f} "
                f"| {'_scaled_mm' if fp8 == mm else 'GEMV'} | {fp8 / lib:.2f}x |"
            )


def time_shape(
    x: torch.Tensor, w16: list, w8: list, gated: bool, sweep: bool
) -> tuple[float, float, float | None, tuple | None]:
    """Seconds per projection of x: (bf16 library, FP8 _scaled_mm, FP8 GEMV or None where
    x has more rows than it takes, the GEMV's best blocks when swept)."""
    from minisgl.kernels.fp8_gemv import MAX_ROWS, fp8_gemv
    from minisgl.layers.activation import silu_and_mul
    from minisgl.quant.fp8 import scaled_mm_rows

    def gate(y: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(y) if gated else y

    m, k = x.shape
    n = w16[0].size(0)
    lib = time_graph(lambda: [gate(F.linear(x, w)) for w in w16]) / len(w16)
    mm = time_graph(lambda: [gate(scaled_mm_rows(x, q, s)) for q, s in w8]) / len(w8)
    if m > MAX_ROWS:
        return lib, mm, None, None
    times = {}
    for blocks in gemv_candidates(m, n // 2 if gated else n, k, gated) if sweep else [None]:

        def run(blocks: tuple | None = blocks) -> None:
            for q, s in w8:
                fp8_gemv(x, q, s, (1, k), gated=gated, blocks=blocks)

        times[blocks] = time_graph(run) / len(w8)
    best = min(times, key=times.__getitem__)
    return lib, mm, times[best], best


def chat_prompts(model: str, n: int) -> list[str]:
    """The first n of PROMPTS as user turns in the model's chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in PROMPTS[:n]
    ]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


def agreement(runs: list[list[int]], others: list[list[int]], max_tokens: int) -> str:
    """How much of the greedy text of `others` is that of `runs`, prompt by prompt, in words."""
    prefix = [first_difference(a, b) for a, b in zip(runs, others)]
    equal = sum(x == y for a, b in zip(runs, others) for x, y in zip(a, b))
    total = sum(len(a) for a in runs)
    whole = sum(p == max_tokens for p in prefix)
    return (
        f"{whole}/{len(prefix)} prompts identical to the end; median "
        f"{statistics.median(prefix):.0f} of {max_tokens} tokens before the first difference; "
        f"{equal}/{total} tokens equal ({100 * equal / total:.0f}%)"
    )


def bench_agreement(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = chat_prompts(args.model, args.prompts)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    runs = {}
    for label, path, quantization in [
        ("model", args.model, None),
        ("fp8", args.fp8_model or args.model, None if args.fp8_model else "fp8"),
    ]:
        llm = LLM(path, dtype=getattr(torch, args.dtype), device=args.device,
                  quantization=quantization, max_running_req=len(prompts))  # fmt: skip
        runs[label] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    for q, a, b in zip(PROMPTS, runs["model"], runs["fp8"]):
        same = first_difference(a, b)
        print(f"{q!r}: {same}/{len(a)} tokens before the first difference")
        if same < len(a):
            print(f"   model: {tok.decode(a)!r}\n   fp8:   {tok.decode(b)!r}")
    how = f"from {args.fp8_model}" if args.fp8_model else "per row, quantised on load"
    print(
        f"\n{args.model}, {args.dtype} on {args.device}, FP8 {how}: "
        f"{agreement(runs['model'], runs['fp8'], args.max_tokens)}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    k = sub.add_parser("kernels", help="FP8 kernels vs bf16 by shape and rows (GPU)")
    k.add_argument("--model", required=True, help="a model folder (its config.json only)")
    k.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=ROWS)
    k.add_argument("--layers", type=int, default=36, help="most weights per shape (a model's)")
    k.add_argument("--sweep", action="store_true", help="every GEMV block shape, best shown")
    a = sub.add_parser("agreement", help="greedy text with and without FP8 weights")
    a.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    a.add_argument("--fp8-model", help="an FP8 folder (make_fp8_model.py) instead of the flag")
    a.add_argument("--prompts", type=int, default=len(PROMPTS))
    a.add_argument("--max-tokens", type=int, default=32)
    for sp in (k, a):
        add_device_args(sp)
    args = parse(p)
    if args.command == "kernels":
        if not torch.cuda.is_available():
            p.error("kernels times GPU kernels: it needs a GPU")
        bench_kernels(args)
    else:
        bench_agreement(args)


if __name__ == "__main__":
    main()
