"""Our attention kernels' launch blocks, swept: which keys-per-block, warps and pipeline
stages read the KV cache fastest, for each cache dtype.

Decode is the fused kernel the engine runs (kernels/fused_decode.py: rotary, the KV store,
split-KV attention and the merge), timed inside a CUDA graph of 20 calls for each
(batch, context), with its bytes of K/V per call turned into TB/s; `--kernel split` times
the split-KV attention and merge alone (kernels/decode_attention.py, what Gemma 4's layers
run), over the last `--window` positions if given. Extend is one prompt of
`--extend-lens` new tokens with no cached prefix, as a chunked prefill's first chunk,
timed eagerly, as TFLOP/s of the causal half. Verify (`--verify`) is a batch of requests
that each bring `tokens` new tokens (a verify's last token and its drafts) after a context,
timed in a CUDA graph: the extend kernel as the engine launches it, then the split kernel
(kernels/verify_attention.py) at each of `--verify-block-tokens` new tokens a program and
`--verify-min-split` keys a range at least, under each launch. Each table row is one launch;
the current default is marked. A launch that does not compile (too much shared memory) is listed as
failed. Defaults change in kernels/attention.py (`decode_launch`, `extend_launch`) only
after a sweep on the GPU.

    python tools/sweep_attention.py --kv-dtypes bfloat16,fp8_e4m3 --decode 256x1024,64x1024
    python tools/sweep_attention.py --kernel split --q-heads 8 --kv-heads 2 --head-dim 256 \
        --window 512 --kv-dtypes bfloat16 --decode 128x1024,256x1024 --extend-lens ""
    python tools/sweep_attention.py --q-heads 9 --kv-heads 3 --head-dim 64 --decode "" \
        --extend-lens "" --kv-dtypes bfloat16 --verify 1x137x9,1x521x9,1x2057x9,4x521x9
    TRITON_INTERPRET=1 python tools/sweep_attention.py --device cpu --smoke
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
from common import add_device_args, parse

from minisgl.kernels import attention as attn
from minisgl.kernels.decode_attention import decode_attention
from minisgl.kernels.extend_attention import extend_attention
from minisgl.kernels.fused_decode import decode_attention_qkv
from minisgl.kernels.rope_store import qk_rope_store
from minisgl.kernels.tile_fit import fit_launch
from minisgl.kernels.verify_attention import verify_attention, verify_attention_qkv

KV_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "fp8_e4m3": torch.float8_e4m3fn}


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def timed(fn, iters: int, graph: bool) -> float:
    """ms per call of fn: a CUDA graph of 20 calls replayed, or eager calls timed."""
    fn()
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            for _ in range(20):
                fn()
        call, per = g.replay, 20
    else:
        call, per = fn, 1
    call()
    if not torch.cuda.is_available():
        began = time.perf_counter()
        for _ in range(iters):
            call()
        return (time.perf_counter() - began) / iters / per * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters / per


class Shape:
    """A layer's tensors: the KV pool of `slots` tokens in `kv_dtype`, shuffled slots."""

    def __init__(self, args: argparse.Namespace, kv_dtype: torch.dtype, rows: int, width: int):
        dev, self.args = args.device, args
        h, kv, d = args.q_heads, args.kv_heads, args.head_dim
        slots = rows * width + 1
        self.k = torch.randn(slots, kv, d, device=dev).to(kv_dtype)
        self.v = torch.randn(slots, kv, d, device=dev).to(kv_dtype)
        self.table = torch.randperm(slots - 1, device=dev).view(rows, width).to(torch.int32)
        self.cos_sin = torch.randn(width + 1, d, device=dev)
        self.qw = torch.rand(d, device=dev, dtype=args.dtype) + 0.5
        self.kw = torch.rand(d, device=dev, dtype=args.dtype) + 0.5
        self.width = (h + 2 * kv) * d

    def decode(self, bs: int, ctx: int):
        a, dev = self.args, self.args.device
        qkv = torch.randn(bs, self.width, device=dev, dtype=a.dtype)
        rows = torch.arange(bs, dtype=torch.int32, device=dev)
        seq_lens = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
        positions = (seq_lens - 1).long()
        out_loc = self.table[rows.long(), ctx - 1].long()

        def run() -> torch.Tensor:
            return decode_attention_qkv(
                qkv, positions, self.cos_sin, self.qw, self.kw, 1e-6, self.k, self.v, out_loc,
                self.table, rows, seq_lens, a.head_dim**-0.5, a.q_heads, a.kv_heads, a.head_dim,
            )  # fmt: skip

        def split() -> torch.Tensor:
            return decode_attention(
                q, self.k, self.v, self.table, rows, seq_lens, a.head_dim**-0.5, a.window
            )

        q = qkv[:, : a.q_heads * a.head_dim].view(bs, a.q_heads, a.head_dim)
        return split if a.kernel == "split" else run

    def extend(self, length: int):
        a, dev = self.args, self.args.device
        q = torch.randn(length, a.q_heads, a.head_dim, device=dev, dtype=a.dtype)
        rows = torch.zeros(1, dtype=torch.int32, device=dev)
        seq_lens = torch.full((1,), length, dtype=torch.int32, device=dev)
        qo = torch.tensor([0, length], dtype=torch.int32, device=dev)

        def run() -> torch.Tensor:
            return extend_attention(
                q, self.k, self.v, self.table, rows, seq_lens, qo, length, a.head_dim**-0.5
            )

        return run

    def verify(self, bs: int, ctx: int, tokens: int):
        """(extend, split, the layer's two launches, its one from qkv, split's two launches):
        `bs` requests of `tokens` new tokens each, the last of `ctx`; the last three start
        from qkv (Qwen3's head norms, rotary, the new keys stored): extend after
        qk_rope_store (MINISGL_VERIFY_ATTN=extend), the split kernel's qkv variant, and the split
        kernel after qk_rope_store."""
        a, dev = self.args, self.args.device
        qkv = torch.randn(bs * tokens, self.width, device=dev, dtype=a.dtype)
        q = qkv[:, : a.q_heads * a.head_dim].view(bs * tokens, a.q_heads, a.head_dim)
        rows = torch.arange(bs, dtype=torch.int32, device=dev)
        seq_lens = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
        qo = torch.arange(0, bs * tokens + 1, tokens, dtype=torch.int32, device=dev)
        new = torch.arange(ctx - tokens, ctx, device=dev)
        positions = new.repeat(bs)
        out_loc = self.table[rows.long()][:, new].flatten().long()
        rope = (qkv, positions, self.cos_sin, self.qw, self.kw, 1e-6, self.k, self.v, out_loc)
        heads = (a.q_heads, a.kv_heads, a.head_dim)
        meta = (self.table, rows, seq_lens, qo, tokens, a.head_dim**-0.5)

        def two() -> torch.Tensor:
            return extend_attention(qk_rope_store(*rope, *heads), self.k, self.v, *meta)

        def apart() -> torch.Tensor:
            return verify_attention(qk_rope_store(*rope, *heads), self.k, self.v, *meta)

        return (
            lambda: extend_attention(q, self.k, self.v, *meta),
            lambda: verify_attention(q, self.k, self.v, *meta),
            two,
            lambda: verify_attention_qkv(*rope, *meta, *heads),
            apart,
        )


