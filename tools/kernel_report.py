"""What the compiler made of our kernels for a Hopper GPU, read on a machine without one.

Triton compiles for a named target with no GPU present (`triton.compile` with a
`GPUTarget`), and the wheel carries NVIDIA's `ptxas`, `cuobjdump` and `nvdisasm`. So each
kernel below is built for sm_90 as a launch would specialize it (pointers and integers
multiples of 16, the engine's block shapes for the shape named), and the report gives, per
kernel:

- registers a thread and the stack frame (where spilled registers go; 0 is none);
- shared memory a program, and the programs that fit on one SM at once: the fewest of what
  its 65,536 registers, its 228 KB of shared memory and its 64 warps allow. A program that
  waits on its loads is hidden only by others on the same SM;
- the instructions of its longest loop (the walk over keys, or over K) a thread: all of
  them, tensor-core instructions, one-byte shared-memory reads (`LDS.U8`) and spill stores
  (a kernel whose loops the compiler unrolled has none: "-").

Times are for the GPU to measure; this says where to look, and what a change did to the
machine code (a kernel that uses fewer registers is not always faster: measure it).

    python tools/kernel_report.py
    python tools/kernel_report.py --only fp8,gated-delta
    pip install --no-deps --target /tmp/triton36 triton==3.6.0   # the GPU image's Triton
    PYTHONPATH=/tmp/triton36 python tools/kernel_report.py
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.pop("TRITON_INTERPRET", None)  # the interpreter never lowers a kernel

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

BIN = Path(triton.__path__[0]) / "backends" / "nvidia" / "bin"
SM_REGISTERS, SM_SHARED, SM_WARPS, SM_PROGRAMS = 65536, 228 * 1024, 64, 32  # an H100's or H200's


class Built(NamedTuple):
    path: Path  # the cubin
    shared: int  # bytes of shared memory a program asks for at launch (Triton's pipelines)


def build(kernel, consts: dict, pointers: dict, floats=(), out: Path | None = None, **options):
    """`kernel` compiled for sm_90, as a launch specializes it (pointers and integer arguments
    multiples of 16), its cubin written under `out`. Arguments not named in `consts`,
    `pointers` or `floats` are pointers to int32 if capitalised, else int32."""
    names = kernel.arg_names
    signature = {
        n: "constexpr"
        if n in consts
        else pointers.get(n) or ("fp32" if n in floats else "*i32" if n[0].isupper() else "i32")
        for n in names
    }
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if n not in consts and n not in floats and n != "window"
    }
    src = ASTSource(kernel, signature, consts, aligned)
    built = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    path = Path(out or tempfile.mkdtemp()) / f"{kernel.__name__}.cubin"
    path.write_bytes(built.asm["cubin"])
    return Built(path, built.metadata.shared)


def sass(built: Built) -> str:
    return subprocess.run(
        [str(BIN / "nvdisasm"), "-c", str(built.path)], capture_output=True, text=True, check=True
    ).stdout


def usage(built: Built) -> dict[str, int]:
    """{"REG": registers a thread, "STACK": its stack frame in bytes (where spills go),
    "SHARED": shared memory a program, static and asked for at launch}"""
    out = subprocess.run(
        [str(BIN / "cuobjdump"), "--dump-resource-usage", str(built.path)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    found = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED):(\d+)", out)}
    return found | {"SHARED": found.get("SHARED", 0) + built.shared}


def longest_loop(code: str) -> list[str]:
    """The instructions (opcodes with modifiers) between the target and the branch of the
    longest backward branch: a kernel's main loop."""
    at: dict[str, int] = {}
    ins: list[tuple[int, str]] = []
    label = None
    for line in code.splitlines():
        if m := re.match(r"\s*\.(L_x_\d+):", line):
            label = m.group(1)
            continue
        if m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*?);", line):
            addr = int(m.group(1), 16)
            ins.append((addr, m.group(2) + m.group(3)))
            if label:
                at[label], label = addr, None
    loops = [
        (at[m.group(1)], addr)
        for addr, text in ins
        if (m := re.search(r"BRA\s+`?\(?\.(L_x_\d+)", text)) and at.get(m.group(1), addr) < addr
    ]
    if not loops:
        return []
    start, end = max(loops, key=lambda span: span[1] - span[0])
    return [text.split()[0] for addr, text in ins if start <= addr <= end]


