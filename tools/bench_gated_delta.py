"""One Gated DeltaNet layer on Qwen3.5's shapes: the torch reference against our Triton kernels
(and fla-core's, where `import fla` works), decode and prefill, with a table.

    python tools/bench_gated_delta.py              # 0.8B, 9B; decode 1..256; prefill 1x4096, 8x512
    python tools/bench_gated_delta.py --models 9b --decode 64 --prefill 1x4096
    python tools/bench_gated_delta.py --dry-run    # the cases it would run, nothing built
    python tools/bench_gated_delta.py --device cpu --models tiny --decode 1,3 --prefill 2x5 \\
        --rounds 1 --calls 1  # smoke test: our kernels interpreted, the times mean nothing

The shapes: 16 key heads and 16 (Qwen3.5-0.8B, 2B) or 32 (4B, 9B, the MoE models) value heads
of 128, a conv of width 4. What is timed is the layer between its projections: from the
outputs of in_proj_qkv, in_proj_z, in_proj_a and in_proj_b (the same for every side, left out)
to the gated, normalised output that goes into out_proj, states read from and written to
their slots in a state pool. The sides:
- torch: the layer's reference path (the default), the chunked delta rule for a prefill;
- ours: kernels/gated_delta.py (MINISGL_GATED_DELTA=triton): one kernel a decode step
  ("ours, split N": two, the recurrence's programs holding N value columns each:
  MINISGL_GATED_DELTA_DECODE=split; `--split-columns 16,32,64:2` compares several, 64:2
  with 2 warps a program; "ours, fused, at most R registers": the one kernel with its
  registers capped at R a thread (MINISGL_GATED_DELTA_REGISTERS, 128 by default),
  `--fused-registers 0,96` compares others, 0 the compiler's choice); a
  prefill's conv, conv-state update and chunked recurrence (16 tokens a step), then the
  gated norm; "ours, by token" is the same with the token-by-token recurrence, "ours, two
  passes" with kernels/gated_delta_chunks.py's (every chunk's own work at once, then the
  walks, 64 tokens a step: MINISGL_GATED_DELTA_PREFILL=two-pass);
- fla: fla-core's `fused_recurrent_gated_delta_rule` (decode) and `chunk_gated_delta_rule`
  (prefill, with cu_seqlens) on q, k, v, g and beta already made, states in a dense tensor:
  the recurrence alone, without the conv, the gates, the slots or the norm. A lower bound
  for a layer built on it, not the same work.

Decode: each side is captured CALLS times in one CUDA graph and the replay timed (the engine
replays decode steps as graphs), the calls cycling over enough layers of the pool that the
states do not stay in the L2 cache; GB/s counts each request's state and conv state read and
written once, which is the floor's traffic (the H200 copies at about 4.2 TB/s). Prefill: one
call timed with events, eagerly. Every round times each side once, in turn (ABAB...), after a
warm-up of each; a row is the median over --rounds. "max diff" compares each side's output
with torch's from the same states (relative to the output's size).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
from collections.abc import Callable
from types import SimpleNamespace

import torch
from common import add_device_args, parse

from minisgl.models.families import LinearAttention

MODELS = {
    "0.8b": LinearAttention(16, 16, 128, 128, 4),  # also 2B
    "9b": LinearAttention(16, 32, 128, 128, 4),  # also 4B, 35B-A3B, Qwen3-Next
    "tiny": LinearAttention(2, 4, 16, 32, 4),  # for a smoke test on the CPU
}
Case = tuple[str, str, list[int]]  # (model, "decode" or "prefill", each request's tokens)


def cases(args: argparse.Namespace) -> list[Case]:
    out: list[Case] = []
    for model in args.models.split(","):
        if model not in MODELS:
            raise SystemExit(f"unknown model {model!r}: one of {', '.join(MODELS)}")
        for bs in (int(b) for b in args.decode.split(",") if b):
            out.append((model, "decode", [1] * bs))
        for spec in (p for p in args.prefill.split(",") if p):
            reqs, tokens = (int(n) for n in spec.lower().split("x"))
            out.append((model, "prefill", [tokens] * reqs))
    return out


def fla_ops() -> tuple[Callable, Callable, str] | None:
    """(fused_recurrent, chunk, version) of fla-core's gated delta rule, or None."""
    try:
        import fla
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )
    except ImportError:
        return None
    return fused_recurrent_gated_delta_rule, chunk_gated_delta_rule, fla.__version__