def sweep_verify(args, shape, bs: int, ctx: int, tokens: int, kv_dtype, graph: bool) -> list:
    """The extend kernel's time, then the split kernel's under every setting and launch."""
    from minisgl.kernels import verify_attention as va

    extend, split, two, one, apart = shape.verify(bs, ctx, tokens)
    base = timed(extend, args.iters, graph)
    found = [{"kernel": "extend", "ms": base}]
    print(f"extend (MINISGL_VERIFY_ATTN=extend): {base * 1e3:.1f} us")
    two_ms, one_ms = timed(two, args.iters, graph), timed(one, args.iters, graph)
    found[0].update(rope_store_then_extend_ms=two_ms, from_qkv_ms=one_ms)
    print(f"from qkv: rotary and store then extend {two_ms * 1e3:.1f} us, the split kernel's"
          f" one launch {one_ms * 1e3:.1f} us ({two_ms / one_ms:.2f}x)")  # fmt: skip
    print("| tokens a program | min keys a range | block_n | warps | stages | us | vs extend |"
          " from qkv: one launch, us | rotary and store then split, us |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    launches = [None] + [
        attn.Launch(n, w, s or None)
        for n, w, s in itertools.product(args.block_n, args.warps, args.stages)
    ]
    saved = va.BLOCK_TOKENS, va.MIN_SPLIT
    try:
        for block_tokens, min_split in itertools.product(
            args.verify_block_tokens, args.verify_min_split
        ):
            va.BLOCK_TOKENS, va.MIN_SPLIT = block_tokens or None, min_split
            for launch in launches:
                try:
                    layer = ("", "")
                    if launch is None:  # as the engine launches it; and the layer from qkv
                        ms = timed(split, args.iters, graph)
                        one_ms = timed(one, args.iters, graph)
                        apart_ms = timed(apart, args.iters, graph)
                        layer = (f"{one_ms * 1e3:.1f}", f"{apart_ms * 1e3:.1f}")
                    else:
                        with attn.launch_override("decode", launch):
                            ms = timed(split, args.iters, graph)
                except Exception as e:  # out of shared memory  # noqa: BLE001
                    print(f"  {block_tokens}, {min_split}, {launch}: failed ({type(e).__name__})")
                    continue
                n, w, st = (launch.block_n, launch.warps, launch.stages) if launch else ("-",) * 3
                took = va.verify_blocks(args.q_heads // args.kv_heads, tokens, args.head_dim)[0]
                print(f"| {took} | {min_split} | {n} | {w} | {st} | "
                      f"{ms * 1e3:.1f} | {base / ms:.2f}x | {layer[0]} | {layer[1]} |")  # fmt: skip
                found.append({"block_tokens": block_tokens, "min_split": min_split,
                              "launch": vars(launch) if launch else None, "ms": ms})  # fmt: skip
                if launch is None:
                    found[-1].update(from_qkv_ms=one_ms, rope_store_then_split_ms=apart_ms)
    finally:
        va.BLOCK_TOKENS, va.MIN_SPLIT = saved
    best = min(found[1:], key=lambda r: r["ms"], default=None)
    if best:
        gain = base / best["ms"]
        print(f"best {best['ms'] * 1e3:.1f} us ({gain:.2f}x the extend kernel): {best}")
    return found


def sweep(kind: str, launches: list[attn.Launch], default: attn.Launch, fn, iters, graph, work):
    """[(launch, ms or None)] for each launch, the default first."""
    rows = []
    for launch in [default, *[x for x in launches if x != default]]:
        try:
            with attn.launch_override(kind, launch):
                ms = timed(fn, iters, graph)
        except Exception as e:  # out of shared memory, or no such layout  # noqa: BLE001
            print(f"  {launch}: failed ({type(e).__name__}: {str(e).splitlines()[0][:80]})")
            ms = None
        rows.append((launch, ms))
    best = min((ms for _, ms in rows if ms is not None), default=None)
    print(f"| block_m | block_n | warps | stages | registers | us | {work[1]} | vs default |")
    print("|---|---|---|---|---|---|---|---|")
    base = rows[0][1]
    for launch, ms in sorted(rows, key=lambda r: (r[1] is None, r[1] or 0.0)):
        mark = " (default)" if launch == default else ""
        if ms is None:
            print(f"| {launch.block_m} | {launch.block_n} | {launch.warps} | {launch.stages} | "
                  f"{launch.registers or '-'} | failed | | |{mark}")  # fmt: skip
            continue
        rate = work[0] / (ms * 1e-3) / 1e12
        print(
            f"| {launch.block_m} | {launch.block_n} | {launch.warps} | {launch.stages} | "
            f"{launch.registers or '-'} | {ms * 1e3:.1f} | {rate:.2f} | "
            f"{base / ms if base else 0:.2f}x |{mark}"
        )
    print(f"best {best * 1e3:.1f} us" if best else "nothing ran")
    return [{"launch": vars(x), "ms": ms} for x, ms in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--q-heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--kernel", choices=["fused", "split"], default="fused", help="decode's")
    p.add_argument("--window", type=int, help="split: attend the last WINDOW positions only")
    p.add_argument("--kv-dtypes", default="bfloat16,fp8_e4m3", help=", ".join(KV_DTYPES))
    p.add_argument("--decode", default="256x1024,64x1024", help="BATCHxCONTEXT,...")
    p.add_argument("--extend-lens", type=lambda t: ints(t) if t else [], default=[2048, 8192])
    p.add_argument("--block-n", type=ints, default=[32, 64, 128])
    p.add_argument("--warps", type=ints, default=[2, 4, 8])
    p.add_argument("--stages", type=ints, default=[0, 2, 3, 4], help="0: Triton's default")
    p.add_argument(
        "--registers", type=ints, default=[0], help="decode: caps a thread, 0: the compiler's"
    )
    p.add_argument("--extend-block-m", type=ints, default=[64, 128])
    p.add_argument("--extend-block-n", type=ints, default=[32, 64, 128])
    p.add_argument("--extend-warps", type=ints, default=[4, 8])
    p.add_argument("--extend-stages", type=ints, default=[0, 2, 3])
    p.add_argument("--extend-kv-dtypes", help="default: --kv-dtypes")
    p.add_argument("--verify", default="", help="BATCHxCONTEXTxTOKENS,...: verify batches")
    p.add_argument("--verify-block-tokens", type=ints, default=[0, 4, 2],
                   help="new tokens a program (0: as the engine takes them)")  # fmt: skip
    p.add_argument("--verify-min-split", type=ints, default=[128, 256, 512])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="tiny sizes and two launches (CPU)")
    p.add_argument("--output-json")
    add_device_args(p)
    args = parse(p)
    args.dtype = getattr(torch, args.dtype)
    args.device = torch.device(args.device)
    graph = args.device.type == "cuda"
    decode = [tuple(int(x) for x in s.split("x")) for s in args.decode.split(",") if s]
    verify = [tuple(int(x) for x in s.split("x")) for s in args.verify.split(",") if s]
    if args.smoke:
        decode, args.extend_lens, args.iters = [(2, 40)], [24], 1
        verify, args.verify_block_tokens, args.verify_min_split = [(2, 40, 5)], [0, 2], [16]
        args.block_n, args.warps, args.stages, args.registers = [16, 32], [2], [0], [0]
        args.extend_block_m, args.extend_block_n = [16], [16, 32]
        args.extend_warps, args.extend_stages = [4], [0]
    where = torch.cuda.get_device_name() if graph else "cpu"
    heads = f"{args.q_heads}/{args.kv_heads}x{args.head_dim}"
    print(f"{where}, {args.dtype} activations, q/kv heads {heads}")
    results: dict[str, list] = {}
    d = args.head_dim
    for name in args.kv_dtypes.split(","):
        kv_dtype = KV_DTYPES[name]
        for bs, ctx in decode:
            shape = Shape(args, kv_dtype, bs, ctx)
            launches = [
                attn.Launch(n, w, s or None, registers=r)
                for n, w, s, r in itertools.product(
                    args.block_n, args.warps, args.stages, args.registers
                )
            ]
            print(f"\n== decode, K/V {name}, batch {bs} x context {ctx}, {args.kernel} kernel")
            read = min(ctx, args.window or ctx) if args.kernel == "split" else ctx
            work = (2 * bs * read * args.kv_heads * d * kv_dtype.itemsize, "TB/s of K/V")
            default = attn.decode_launch(bs, kv_dtype)  # as the engine launches it:
            default = fit_launch(default, args.q_heads // args.kv_heads, d, args.dtype, kv_dtype)
            results[f"decode {name} {bs}x{ctx}"] = sweep(
                "decode", launches, default, shape.decode(bs, ctx), args.iters, graph, work
            )
            del shape
    for name in args.kv_dtypes.split(","):
        for bs, ctx, tokens in verify:
            shape = Shape(args, KV_DTYPES[name], bs, ctx)
            print(f"\n== verify, K/V {name}, batch {bs} x {tokens} new tokens, context {ctx}")
            results[f"verify {name} {bs}x{ctx}x{tokens}"] = sweep_verify(
                args, shape, bs, ctx, tokens, KV_DTYPES[name], graph
            )
            del shape
    for name in (args.extend_kv_dtypes or args.kv_dtypes).split(","):
        kv_dtype = KV_DTYPES[name]
        for length in args.extend_lens:
            shape = Shape(args, kv_dtype, 1, length)
            launches = [
                attn.Launch(n, w, s or None, block_m=m)
                for m, n, w, s in itertools.product(
                    args.extend_block_m, args.extend_block_n, args.extend_warps, args.extend_stages
                )
            ]
            print(f"\n== extend, K/V {name}, one prompt of {length} new tokens")
            flops = 2 * 2 * length * (length + 1) / 2 * d * args.q_heads
            default = attn.extend_launch(length, kv_dtype)
            results[f"extend {name} {length}"] = sweep(
                "extend", launches, default, shape.extend(length), args.iters, False,
                (flops, "TFLOP/s"),
            )  # fmt: skip
            del shape
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