def report(name: str, built: Built, warps: int) -> str:
    used, loop = usage(built), longest_loop(sass(built))
    regs = -(-used["REG"] // 8) * 8  # allocated in units of 8 a thread
    fit = min(
        SM_REGISTERS // (regs * 32 * warps),
        SM_SHARED // max(used["SHARED"], 1),
        SM_WARPS // warps,
        SM_PROGRAMS,
    )
    ops = collections.Counter(op.split(".")[0] for op in loop)
    mma = ops["HMMA"] + ops["HGMMA"]
    byte_reads = sum(1 for op in loop if op.startswith("LDS.U8"))
    counts = f"{len(loop)} | {mma} | {byte_reads} | {ops['STL']}" if loop else "- | - | - | -"
    return (
        f"| {name} | {used['REG']} | {used['STACK']} | {used['SHARED'] / 1024:.1f} | {fit} "
        f"| {counts} |"
    )


# ---- the kernels, at the engine's launches for the shapes named --------------------------

ATTN_FLOATS = {"eps", "sm_scale", "k_inv", "v_inv", "v_scale"}


def attention(kv: str, out: Path) -> list[str]:
    """The fused decode (the default) and the split decode at Qwen3-0.6B's heads (16 query, 8
    KV, 128 channels), batch 256's launch (64 keys a block over e4m3, 32 over bf16; 2 warps)."""
    from minisgl.kernels.decode_attention import _decode_split_kernel
    from minisgl.kernels.fused_decode import _decode_qkv_kernel

    cache = {"bf16": "*bf16", "fp8": "*fp8e4nv"}[kv]
    pointers = {"K": cache, "V": cache, "OutPartial": "*fp32", "LsePartial": "*fp32"}
    pointers |= {n: "*bf16" for n in ("QKV", "Q", "Out", "QW", "KW")} | {"CosSin": "*fp32"}
    shape = dict(GROUP=2, BLOCK_H=16, BLOCK_N=64 if kv == "fp8" else 32, HEAD_DIM=128,
                 BLOCK_D=128, NUM_SPLITS=1, IEEE=False, FP16_DOTS=kv == "fp8")  # fmt: skip
    fused = dict(Q_HEADS=16, KV_HEADS=8, MIN_SPLIT=128, QK_NORM=True)
    rows = []
    for kernel, more, what in (
        (_decode_qkv_kernel, fused, "fused decode"),
        (_decode_split_kernel, {}, "split decode"),
    ):
        path = build(kernel, shape | more, pointers, ATTN_FLOATS, out, num_warps=2)
        rows.append(report(f"{what}, Qwen3-0.6B heads, {kv} K/V", path, 2))
    if kv == "fp8":  # launches `sweep_attention.py --registers` may try: more programs an SM
        for keys, warps in ((64, 4), (32, 2)):
            path = build(_decode_qkv_kernel, shape | fused | {"BLOCK_N": keys}, pointers,
                         ATTN_FLOATS, out, num_warps=warps, maxnreg=128)  # fmt: skip
            label = f"fused decode, fp8 K/V, {keys} keys, {warps} warps, at most 128 registers"
            rows.append(report(label, path, warps))
    return rows


# >>> ch31 the linear layers of Qwen3.5
def gated_delta(out: Path) -> list[str]:
    """The linear layers' fused decode at Qwen3.5-0.8B's heads (16 and 16) and the 9B's (16
    and 32), 8 warps, as the compiler leaves it and capped at 128 registers (the default)."""
    from minisgl.kernels.gated_delta import _decode_kernel

    pointers = {n: "*bf16" for n in _decode_kernel.arg_names if n[0].isupper()}
    pointers |= {"SSM": "*fp32", "ALog": "*fp32", "DtBias": "*fp32", "NormW": "*fp32"}
    pointers |= {"Slots": "*i32"}
    rows = []
    for per_key, model in ((1, "0.8B"), (2, "9B")):
        consts = dict(KEY_DIM=16 * 128, DK=128, DV=128, PER_KEY=per_key, WIDTH=4,
                      BLOCK_DK=128, BLOCK_DV=128, BLOCK_W=4, EARLY=False)  # fmt: skip
        for cap in (None, 128):
            options = {"num_warps": 8} | ({"maxnreg": cap} if cap else {})
            path = build(_decode_kernel, consts, pointers, {"eps", "scale"}, out, **options)
            label = f"gated delta decode, Qwen3.5-{model}" + (f", at most {cap}" if cap else "")
            rows.append(report(label, path, 8))
    return rows


# <<< ch31
def gemv(out: Path) -> list[str]:
    """The GEMV at one row and the tensor cores' at up to 16, on Qwen3-0.6B's qkv (4096 x
    1024, its norm folded in), each with the first of its start-up candidates."""
    from minisgl.kernels.gemv import _gemv_kernel, gemv_candidates
    from minisgl.kernels.gemv_mma import _mma_gemv_kernel, mma_candidates

    pointers = {n: "*bf16" for n in ("X", "W", "Y", "BIAS", "R", "R_OUT", "NW")}
    pointers |= {"M": "i32", "N": "i32", "K": "i32"}
    flags = dict(HAS_BIAS=False, GATED=False, NORM=True)
    bm, bn, bk, warps = gemv_candidates(1, 4096, 1024)[0]
    consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, M=1, **flags)
    rows = [
        report(
            f"GEMV, 1 row, Qwen3-0.6B qkv ({bn} x {bk}, {warps} warp)",
            build(_gemv_kernel, consts, pointers, {"eps"}, out, num_warps=warps),
            warps,
        )
    ]
    blocks = mma_candidates(4096, 1024)[0]
    consts = dict(BLOCK_N=blocks.block_n, BLOCK_K=blocks.block_k, EVEN_K=True,
                  PRECISION="tf32", **flags)  # fmt: skip
    path = build(_mma_gemv_kernel, consts, pointers, {"eps"}, out, num_warps=blocks.warps,
                 num_stages=blocks.stages)  # fmt: skip
    label = f"tensor-core GEMV, 16 rows, Qwen3-0.6B qkv ({blocks.block_n} x {blocks.block_k})"
    return rows + [report(label, path, blocks.warps)]


GROUPS = {
    "attention": lambda out: attention("bf16", out),
    "fp8": lambda out: attention("fp8", out),
    "gated-delta": gated_delta,  # [ch31]
    "gemv": gemv,
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", default=",".join(GROUPS), help=f"of {', '.join(GROUPS)}")
    args = p.parse_args(argv)
    groups = [g for g in args.only.split(",") if g]
    if unknown := [g for g in groups if g not in GROUPS]:
        raise SystemExit(f"unknown group {unknown[0]!r}: one of {', '.join(GROUPS)}")
    print(f"sm_90, Triton {triton.__version__}; per thread, and programs an SM (of 65,536")
    print("registers, 228 KB of shared memory, 64 warps, 32 programs); the loop: its")
    print("instructions a thread\n")
    print("| kernel | registers | stack B | shared KB | programs an SM | loop | tensor core "
          "| byte reads from shared | spill stores |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for group in groups:
            for row in GROUPS[group](Path(tmp)):
                print(row, flush=True)


if __name__ == "__main__":
    main()
