"""Linear layers of a few tokens: the matmul library (cuBLAS through F.linear) against our GEMV.

    python tools/bench_gemv.py                      # Qwen3-0.6B's projections at 1, 2, 4 rows
    python tools/bench_gemv.py --models qwen3-0.6b,qwen3-8b,qwen3-14b,qwen3-30b-a3b --rows 1,2,4,8
    python tools/bench_gemv.py --models qwen3-8b --sweep   # every block shape, best per layer
    python tools/bench_gemv.py --device cpu --models tiny --rows 1 --reps 1  # smoke test

Each projection of a model (qkv, o, gate_up with SiLU-and-mul after it, down, the MoE
router, the LM head) is timed exactly as the engine's start-up measurement times it
(`engine/kernel_choice.py`): the library's path against each of `gemv_candidates`' block
shapes, replayed from a CUDA graph over enough distinct weights of the shape to overflow the
L2 cache many times, as a model's layers do. "chosen" is what the engine would run there (the
GEMV where it takes at most 95% of the library's time); "step" adds a shape up over a model's
layers: the projections of one decode step, by the library alone and by the choice. GB/s is
the weight bytes over the time; the H200 reads about 4.8 TB/s.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from types import SimpleNamespace

import torch
from common import add_device_args, parse
from make_random_model import SHAPES as MODELS

from minisgl.engine.kernel_choice import build_first, candidates, gemv_label, pick, time_in_graph
from minisgl.layers.kernel_plan import KernelPlan
from minisgl.layers.triton_ops import GemvKey, ProjectionCall

MODELS = {**MODELS, "tiny": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512)}  # fmt: skip


def projections(spec: dict, normed: bool = False) -> dict[str, tuple[GemvKey, int]]:
    """name -> (the GEMV's view of the projection, how many a decode step runs). normed: as
    the engine records them, the residual add and RMSNorm before qkv and gate_up folded in."""
    h, layers, hd = spec["hidden_size"], spec["num_hidden_layers"], spec["head_dim"]
    q, kv = spec["num_attention_heads"] * hd, spec["num_key_value_heads"] * hd
    out = {
        "qkv": (GemvKey(q + 2 * kv, h, False, normed, False), layers),
        "o": (GemvKey(h, q, False, False, False), layers),
    }
    if "num_experts" in spec:  # every layer a mixture of experts: the router is the projection
        out["router"] = (GemvKey(spec["num_experts"], h, False, False, False), layers)
    else:
        inter = spec["intermediate_size"]
        out["gate_up"] = (GemvKey(inter, h, True, normed, False), layers)
        out["down"] = (GemvKey(h, inter, False, False, False), layers)
    out["lm_head"] = (GemvKey(spec["vocab_size"], h, False, False, False), 1)
    return out


def weights_for(key: GemvKey, dtype: torch.dtype, device: torch.device, min_bytes: float):
    rows = key.n * (1 + key.gated)
    count = max(2, math.ceil(min_bytes / (rows * key.k * dtype.itemsize)))
    count = count if device.type == "cuda" else 1
    return [torch.randn(rows, key.k, device=device, dtype=dtype) * 0.02 for _ in range(count)]


def timer(reps: int, device: torch.device):
    def time_it(label: str, run) -> float:
        if device.type == "cuda":
            return time_in_graph(label, run, reps)
        start = time.perf_counter()
        run()
        return time.perf_counter() - start

    return time_it


def sweep_blocks(m: int, key: GemvKey) -> list[tuple[int, int, int, int]]:
    """Block shapes worth a try: at most 128 partial sums a thread, K blocks no longer than
    twice the row."""
    out: list = []
    # >>> ch26 the tensor cores' launches from two rows up, past the CUDA cores' rows alone
    from minisgl.kernels.gemv import FMA_ROWS
    from minisgl.kernels.gemv_mma import MmaBlocks

    if m > 1:  # tiles whose pipelined steps fit in shared memory (160 KB of the 228)
        for bn, bk, warps, stages in itertools.product([16, 32, 64, 128], [64, 128, 256, 512, 1024],
                                                       [2, 4], [1, 2, 3, 4]):  # fmt: skip
            staged = (bn * (1 + key.gated) + 16) * bk * 2 * stages
            if bk <= max(128, 1 << (key.k - 1).bit_length()) and staged <= 160 * 1024:
                out.append(MmaBlocks(bn, bk, warps, stages))
    if m > FMA_ROWS:
        return out
    # <<< ch26
    bm = 1 << (m - 1).bit_length()
    for bn, bk, warps in itertools.product([1, 2, 4, 8], [128, 256, 512, 1024, 2048, 4096],
                                           [1, 2, 4, 8]):  # fmt: skip
        if (
            bk <= 2 * (1 << (key.k - 1).bit_length())
            and bm * bn * bk * (1 + key.gated) <= 128 * 32 * warps
        ):
            out.append((bm, bn, bk, warps))
    return out


def sweep(key: GemvKey, weights: list[torch.Tensor], m: int, time_it) -> dict[tuple, float]:
    """us per call of the GEMV in every block shape `sweep_blocks` offers."""
    from minisgl.kernels.gemv import gemv

    x = torch.randn(m, key.k, device=weights[0].device, dtype=weights[0].dtype)
    norm = (torch.randn_like(x), torch.empty_like(x), torch.ones_like(x[0]), 1e-6)

    def run(blocks: tuple[int, int, int, int]) -> None:
        for w in weights:
            gemv(x, w, blocks=blocks, gated=key.gated, norm=norm if key.normed else None)

    blocks_tried = sweep_blocks(m, key)
    build_first([lambda b=b: run(b) for b in blocks_tried], x.device)  # builds in parallel
    return {b: time_it(str(b), lambda b=b: run(b)) / len(weights) * 1e6 for b in blocks_tried}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_device_args(p)
    p.add_argument("--models", default="qwen3-0.6b", help=f"of {', '.join(MODELS)}")
    p.add_argument("--rows", default="1,2,4")
    p.add_argument("--sweep", action="store_true", help="also every block shape, at --sweep-rows")
    p.add_argument("--sweep-rows", default="1")
    p.add_argument("--min-bytes", type=float, default=512e6, help="weights per shape at least")
    p.add_argument("--normed", action="store_true", help="qkv and gate_up with their norm folded")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--output-json")
    args = parse(p)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    # the library's path runs the norm and SiLU-and-mul kernels an engine on our attention has
    kernels = KernelPlan.at_start(device, dtype, SimpleNamespace(name="triton"))
    kernels.install(torch.nn.Module())  # SiLU-and-mul's kernel
    torch.manual_seed(0)
    time_it, rows_list = timer(args.reps, device), [int(r) for r in args.rows.split(",")]
    sweep_rows = [int(r) for r in args.sweep_rows.split(",")] if args.sweep else []
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, {args.dtype}; us per call, GB/s of weights in brackets\n")
    print("| model | layer | out x in | rows | library | GEMV candidates | chosen | vs library |")
    print("|---|---|---|---|---|---|---|---|")
    results: dict = {}
    for model in args.models.split(","):
        step: dict[int, list[float]] = {m: [0.0, 0.0] for m in rows_list}  # library, chosen
        nbytes = 0
        for layer, (key, count) in projections(MODELS[model], args.normed).items():
            weights = weights_for(key, dtype, device, args.min_bytes)
            norm_weight = torch.ones(key.k, device=device, dtype=dtype) if key.normed else None
            call = ProjectionCall(key, weights[0], None, norm_weight, 1e-6)
            size = weights[0].nbytes
            nbytes += size * count
            for m in rows_list:
                runs = candidates(call, weights, m, kernels)
                us = {c: time_it(c, run) / len(weights) * 1e6 for c, (_, run) in runs.items()}
                chosen = pick(us)
                step[m][0] += us["library"] * count
                step[m][1] += us[chosen] * count
                gemvs = ", ".join(f"{c[5:]} {t:.1f}" for c, t in us.items() if c != "library")
                print(
                    f"| {model} | {layer} | {key.n * (1 + key.gated)}x{key.k}"
                    f"{' gated' if key.gated else ''} | {m} | {us['library']:.1f} "
                    f"({size / us['library'] / 1e3:.0f}) | {gemvs} | {chosen} "
                    f"({size / us[chosen] / 1e3:.0f}) | {us['library'] / us[chosen]:.2f}x |",
                    flush=True,
                )
                results[f"{model} {layer} m={m}"] = us
            for m in sweep_rows:
                swept = sweep(key, weights, m, time_it)
                best = sorted(swept, key=swept.__getitem__)[:3]
                print(
                    f"|   sweep | {layer} rows {m}: best of {len(swept)} shapes: "
                    + ", ".join(
                        f"{gemv_label(b)[5:]} {swept[b]:.1f} us ({size / swept[b] / 1e3:.0f} GB/s)"
                        for b in best
                    )
                    + " |"
                )
                results[f"{model} {layer} m={m} sweep"] = {str(b): t for b, t in swept.items()}
        for m in rows_list:
            lib, ours = step[m]
            print(
                f"| {model} | step: every layer's projections | {nbytes / 1e9:.2f} GB | {m} "
                f"| {lib / 1e3:.3f} ms ({nbytes / lib / 1e3:.0f}) | | {ours / 1e3:.3f} ms "
                f"({nbytes / ours / 1e3:.0f}) | {lib / ours:.2f}x |",
                flush=True,
            )
            results[f"{model} step m={m}"] = {"library_ms": lib / 1e3, "chosen_ms": ours / 1e3}
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
