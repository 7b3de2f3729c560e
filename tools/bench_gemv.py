"""Batch-1 linear layers: the matmul library (cuBLAS through F.linear) against our GEMV.

    python tools/bench_gemv.py                      # Qwen3-0.6B's layer shapes, H200
    python tools/bench_gemv.py --sweep              # every block shape, best one per layer
    python tools/bench_gemv.py --device cpu --layers 2   # a smoke test (TRITON_INTERPRET=1)

Each layer shape gets enough distinct weight matrices that together they are far larger
than the GPU's L2 cache (50 MB on an H200), as the 28 layers of a model are; one CUDA
graph runs the op over all of them, and the time per call is the graph's time over the
calls. "GB/s" is the weight bytes over that time. `--sweep` also tries every block shape
of the GEMV kernel and prints the best per layer shape and rows.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time

import torch
import torch.nn.functional as F
from common import add_device_args, parse

SHAPES = {  # name -> (out features, in features), Qwen3-0.6B
    "qkv": (4096, 1024),
    "o": (1024, 2048),
    "gate_up": (6144, 1024),
    "down": (1024, 3072),
    "lm_head": (151936, 1024),
}


def time_graph(fn, device: torch.device, reps: int) -> float:
    """Seconds per call of `fn` (which runs the op over every weight), from a CUDA graph."""
    if device.type != "cuda":
        fn()
        return float("nan")
    fn()  # compile / warm up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_device_args(p)
    p.add_argument("--rows", default="1,2,4")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--layers", type=int, default=28, help="distinct weights of a 'layer' run")
    p.add_argument("--min-bytes", type=float, default=512e6, help="weights per shape at least")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--output-json")
    args = parse(p)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    from minisgl.kernels.gemv import gemv, gemv_blocks

    torch.manual_seed(0)
    weights = {}
    for name, (n, k) in SHAPES.items():
        count = max(2, math.ceil(args.min_bytes / (n * k * dtype.itemsize)))
        count = count if device.type == "cuda" else 1
        weights[name] = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(count)]
    results: dict = {"shapes": {}, "layers": {}}
    rows_list = [int(r) for r in args.rows.split(",")]
    configs = list(itertools.product([1, 2, 4, 8, 16, 32], [128, 256, 512, 1024], [1, 2, 4, 8]))
    for name, ws in weights.items():
        n, k = SHAPES[name]
        for m in rows_list:
            x = torch.randn(m, k, device=device, dtype=dtype)
            ref = F.linear(x, ws[0]).float()
            err = (gemv(x, ws[0]).float() - ref).abs().max().item() / ref.abs().max().item()
            nbytes = sum(w.numel() * w.element_size() for w in ws)
            row = {"error": err}

            def run_lib(x=x, ws=ws):
                for w in ws:
                    F.linear(x, w)

            def run_gemv(x=x, ws=ws, blocks=None):
                for w in ws:
                    gemv(x, w, blocks=blocks)

            for label, fn in (("cublas", run_lib), ("gemv", run_gemv)):
                t = time_graph(fn, device, args.reps) / len(ws)
                row[label] = {"us": t * 1e6, "gbps": nbytes / len(ws) / t / 1e9}
            if args.sweep and m == 1 and device.type == "cuda":
                best = None
                for bn, bk, warps in configs:
                    if bk > 2 * triton_next_pow2(k) or m * bn * bk > 32768:
                        continue
                    blocks = (triton_next_pow2(m), bn, bk, warps)
                    t = time_graph(lambda b=blocks: run_gemv(blocks=b), device, 5) / len(ws)
                    if best is None or t < best[0]:
                        best = (t, blocks)
                row["best"] = {"us": best[0] * 1e6, "blocks": best[1]}
            row["default_blocks"] = gemv_blocks(m, n, k)
            results["shapes"][f"{name} m={m}"] = row
            best = row.get("best")
            best_txt = f"  best {best['us']:7.2f} us {best['blocks']}" if best else ""
            print(
                f"{name:8s} m={m} [{n}x{k}]  cublas {row['cublas']['us']:7.2f} us "
                f"{row['cublas']['gbps']:6.0f} GB/s   gemv {row['gemv']['us']:7.2f} us "
                f"{row['gemv']['gbps']:6.0f} GB/s  err {err:.1e}{best_txt}",
                flush=True,
            )
    # A model's layer stack: the four projections of `--layers` layers, distinct weights.
    for m in rows_list:
        stack = [[weights[s][i % len(weights[s])] for s in ("qkv", "o", "gate_up", "down")]
                 for i in range(args.layers)]  # fmt: skip
        xs = {s: torch.randn(m, SHAPES[s][1], device=device, dtype=dtype) for s in SHAPES}

        def layers(op, stack=stack, xs=xs):
            for ws in stack:
                for s, w in zip(("qkv", "o", "gate_up", "down"), ws):
                    op(xs[s], w)

        t_lib = time_graph(lambda: layers(F.linear), device, args.reps)
        t_gemv = time_graph(lambda: layers(gemv), device, args.reps)
        nbytes = sum(w.numel() * w.element_size() for ws in stack for w in ws)
        results["layers"][m] = {"cublas_ms": t_lib * 1e3, "gemv_ms": t_gemv * 1e3}
        print(
            f"{args.layers} layers m={m}: cublas {t_lib * 1e3:.3f} ms "
            f"({nbytes / t_lib / 1e9:.0f} GB/s), gemv {t_gemv * 1e3:.3f} ms "
            f"({nbytes / t_gemv / 1e9:.0f} GB/s)",
            flush=True,
        )
    # The host's price of a graph launch, by the kind of kernel in it: the torch profiler
    # inflates it, so it is timed here with the host's clock alone.
    if device.type == "cuda":
        x = torch.randn(1, 1024, device=device, dtype=dtype)
        w = weights["qkv"][0]
        kinds = {
            "cublas": lambda: F.linear(x, w),
            "triton gemv": lambda: gemv(x, w),
            "torch add": lambda: x.add(1.0),
        }
        results["launch"] = {}
        for label, op in kinds.items():
            for nodes in (100, 300):
                graph = torch.cuda.CUDAGraph()
                op()
                torch.cuda.synchronize()
                with torch.cuda.graph(graph):
                    for _ in range(nodes):
                        op()
                host = []
                for _ in range(30):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    graph.replay()
                    host.append(time.perf_counter() - start)
                torch.cuda.synchronize()
                us = sorted(host)[len(host) // 2] * 1e6
                results["launch"][f"{label} x{nodes}"] = us
                print(f"graph launch, {nodes} {label} kernels: {us:.1f} us of host", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


if __name__ == "__main__":
    main()
