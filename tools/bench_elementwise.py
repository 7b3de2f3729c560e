"""RMSNorm, residual add + RMSNorm and SiLU-and-mul: our Triton kernels against FlashInfer's
(where it is installed) and plain torch, on a model's shapes.

    python tools/bench_elementwise.py                                   # 0.6B and 8B, 1..2048 rows
    python tools/bench_elementwise.py --models qwen3-8b --rows 1,8
    python tools/bench_elementwise.py --device cpu --models tiny --rows 1,3 --reps 1  # smoke test

Each kernel is called CALLS times inside one CUDA graph and the replay timed (the median of
--reps), so a row is the time a call takes inside a captured decode step: at a few rows that
is mostly the kernel's own start, not its bytes. "first call" is the time the first call of
each took in this process, which is where a JIT compiler shows up (FlashInfer's the first time
on a machine, Triton's the first time a kernel is seen; both are cached on disk after that).
"max ulps" and "same bits" compare each with the layers' torch references.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
from common import add_device_args, parse
from make_random_model import SHAPES

MODELS = {**SHAPES, "tiny": dict(hidden_size=64, intermediate_size=96)}
CALLS = 100  # calls per graph: the replay's own start is shared out over them


def implementations(hidden: int, inter: int, rows: int, dtype, device) -> dict[str, dict]:
    """op -> impl -> (run once, its output, the reference's output)."""
    from minisgl.kernels import elementwise as ours
    from minisgl.layers.activation import silu_and_mul_reference
    from minisgl.layers.norm import RMSNorm

    norm = RMSNorm(hidden, 1e-6).to(device)
    norm.weight.data = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    w, eps = norm.weight.data, norm.eps
    x = torch.randn(rows, hidden, device=device, dtype=dtype)
    r = torch.randn(rows, hidden, device=device, dtype=dtype)
    gate_up = torch.randn(rows, 2 * inter, device=device, dtype=dtype)
    fi = _flashinfer() if device.type == "cuda" else None

    def add_norm(fn: Callable) -> tuple[Callable, Callable]:
        bufs = x.clone(), r.clone()

        def run():
            bufs[0].copy_(x), bufs[1].copy_(r)  # the same input at every call
            fn(*bufs)

        return run, lambda: bufs[0]

    def torch_add_norm(a, b):
        b.add_(a)
        a.copy_(norm.reference(b))

    ops: dict[str, dict] = {"rmsnorm": {}, "add_rmsnorm": {}, "silu_and_mul": {}}
    ops["rmsnorm"]["ours"] = lambda: ours.rmsnorm(x, w, eps)
    ops["rmsnorm"]["torch"] = lambda: norm.reference(x)
    ops["add_rmsnorm"]["ours"] = add_norm(lambda a, b: ours.fused_add_rmsnorm(a, b, w, eps))
    ops["add_rmsnorm"]["torch"] = add_norm(torch_add_norm)
    ops["silu_and_mul"]["ours"] = lambda: ours.silu_and_mul(gate_up)
    ops["silu_and_mul"]["torch"] = lambda: silu_and_mul_reference(gate_up)
    if fi is not None:
        ops["rmsnorm"]["flashinfer"] = lambda: fi.norm.rmsnorm(x, w, eps)
        ops["add_rmsnorm"]["flashinfer"] = add_norm(
            lambda a, b: fi.norm.fused_add_rmsnorm(a, b, w, eps)
        )
        ops["silu_and_mul"]["flashinfer"] = lambda: fi.activation.silu_and_mul(gate_up)
    want = {
        "rmsnorm": norm.reference(x),
        "add_rmsnorm": norm.reference(x + r),
        "silu_and_mul": silu_and_mul_reference(gate_up),
    }
    return {
        op: {
            name: (*(f if isinstance(f, tuple) else _keep(f)), want[op])
            for name, f in impls.items()
        }
        for op, impls in ops.items()
    }


def _keep(fn: Callable) -> tuple[Callable, Callable]:
    """(run fn, the output of its last run): for the ops that return a new tensor."""
    out: dict[str, torch.Tensor] = {}

    def run() -> None:
        out["y"] = fn()

    return run, lambda: out["y"]


def _flashinfer():
    try:
        import flashinfer
    except ImportError:
        return None
    return flashinfer


def compare(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(most units in the last place apart, share of values equal to the bit)."""
    info = torch.finfo(want.dtype)
    w = want.detach().float()
    ulp = info.eps * torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(info.tiny))))
    return ((got.float() - w).abs() / ulp).max().item(), (got == want).float().mean().item()


def time_us(run: Callable, reps: int, device: torch.device) -> float:
    if device.type != "cuda":
        start = time.perf_counter()
        run()
        return (time.perf_counter() - start) * 1e6
    from minisgl.engine.kernel_choice import time_in_graph

    def many():
        for _ in range(CALLS):
            run()

    return time_in_graph("elementwise", many, reps) / CALLS * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_device_args(p)
    p.add_argument("--models", default="qwen3-0.6b,qwen3-8b", help=f"of {', '.join(MODELS)}")
    p.add_argument("--rows", default="1,8,64,2048")
    p.add_argument("--reps", type=int, default=20)
    args = parse(p)
    if args.device == "cpu":  # our kernels in Triton's interpreter; the times mean nothing
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    where = (
        f"inside a CUDA graph ({CALLS} calls per graph)"
        if device.type == "cuda"
        else "(interpreted)"
    )
    print(f"{name}, {args.dtype}; us per call {where}\n")
    print("| model | op | rows x cols | impl | us | first call, s | max ulps | same bits |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        hidden, inter = MODELS[model]["hidden_size"], MODELS[model]["intermediate_size"]
        for rows in (int(r) for r in args.rows.split(",")):
            for op, impls in implementations(hidden, inter, rows, dtype, device).items():
                cols = 2 * inter if op == "silu_and_mul" else hidden
                for impl, (run, result, want) in impls.items():
                    start = time.perf_counter()
                    run()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    first = time.perf_counter() - start
                    ulps, same = compare(result(), want)
                    us = time_us(run, args.reps, device)
                    print(
                        f"| {model} | {op} | {rows}x{cols} | {impl} | {us:.2f} | {first:.2f} "
                        f"| {ulps:.0f} | {same:.1%} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
