"""RMSNorm, residual add + RMSNorm and SiLU-and-mul: our Triton kernels against FlashInfer's
(where it is installed) and plain torch, on a model's shapes; and the fused q/k norm +
rotary + KV store (`qk_rope_store`) against the layers it replaces, at each tile size.

    python tools/bench_elementwise.py                                   # 0.6B and 8B, 1..2048 rows
    python tools/bench_elementwise.py --models qwen3-8b --rows 1,8
    python tools/bench_elementwise.py --models qwen3-0.6b --ops rope_store  # 1..8192 tokens
    python tools/bench_elementwise.py --device cpu --models tiny --rows 1,3 --reps 1 \\
        --rope-tokens 1,70 --rope-tiles 1,8  # smoke test

Each kernel is called CALLS times inside one CUDA graph and the replay timed (the median of
--reps), so a row is the time a call takes inside a captured decode step: at a few rows that
is mostly the kernel's own start, not its bytes. "first call" is the time the first call of
each took in this process, which is where a JIT compiler shows up (FlashInfer's the first time
on a machine, Triton's the first time a kernel is seen; both are cached on disk after that).
"max ulps" and "same bits" compare each with the layers' torch references.

`qk_rope_store`'s rows are tokens of a prefill chunk or a decode batch (random positions,
KV slots scattered over a pool twice as large). "ours" is the tile the launcher picks for
that many tokens; "tile N" forces N tokens a program, to see where each size wins. The
calls of a graph cycle through enough copies of qkv to overflow the L2 cache, so GB/s (qkv
read, q, k and v written, the angle rows read once per token) is the memory's, not L2's.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable

import torch
from common import add_device_args, parse
from make_random_model import SHAPES

TINY = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
MODELS = {**SHAPES, "tiny": dict(TINY, head_dim=16)}
CALLS = 100  # calls per graph: the replay's own start is shared out over them
ELEMENTWISE = ("rmsnorm", "add_rmsnorm", "silu_and_mul")


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


def rope_store_impls(
    shape: dict, tokens: int, tiles: list[int], cache_dtype, dtype, device
) -> tuple[int, dict[str, tuple[Callable, Callable, torch.Tensor]]]:
    """(bytes a call moves, impl -> (run once, its q, the layers' q)) for `qk_rope_store`."""
    from minisgl.kernels import rope_store
    from minisgl.layers.norm import RMSNorm
    from minisgl.layers.rotary import RotaryEmbedding

    hq, hkv, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    width = (hq + 2 * hkv) * d
    rope = RotaryEmbedding(d, 1e6, 32768, device)
    norms = [RMSNorm(d, 1e-6).to(device, dtype) for _ in range(2)]
    for norm in norms:
        norm.weight.data = (1 + 0.1 * torch.randn(d, device=device)).to(dtype)
    positions = torch.randint(0, 32768, (tokens,), device=device, dtype=torch.int32)
    out_loc = torch.randperm(2 * tokens, device=device)[:tokens].to(torch.int32)
    k_cache, v_cache = (
        torch.zeros(2 * tokens, hkv, d, device=device, dtype=cache_dtype) for _ in range(2)
    )
    qkv_bytes = tokens * width * dtype.itemsize
    copies = 1
    if device.type == "cuda":
        l2 = torch.cuda.get_device_properties(device).L2_cache_size
        copies = min(CALLS, math.ceil(2 * l2 / qkv_bytes))
    qkvs = [torch.randn(tokens, width, device=device, dtype=dtype) for _ in range(copies)]
    moved = (
        qkv_bytes  # read
        + tokens * hq * d * dtype.itemsize  # q written
        + tokens * 2 * hkv * d * cache_dtype.itemsize  # k and v stored
        + tokens * (rope.rotary_dim * 4 + 8)  # the angle row, the position and the slot
    )

    def layers(qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k = norms[0].reference(q.reshape(-1, hq, d)), norms[1].reference(k.reshape(-1, hkv, d))
        q, k = rope.reference(positions.long(), q, k)
        k_cache[out_loc.long()] = k.to(cache_dtype)
        v_cache[out_loc.long()] = v.reshape(-1, hkv, d).to(cache_dtype)
        return q

    def ours(qkv: torch.Tensor) -> torch.Tensor:
        return rope_store.qk_rope_store(
            qkv, positions, rope.cos_sin, norms[0].weight, norms[1].weight, 1e-6,
            k_cache, v_cache, out_loc, hq, hkv, d,
        )  # fmt: skip

    def tile(n: int) -> Callable:
        def forced(qkv: torch.Tensor) -> torch.Tensor:
            chosen = rope_store.tile_tokens
            rope_store.tile_tokens = lambda tokens: n
            try:
                return ours(qkv)
            finally:
                rope_store.tile_tokens = chosen

        return forced

    def cycling(fn: Callable) -> tuple[Callable, Callable]:
        out: dict[str, torch.Tensor] = {}
        calls = [0]

        def run() -> None:
            out["q"] = fn(qkvs[calls[0] % copies])
            calls[0] += 1

        return run, lambda: out["q"]

    with torch.no_grad():
        want = layers(qkvs[0])
    fns = {"torch": layers, "ours": ours, **{f"tile {n}": tile(n) for n in tiles}}
    impls = {}
    for name, fn in fns.items():
        run, result = cycling(fn)
        # each result is compared with the first copy's reference: its first call is on it
        impls[name] = (run, result, want)
    return moved, impls


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


def first_call(run: Callable, device: torch.device) -> float:
    """Seconds of one call, compiles included."""
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_device_args(p)
    p.add_argument("--models", default="qwen3-0.6b,qwen3-8b", help=f"of {', '.join(MODELS)}")
    p.add_argument("--ops", default=",".join([*ELEMENTWISE, "rope_store"]))
    p.add_argument("--rows", default="1,8,64,2048", help="of the norm and activation ops")
    p.add_argument("--rope-tokens", default="1,64,2048,8192", help="of rope_store")
    p.add_argument("--rope-tiles", default="1,8,16,32", help="tokens a program, forced")
    p.add_argument("--rope-cache", default="auto", help="auto (the model dtype), fp8_e4m3 or both")
    p.add_argument("--reps", type=int, default=20)
    args = parse(p)
    if args.device == "cpu":  # our kernels in Triton's interpreter; the times mean nothing
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    ops = args.ops.split(",")
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    where = (
        f"inside a CUDA graph ({CALLS} calls per graph)"
        if device.type == "cuda"
        else "(interpreted)"
    )
    print(f"{name}, {args.dtype}; us per call {where}\n")
    if set(ops) & set(ELEMENTWISE):
        print("| model | op | rows x cols | impl | us | first call, s | max ulps | same bits |")
        print("|---|---|---|---|---|---|---|---|")
    for model in args.models.split(",") if set(ops) & set(ELEMENTWISE) else []:
        hidden, inter = MODELS[model]["hidden_size"], MODELS[model]["intermediate_size"]
        for rows in (int(r) for r in args.rows.split(",")):
            for op, impls in implementations(hidden, inter, rows, dtype, device).items():
                if op not in ops:
                    continue
                cols = 2 * inter if op == "silu_and_mul" else hidden
                for impl, (run, result, want) in impls.items():
                    first = first_call(run, device)
                    ulps, same = compare(result(), want)
                    us = time_us(run, args.reps, device)
                    print(
                        f"| {model} | {op} | {rows}x{cols} | {impl} | {us:.2f} | {first:.2f} "
                        f"| {ulps:.0f} | {same:.1%} |",
                        flush=True,
                    )
    if "rope_store" in ops:
        bench_rope_store(args, device, dtype)


def bench_rope_store(args: argparse.Namespace, device: torch.device, dtype) -> None:
    from minisgl.kernels.rope_store import tile_tokens

    tiles = [int(t) for t in args.rope_tiles.split(",") if t]
    print("\nqk_rope_store: q/k head norms, rotary and the K/V store; GB/s of qkv read, q, k")
    print("and v written and an angle row a token\n")
    print("| model | tokens | KV cache | impl | us | GB/s | first call, s | max ulps | same bits |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        for cache in args.rope_cache.split(","):
            cache_dtype = dtype if cache == "auto" else torch.float8_e4m3fn
            for tokens in (int(t) for t in args.rope_tokens.split(",")):
                moved, impls = rope_store_impls(
                    MODELS[model], tokens, tiles, cache_dtype, dtype, device
                )
                for impl, (run, result, want) in impls.items():
                    first = first_call(run, device)
                    ulps, same = compare(result(), want)
                    us = time_us(run, args.reps, device)
                    label = f"ours (tile {tile_tokens(tokens)})" if impl == "ours" else impl
                    print(
                        f"| {model} | {tokens} | {str(cache_dtype).removeprefix('torch.')} "
                        f"| {label} | {us:.2f} | {moved / us / 1e3:.0f} | {first:.2f} "
                        f"| {ulps:.0f} | {same:.1%} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
