"""Attention alone: decode and prefill time of each backend, side by side in one run.

One attention layer over a paged KV pool whose rows own scattered pages, the way the
allocator hands them out. Decode is timed the way the engine runs it, inside a CUDA graph
(captured through the backend's own graph hooks, so metadata copies stay outside), for
every (batch size, context length); backends without graph support are timed eagerly.
Prefill is timed eagerly: a batch of prompts, each `--prefill-len` new tokens over a
cached prefix of `--prefix-len` tokens. The default shape is Qwen3-0.6B's (16 query heads,
8 KV heads, head_dim 128).

    python tools/bench_attention.py --backends fi,triton,torch
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from common import add_device_args, parse

from minisgl.attention.registry import select_backend
from minisgl.core import Batch, Req, SamplingParams
from minisgl.kvcache.mha_pool import MHAKVCache


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


class Pool:
    """A one-layer KV pool of random K/V and a page table with shuffled pages per row."""

    def __init__(self, args: argparse.Namespace, rows: int, width: int) -> None:
        dev, ps = args.device, args.page_size
        width = math.ceil(width / ps) * ps
        num_pages = rows * width // ps
        self.kv = MHAKVCache(1, num_pages, ps, args.kv_heads, args.head_dim, args.dtype, dev)
        self.kv.k_cache(0).normal_()
        self.kv.v_cache(0).normal_()
        pages = torch.randperm(num_pages, device=dev).view(rows, width // ps)
        slots = pages[:, :, None] * ps + torch.arange(ps, device=dev)
        self.table = slots.flatten(1).to(torch.int32)

    def batch(self, args, phase: str, bs: int, new: int, prefix: int) -> Batch:
        """`bs` requests in rows 0..bs-1, each `prefix` cached tokens and `new` to compute."""
        reqs = [
            Req(torch.zeros(prefix + new, dtype=torch.int32), i, prefix, 1, i, SamplingParams())
            for i in range(bs)
        ]
        batch = Batch(reqs, phase)  # type: ignore[arg-type]
        batch.out_loc = self.table[:bs, prefix : prefix + new].flatten().contiguous()
        return batch

    def qkv(self, args, tokens: int) -> tuple[torch.Tensor, ...]:
        q = torch.randn(tokens, args.q_heads, args.head_dim, dtype=args.dtype, device=args.device)
        k = torch.randn(tokens, args.kv_heads, args.head_dim, dtype=args.dtype, device=args.device)
        return q, k, torch.randn_like(k)


def time_cuda(fn, iters: int) -> float:
    """ms per call, CUDA events around `iters` calls after two warm-ups."""
    fn()
    fn()
    if not torch.cuda.is_available():  # the CPU smoke test of this tool
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def decode_ms(cls, pool: Pool, args, bs: int, ctx: int) -> float:
    backend = cls(pool.kv, pool.table, args.head_dim**-0.5, args.q_heads)
    batch = pool.batch(args, "decode", bs, 1, ctx)
    q, k, v = pool.qkv(args, bs)

    def run() -> None:
        backend.forward(q, k, v, 0, batch)

    if "decode" not in cls.cuda_graphs or args.device.type != "cuda":
        backend.prepare_metadata(batch)
        return time_cuda(run, args.iters)
    backend.init_capture_graph(max_seq_len=pool.table.size(1), bs_list=[bs])
    backend.prepare_metadata(batch)
    live = batch.attn_metadata
    backend.prepare_for_capture(batch)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm-up outside the capture: lazy initialisation
    torch.cuda.current_stream().wait_stream(stream)
    graph, repeats = torch.cuda.CUDAGraph(), 20  # one replay runs the layer 20 times
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(repeats):
            run()
    captured, batch.attn_metadata = batch.attn_metadata, live
    backend.prepare_for_replay(batch)  # the live lengths into the static buffers
    batch.attn_metadata = captured
    return time_cuda(graph.replay, max(1, args.iters // repeats)) / repeats


def prefill_ms(cls, pool: Pool, args, bs: int) -> float:
    backend = cls(pool.kv, pool.table, args.head_dim**-0.5, args.q_heads)
    batch = pool.batch(args, "prefill", bs, args.prefill_len, args.prefix_len)
    q, k, v = pool.qkv(args, bs * args.prefill_len)
    backend.prepare_metadata(batch)
    return time_cuda(lambda: backend.forward(q, k, v, 0, batch), max(3, args.iters // 10))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backends", default="fi,triton,torch")
    p.add_argument("--q-heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--batch-sizes", type=ints, default=[1, 8, 32, 128, 256])
    p.add_argument("--context-lens", type=ints, default=[512, 2048, 8192])
    p.add_argument("--prefill-batches", type=ints, default=[1, 4, 16])
    p.add_argument("--prefill-len", type=int, default=512, help="new tokens per prompt")
    p.add_argument("--prefix-len", type=int, default=0, help="cached tokens before them")
    p.add_argument(
        "--torch-max-tokens",
        type=int,
        default=2**19,
        help="skip the torch backend above this many batch x context tokens",
    )
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--output-json", default=None)
    add_device_args(p)  # cpu: a smoke test (the Triton backend wants TRITON_INTERPRET=1)
    args = parse(p)
    args.dtype = getattr(torch, args.dtype)
    dev = args.device = torch.device(args.device)
    classes = {
        n: select_backend(n, dev, args.dtype, args.page_size) for n in args.backends.split(",")
    }
    names = list(classes)
    first = names[0]
    rows = max(max(args.batch_sizes), max(args.prefill_batches))
    width = max(max(args.context_lens) + 1, args.prefix_len + args.prefill_len)
    pool = Pool(args, rows, width)
    where = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(
        f"{where}, {args.dtype}, q/kv heads {args.q_heads}/{args.kv_heads}, "
        f"head_dim {args.head_dim}, page size {args.page_size}; decode in CUDA graphs where "
        "the backend supports them"
    )
    results: dict[str, dict] = {"decode": {}, "prefill": {}}
    print(
        f"\ndecode, us per layer call\n\n| batch | context | {' | '.join(names)} | "
        + " | ".join(f"{n} / {first}" for n in names[1:])
        + " |"
    )
    print("|---" * (2 + 2 * len(names) - 1) + "|")
    for bs in args.batch_sizes:
        for ctx in args.context_lens:
            row = {}
            for name, cls in classes.items():
                if name == "torch" and bs * ctx > args.torch_max_tokens:
                    continue
                row[name] = decode_ms(cls, pool, args, bs, ctx) * 1e3
            results["decode"][f"{bs}x{ctx}"] = row
            cells = [f"{row[n]:.1f}" if n in row else "-" for n in names]
            ratios = [f"{row[n] / row[first]:.2f}x" if n in row else "-" for n in names[1:]]
            print(f"| {bs} | {ctx} | {' | '.join(cells)} | {' | '.join(ratios)} |")
    print(
        f"\nprefill, {args.prefill_len} new tokens per prompt over {args.prefix_len} cached, "
        f"us per layer call\n\n| prompts | {' | '.join(names)} | "
        + " | ".join(f"{n} / {first}" for n in names[1:])
        + " |"
    )
    print("|---" * (1 + 2 * len(names) - 1) + "|")
    for bs in args.prefill_batches:
        row = {}
        for name, cls in classes.items():
            if name == "torch" and bs * width > args.torch_max_tokens * 4:
                continue
            row[name] = prefill_ms(cls, pool, args, bs) * 1e3
        results["prefill"][str(bs)] = row
        cells = [f"{row[n]:.1f}" if n in row else "-" for n in names]
        ratios = [f"{row[n] / row[first]:.2f}x" if n in row else "-" for n in names[1:]]
        print(f"| {bs} | {' | '.join(cells)} | {' | '.join(ratios)} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