class Setup:
    """One case: a layer with random weights, a state pool, the projections' outputs."""

    def __init__(self, shape: LinearAttention, lengths: list[int], dtype, device, layers: int):
        from minisgl.kvcache.state_pool import RecurrentStatePool
        from minisgl.layers.gated_deltanet import GatedDeltaNet

        s, gen = shape, torch.Generator(device).manual_seed(0)
        self.shape, self.lengths, self.device = s, lengths, device
        reqs, tokens = len(lengths), sum(lengths)
        with torch.device(device):
            self.layer = GatedDeltaNet(64, s, 1e-6, index=0).to(dtype)
        with torch.no_grad():
            for p in self.layer.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, device=device) * 0.1)
            self.layer.A_log.uniform_(-2.0, 0.5, generator=gen)
            self.layer.norm.weight.add_(1.0)
        self.pool = RecurrentStatePool(layers, reqs + 1, s, dtype, device)
        self.pool.ssm.normal_(0, 0.1, generator=gen)
        self.pool.conv.normal_(0, 1.0, generator=gen)
        value_dim = s.num_value_heads * s.value_head_dim

        def rand(*size: int) -> torch.Tensor:
            return torch.randn(size, generator=gen, device=device).to(dtype)

        self.qkv, self.z = rand(tokens, s.conv_dim), rand(tokens, value_dim)
        self.a, self.b = rand(tokens, s.num_value_heads), rand(tokens, s.num_value_heads)
        offsets = torch.tensor([0, *lengths], device=device).cumsum(0)
        slots = torch.randperm(reqs, generator=torch.Generator().manual_seed(0)).to(device)
        self.batch = SimpleNamespace(
            state_slots=slots, state_offsets=offsets, padded_size=reqs,
            padded_reqs=[SimpleNamespace(extend_len=n) for n in lengths],
            is_decode=max(lengths) == 1, phase="decode" if max(lengths) == 1 else "prefill",
        )  # fmt: skip

    def side(self, kernels: str) -> Callable[[], torch.Tensor]:
        method = self.layer._kernels if kernels == "triton" else self.layer._reference
        return lambda: method(self.qkv, self.z, self.b, self.a, self.batch, self.pool)

    def prefill_with(self, rule: str) -> Callable[[], torch.Tensor]:
        """Our prefill with another recurrence in place of the chunked one: "by token"
        (`recurrent_varlen`) or "two passes" (`gated_delta_chunks.chunks_varlen`)."""
        from minisgl.kernels import gated_delta, gated_delta_chunks

        layer, b = self.layer, self.batch
        recurrence = {
            "by token": gated_delta.recurrent_varlen,
            "two passes": gated_delta_chunks.chunks_varlen,
        }[rule]

        def run() -> torch.Tensor:
            conv, ssm = self.pool.conv[layer.index], self.pool.ssm[layer.index]
            weight = layer.conv1d.weight.squeeze(1)
            mixed = gated_delta.conv_varlen(self.qkv, weight, conv, b.state_slots, b.state_offsets)
            o = recurrence(
                mixed, self.a, self.b, layer.A_log, layer.dt_bias, ssm, b.state_slots,
                b.state_offsets, self.shape,
            ).to(self.qkv.dtype)  # fmt: skip
            return layer.norm(o, self.z.view_as(o))

        return run

    def decode_split(self, columns: str) -> Callable[[], torch.Tensor]:
        """Our decode step in two kernels, the recurrence's programs holding `columns` value
        columns each, "C" or "C:WARPS" (MINISGL_GATED_DELTA_DECODE=split, kernels/
        gated_delta.py's SPLIT_DV and SPLIT_WARPS)."""
        from minisgl.kernels import gated_delta

        cols, _, warps = columns.partition(":")
        mine = (True, int(cols), int(warps or gated_delta.SPLIT_WARPS))

        def run() -> torch.Tensor:
            was = self.pool.split_decode, gated_delta.SPLIT_DV, gated_delta.SPLIT_WARPS
            self.pool.split_decode, gated_delta.SPLIT_DV, gated_delta.SPLIT_WARPS = mine
            try:
                return self.side("triton")()
            finally:
                self.pool.split_decode, gated_delta.SPLIT_DV, gated_delta.SPLIT_WARPS = was

        return run

    def fused_capped(self, registers: int) -> Callable[[], torch.Tensor]:
        """Our decode step in the fused kernel, its registers capped at `registers` a thread
        (MINISGL_GATED_DELTA_DECODE=fused, MINISGL_GATED_DELTA_REGISTERS)."""
        from minisgl.env import ENV

        def run() -> torch.Tensor:
            was = self.pool.split_decode, ENV.GATED_DELTA_REGISTERS.value
            self.pool.split_decode, ENV.GATED_DELTA_REGISTERS.value = False, registers
            try:
                return self.side("triton")()
            finally:
                self.pool.split_decode, ENV.GATED_DELTA_REGISTERS.value = was

        return run

    def state_bytes(self) -> int:
        """A call's floor traffic: each request's SSM and conv state read and written."""
        s, itemsize = self.shape, self.qkv.element_size()
        per_req = s.num_value_heads * s.key_head_dim * s.value_head_dim * 4
        per_req += s.conv_dim * (s.conv_kernel - 1) * itemsize
        return 2 * len(self.lengths) * per_req

    def fla_side(self, ops: tuple[Callable, Callable, str]) -> Callable[[], object]:
        """fla's recurrence on this case's q, k, v, g and beta (made here, not timed)."""
        from minisgl.layers.gated_deltanet import causal_conv

        s, layer = self.shape, self.layer
        with torch.no_grad():  # the inputs, from the torch path's own steps
            mixed, _ = causal_conv(
                self.qkv[None], self.qkv.new_zeros(1, s.conv_dim, s.conv_kernel - 1),
                layer.conv1d.weight.squeeze(1),
            )  # fmt: skip
            key = s.num_key_heads * s.key_head_dim
            q, k, v = mixed.split([key, key, mixed.size(-1) - 2 * key], dim=-1)
            r = s.num_value_heads // s.num_key_heads
            q, k = (t.reshape(1, -1, s.num_key_heads, s.key_head_dim) for t in (q, k))
            q, k = (t.repeat_interleave(r, dim=2).contiguous() for t in (q, k))
            v = v.reshape(1, -1, s.num_value_heads, s.value_head_dim).contiguous()
            beta = self.b.sigmoid()[None]
            g = (-layer.A_log.float().exp() * torch.nn.functional.softplus(
                self.a.float() + layer.dt_bias.float()))[None]  # fmt: skip
        reqs = len(self.lengths)
        h0 = self.pool.ssm[:, :reqs]  # per layer of the pool, cycled through as ours
        recurrent, chunk, _ = ops
        if self.batch.is_decode:  # one row per request, one token each
            q, k, v, g, beta = (t.transpose(0, 1) for t in (q, k, v, g, beta))
            return lambda: recurrent(
                q, k, v, g=g, beta=beta, initial_state=h0[layer.index],
                output_final_state=True, use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
        cu = self.batch.state_offsets.long()
        return lambda: chunk(
            q, k, v, g=g, beta=beta, initial_state=h0[layer.index], output_final_state=True,
            use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
        )  # fmt: skip


def capped(cap: int) -> str:
    """How a side names its register cap: "at most 128", or "the compiler's" for 0."""
    return f"at most {cap}" if cap else "the compiler's"


def max_diff(setup: Setup, side: Callable[[], torch.Tensor]) -> float:
    """Relative largest difference of `side`'s output from torch's, from the same states."""
    saved = setup.pool.conv.clone(), setup.pool.ssm.clone()
    out = []
    for run in (setup.side("torch"), side):
        setup.pool.conv.copy_(saved[0]), setup.pool.ssm.copy_(saved[1])
        with torch.no_grad():
            out.append(run().float())
    got, want = out
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


def cycling(setup: Setup, run: Callable[[], object], calls: int) -> Callable[[], None]:
    """`calls` calls of `run`, each on the next layer of the pool."""
    layers = setup.pool.conv.size(0)

    def many() -> None:
        for i in range(calls):
            setup.layer.index = i % layers
            run()

    return many


def timer(run: Callable[[], None], device: torch.device, graph: bool) -> Callable[[], float]:
    """A function that times one `run()` (or one replay of it captured in a CUDA graph)."""
    with torch.no_grad():
        run()  # compiles, and keeps lazy set-up out of the graph
    if device.type != "cuda":
        import time

        def host() -> float:
            start = time.perf_counter()
            with torch.no_grad():
                run()
            return time.perf_counter() - start

        return host
    torch.cuda.synchronize()
    g = None
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g):
            run()

    def events() -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        if g is not None:
            g.replay()
        else:
            with torch.no_grad():
                run()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3

    return events


