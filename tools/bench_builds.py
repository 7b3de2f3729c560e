"""How long Triton takes to build our GEMV for a GPU, one build after another and in threads.

    python tools/bench_builds.py                     # 8 variants for sm_90, 1 and 2 threads
    python tools/bench_builds.py --threads 1,4,16 --variants 16

No GPU is needed: Triton compiles for a target named here (the H200's sm_90), through the
same LLVM and ptxas a start-up runs, into a fresh cache directory for every run. Each run
builds distinct block shapes of `_gemv_kernel` (the start-up kernel choice's candidates are
such variants), and every run starts from an empty cache; runs alternate, thread counts in
turn. Printed: seconds a run (the median over rounds) and the speed-up over the first count.
The start-up's `build_first` (engine/kernel_choice.py) relies on it: builds in threads
overlap.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

SIGNATURE = {
    **dict.fromkeys(["X", "W", "Y", "BIAS", "R", "R_OUT", "NW"], "*bf16"),
    "eps": "fp32",
    **dict.fromkeys(["M", "N", "K", "stride_xm", "stride_wn", "stride_ym"], "i32"),
}
# (BLOCK_M, BLOCK_N, BLOCK_K, GATED, NORM): block shapes of the kind gemv_candidates proposes
SHAPES = [(m, n, k, g, norm) for m in (1, 2, 4, 8) for n, k in ((8, 1024), (4, 512))
          for g, norm in ((0, 1), (1, 0))]  # fmt: skip


def build(variant: tuple[int, int, int, int, int], arch: int) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from minisgl.kernels.gemv import _gemv_kernel

    m, n, k, gated, norm = variant
    constants = dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, HAS_BIAS=0, GATED=gated, NORM=norm)
    signature = {**SIGNATURE, **dict.fromkeys(constants, "constexpr")}
    source = ASTSource(_gemv_kernel, signature, constants)
    triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 1})


def one_run(variants: list, threads: int, arch: int) -> float:
    """Seconds to build every variant into an empty cache (Triton reads the directory from
    the environment at each build)."""
    with tempfile.TemporaryDirectory(prefix="bench_builds_") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda v: build(v, arch), variants))
        return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    p.add_argument("--variants", type=int, default=8, help=f"builds a run, at most {len(SHAPES)}")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--arch", type=int, default=90, help="compute capability: 90 for the H200")
    args = p.parse_args()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    os.environ["TRITON_INTERPRET"] = "0"  # compiled, even where tests interpret kernels
    counts = [int(t) for t in args.threads.split(",")]
    variants = SHAPES[: args.variants]
    one_run(variants[:1], 1, args.arch)  # imports and Triton's own start-up, untimed
    times: dict[int, list[float]] = {t: [] for t in counts}
    for _ in range(args.rounds):
        for t in counts:
            times[t].append(one_run(variants, t, args.arch))
    print(f"{len(variants)} builds of _gemv_kernel for sm_{args.arch}, {os.cpu_count()} CPUs; "
          f"medians of {args.rounds} alternating rounds")  # fmt: skip
    print("| threads | s a run | speed-up |")
    print("|---|---|---|")
    base = statistics.median(times[counts[0]])
    for t in counts:
        s = statistics.median(times[t])
        print(f"| {t} | {s:.2f} | {base / s:.2f}x |")


if __name__ == "__main__":
    main()
