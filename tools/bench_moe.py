"""Fused MoE vs the reference loop over experts, on one MoE layer's experts.

Side by side in one run, for the same tokens and routing: the reference loop
(`Experts.forward_reference`: a host read of the counts, then two matmuls per chosen
expert), the fused Triton kernel launched eagerly, and the fused kernel replayed from a
CUDA graph (which the loop cannot be). Next to each time: the bandwidth it achieves
reading the weights of the experts that were chosen, each once, which is the least a
decode step must move; the H200 reads about 4.8 TB/s.

    python tools/bench_moe.py                    # GPU: Qwen3-30B-A3B experts, 64 tokens
    python tools/bench_moe.py --device cpu \\
        --experts 8 --top-k 2 --hidden 64 --inter 32 --tokens 7 --iters 2 --warmup 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from common import add_device_args, parse

from minisgl.layers.moe import Experts


def time_ms(fn: Callable[[], object], device: torch.device, iters: int, warmup: int) -> float:
    """Median ms of one call: CUDA events on the GPU, the wall clock on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="a decode batch: one token each")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768, help="each expert's intermediate size")
    add_device_args(ap)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--block-n", type=int, default=64, help="output columns per program")
    ap.add_argument("--block-k", type=int, default=64, help="reduction step of the kernel")
    ap.add_argument("--seed", type=int, default=0)
    args = parse(ap)
    device = torch.device(args.device)
    if device.type == "cpu":  # Triton compiles for GPUs; on the CPU it interprets, if told early
        os.environ["TRITON_INTERPRET"] = "1"
    from minisgl.kernels.moe import fused_moe  # imports triton

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)

    with torch.device(device):
        experts = Experts(args.experts, args.hidden, args.inter).to(dtype)
        for w in (experts.gate_up_proj, experts.down_proj):
            torch.nn.init.normal_(w, std=w.size(-1) ** -0.5)  # outputs of unit scale
        x = torch.randn(args.tokens, args.hidden, dtype=dtype)
        router = torch.randn(args.tokens, args.experts).softmax(dim=-1)
    weights, ids = router.topk(args.top_k, dim=-1)
    weights = (weights / weights.sum(dim=-1, keepdim=True)).to(dtype)

    blocks = dict(block_n=args.block_n, block_k=args.block_k)
    fused = lambda: fused_moe(x, experts.gate_up_proj, experts.down_proj, ids, weights, **blocks)
    reference = lambda: experts.forward_reference(x, ids, weights)
    runs: dict[str, Callable[[], object]] = {"reference loop": reference, "fused": fused}
    with torch.inference_mode():
        error = (fused().float() - reference().float()).abs().max().item()
        if device.type == "cuda":
            fused()  # build the kernels before capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fused()
            runs["fused, CUDA graph"] = graph.replay
        ms = {label: time_ms(fn, device, args.iters, args.warmup) for label, fn in runs.items()}

    used = ids.unique().numel()
    weight_bytes = used * (experts.gate_up_proj[0].nbytes + experts.down_proj[0].nbytes)
    print(
        f"{args.tokens} tokens, {args.experts} experts, top-{args.top_k}, hidden {args.hidden}, "
        f"expert intermediate {args.inter}, {args.dtype} on {device.type}"
        f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}: "
        f"{used} experts chosen, {weight_bytes / 1e6:.1f} MB of their weights; "
        f"max |fused - reference| = {error:.2e}\n"
    )
    print("| path | ms | weights GB/s | vs reference loop |\n|---|---|---|---|")
    for label, t in ms.items():
        gbs = weight_bytes / (t * 1e-3) / 1e9
        print(f"| {label} | {t:.3f} | {gbs:.3g} | {ms['reference loop'] / t:.3g}x |")


if __name__ == "__main__":
    main()