def bench(case: Case, args: argparse.Namespace, fla, device, dtype) -> list[str]:
    model, phase, lengths = case
    shape = MODELS[model]
    decode = phase == "decode"
    probe = Setup(shape, lengths, dtype, device, 1)
    layers = 1
    if decode and device.type == "cuda":  # enough layers that the states leave the L2 cache
        l2 = torch.cuda.get_device_properties(device).L2_cache_size
        layers = min(128, math.ceil(3 * l2 / probe.state_bytes()))
    setup = Setup(shape, lengths, dtype, device, layers) if layers > 1 else probe
    calls = args.calls if decode else 1
    sides: dict[str, Callable[[], object]] = {"torch": setup.side("torch")}
    sides["ours"] = setup.side("triton")
    diffs = {"torch": 0.0, "ours": max_diff(setup, setup.side("triton"))}
    if decode:
        for columns in args.split_columns:
            sides[f"ours, split {columns}"] = setup.decode_split(columns)
            diffs[f"ours, split {columns}"] = max_diff(setup, sides[f"ours, split {columns}"])
        for cap in args.fused_registers:
            name = f"ours, fused, {capped(cap)} registers"
            sides[name] = setup.fused_capped(cap)
            diffs[name] = max_diff(setup, sides[name])
    else:
        for rule in ("by token", "two passes"):
            sides[f"ours, {rule}"] = setup.prefill_with(rule)
            diffs[f"ours, {rule}"] = max_diff(setup, sides[f"ours, {rule}"])
    notes = {}
    if fla is not None and device.type == "cuda":
        sides["fla"] = setup.fla_side(fla)
        diffs["fla"] = float("nan")
    timers = {}
    for name, run in sides.items():
        many = cycling(setup, run, calls)
        try:
            timers[name] = timer(many, device, graph=decode)
        except Exception as e:  # noqa: BLE001 - a side that cannot be captured runs eagerly
            notes[name] = f"eager: {type(e).__name__}"
            torch.cuda.synchronize()
            try:
                timers[name] = timer(many, device, graph=False)
            except Exception as e:  # noqa: BLE001 - fla's API may differ: say so, go on
                print(f"{model} {phase}: {name} failed: {e!r}", flush=True)
                notes.pop(name)
    times: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(args.rounds):  # ABAB...
        for name, time_one in timers.items():
            times[name].append(time_one() / calls)
    rows = []
    torch_s = statistics.median(times["torch"])
    for name, ts in times.items():
        sec = statistics.median(ts)
        rate = setup.state_bytes() / sec / 1e9 if decode else sum(lengths) / sec / 1e6
        size = f"{len(lengths)}" if decode else f"{len(lengths)}x{lengths[0]}"
        diff = "-" if math.isnan(diffs[name]) else f"{diffs[name]:.1e}"
        label = f"{name} ({notes[name]})" if name in notes else name
        rows.append(
            f"| {model} | {phase} | {size} | {label} | {sec * 1e6:.1f} | {torch_s / sec:.2f}x "
            f"| {rate:.{0 if decode else 2}f} | {diff} |"
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_device_args(p)
    p.add_argument("--models", default="0.8b,9b", help=f"of {', '.join(MODELS)}")
    p.add_argument("--decode", default="1,8,64,256", help="batch sizes of one token each")
    p.add_argument("--prefill", default="1x4096,8x512", help="REQUESTSxTOKENS, comma-separated")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds, each side once a round")
    p.add_argument("--calls", type=int, default=20, help="decode calls captured in one graph")
    p.add_argument(
        "--split-columns",
        default="32",
        help="decode in two kernels: value columns a program, or COLUMNS:WARPS",
    )
    p.add_argument(
        "--fused-registers",
        default="",
        help="decode in the fused kernel with these caps of registers a thread (0: none)",
    )
    p.add_argument("--dry-run", action="store_true", help="list the cases and exit")
    args = parse(p, argv)
    args.split_columns = [c for c in args.split_columns.split(",") if c]
    args.fused_registers = [int(c) for c in args.fused_registers.split(",") if c]
    todo = cases(args)
    fla = fla_ops()
    split = "".join(f", ours split {c}" for c in args.split_columns)
    split += "".join(f", ours fused {capped(c)} registers" for c in args.fused_registers)
    sides = f"torch, ours{split}" + (f", fla {fla[2]}" if fla else " (fla-core not importable)")
    if args.dry_run:
        print(f"{len(todo)} cases on {args.device}, {args.dtype}; sides: {sides}")
        for model, phase, lengths in todo:
            print(f"  {model} {phase}: {len(lengths)} request(s) x {lengths[0]} token(s)")
        return
    if args.device == "cpu":  # our kernels in Triton's interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(f"{name}, {args.dtype}, torch {torch.__version__}, commit {commit or '?'}; {sides}")
    if device.type == "cuda":
        print(f"decode: us a call in a CUDA graph of {args.calls}; prefill: us a call, eager;")
    else:
        print("on the CPU, our kernels interpreted: the times mean nothing;")
    print(f"medians of {args.rounds} alternating rounds\n")
    print("| model | phase | requests | side | us | vs torch | state GB/s, or Mtok/s | max diff |")
    print("|---|---|---|---|---|---|---|---|")
    for case in todo:
        for row in bench(case, args, fla, device, dtype):
            print(row, flush=True)


if __name__ == "__main__":
    main()
