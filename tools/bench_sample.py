"""Sampling a batch of logits: the one-read kernel against the torch path it replaces.

    python tools/bench_sample.py                                    # vocab 151936, batch 1..256
    python tools/bench_sample.py --batch-sizes 256 --cases temperature,top_k
    python tools/bench_sample.py --device cpu --vocab 3000 --batch-sizes 2 --reps 1  # smoke test

Each row times one batch's sampling, penalties first where the case has them, replayed from
a CUDA graph (the median of --reps), so both sides are measured as a captured decode step
would run them. "torch (before)" is the sampler as it was before the kernel: the division,
the noise tensor, two argmaxes, top-k/top-p masks from sorted rows and dense penalties;
"ours" is `engine/sample.py` on a GPU: the kernel, after `min_kept`'s threshold and the
in-place penalties. GB/s is the logits' bytes (read once) over the time: the memory's
bandwidth is the ceiling of a path that reads them once. "same tokens" compares ours with
the torch path of the same code (`warp`, `gumbel_noise`, argmax) over --draws batches of
fresh seeds: it must be all of them. On the CPU the kernel runs in Triton's interpreter and
the times mean nothing.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial

import torch
from common import add_device_args, parse

CASES = ("greedy", "temperature", "mixed", "top_k", "top_p", "top_k_top_p", "penalties")
HISTORY = 1024  # tokens each row has seen, for the penalties


def batch(case: str, bs: int, vocab: int, device: torch.device):
    """(logits, sampling args, history or None) for one case, from a fixed seed."""
    from minisgl.engine.sample import BatchSamplingArgs

    gen = torch.Generator().manual_seed(bs)
    logits = (torch.randn(bs, vocab, generator=gen) * 3).to(device)
    if case == "greedy":
        return logits, BatchSamplingArgs(greedy=True), None
    is_greedy = torch.zeros(bs, dtype=torch.bool)
    if case == "mixed":
        is_greedy[::2] = True
    temperatures = torch.where(is_greedy, 1.0, 0.7)[:, None]
    top_k = torch.full((bs,), 20 if case == "top_k_top_p" else 50)
    top_p = torch.full((bs,), 0.95 if case == "top_k_top_p" else 0.9)
    args = BatchSamplingArgs(
        greedy=False,
        temperatures=temperatures.to(device),
        is_greedy=is_greedy.to(device),
        top_k=top_k.to(device) if case in ("top_k", "top_k_top_p") else None,
        top_p=top_p.to(device) if case in ("top_p", "top_k_top_p") else None,
        seeds=torch.randint(0, 2**63 - 1, (bs,), generator=gen).to(device),
        positions=torch.randint(0, 4096, (bs,), generator=gen).to(device),
        widest={"top_k": 50, "top_k_top_p": 20}.get(case, 0),
    )
    history = None
    if case == "penalties":  # HISTORY tokens a row, the second half generated
        tokens = torch.randint(0, vocab, (bs, HISTORY), generator=gen).to(device)
        generated = (torch.arange(HISTORY) >= HISTORY // 2).expand(bs, -1).to(device)
        columns = [torch.full((bs, 1), v, device=device) for v in (0.5, 0.25, 1.25)]
        history = (*columns, tokens, generated)  # presence, frequency, repetition, ...
    return logits, args, history


def ours(logits: torch.Tensor, args, history) -> torch.Tensor:
    """engine/sample.py's GPU path, called directly so that the CPU runs it interpreted;
    with penalties, the device's part of `gather_penalties` and `apply_penalties`."""
    from minisgl.engine.penalty import Penalties, apply_penalties, output_counts
    from minisgl.engine.sample import argmax, min_kept
    from minisgl.kernels.sample import sample_rows

    if history is not None:
        *columns, tokens, generated = history
        counts = output_counts(tokens, generated, logits.size(1))
        logits = apply_penalties(logits, Penalties(*columns, tokens, counts))
    if args.greedy:
        return argmax(logits)
    rows = (args.temperatures, args.is_greedy, args.seeds, args.positions)
    return sample_rows(logits, *rows, min_kept(logits, args))


def torch_path(logits: torch.Tensor, args) -> torch.Tensor:
    """The torch path of the same code: what ours must equal, token for token."""
    from minisgl.engine.sample import argmax, gumbel_noise, warp

    if args.greedy:
        return argmax(logits)
    sampled = argmax(warp(logits, args) + gumbel_noise(args.seeds, args.positions, logits.size(1)))
    return torch.where(args.is_greedy, argmax(logits), sampled)


def before(logits: torch.Tensor, args, history) -> torch.Tensor:
    """The sampler as it was before the kernel, for the times: dense penalties, masks from
    sorted rows, the noise as a tensor, two argmaxes."""
    from minisgl.engine.sample import argmax, gumbel_noise

    if history is not None:
        presence, frequency, repetition, tokens, generated = history
        zeros = torch.zeros_like(logits)
        counts = zeros.scatter_add(1, tokens, generated.float())
        seen = zeros.scatter_add(1, tokens, torch.ones_like(generated, dtype=torch.float)) > 0
        repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, repeated, logits)
        logits = logits - frequency * counts - presence * (counts > 0).float()
    greedy = argmax(logits)
    if args.greedy:
        return greedy
    scaled = logits / args.temperatures
    if args.top_k is not None:
        kth = scaled.sort(dim=-1, descending=True).values.gather(-1, (args.top_k - 1)[:, None])
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if args.top_p is not None:
        ordered, order = scaled.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        drop = (probs.cumsum(dim=-1) - probs) >= args.top_p[:, None]
        drop = torch.zeros_like(drop).scatter(-1, order, drop)
        scaled = scaled.masked_fill(drop, float("-inf"))
    sampled = argmax(scaled + gumbel_noise(args.seeds, args.positions, logits.size(1)))
    return torch.where(args.is_greedy, greedy, sampled)


def time_ms(run: Callable[[], object], reps: int, device: torch.device) -> float:
    if device.type != "cuda":
        start = time.perf_counter()
        run()
        return (time.perf_counter() - start) * 1e3
    from minisgl.engine.kernel_choice import time_in_graph

    return time_in_graph("sample", run, reps) * 1e3


def same_tokens(case: str, bs: int, vocab: int, draws: int, device: torch.device) -> str:
    """Ours against the torch path of the same code, over `draws` batches of fresh seeds
    (the penalties, the same code on both sides, left out)."""
    logits, args, _ = batch(case, bs, vocab, device)
    gen, equal = torch.Generator().manual_seed(0), 0
    for _ in range(draws):
        if not args.greedy:
            args.seeds = torch.randint(-(2**63), 2**63 - 1, (bs,), generator=gen).to(device)
            args.positions = torch.randint(0, 2**40, (bs,), generator=gen).to(device)
        equal += int((ours(logits, args, None) == torch_path(logits, args)).sum())
    return f"{equal}/{draws * bs}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_device_args(p)
    p.add_argument("--vocab", type=int, default=151936, help="Qwen3's vocabulary by default")
    p.add_argument("--batch-sizes", default="1,8,64,256")
    p.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--draws", type=int, default=20, help="batches of seeds for 'same tokens'")
    args = parse(p)
    if args.device == "cpu":  # the kernel in Triton's interpreter; the times mean nothing
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreted)"
    where = "replayed from a CUDA graph" if device.type == "cuda" else "one call, interpreted"
    print(f"{name}, vocab {args.vocab}, fp32 logits; ms per batch, {where}\n")
    print("| case | batch | torch (before), ms | GB/s | ours, ms | GB/s | speed-up | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        for bs in (int(b) for b in args.batch_sizes.split(",")):
            logits, sampling, history = batch(case, bs, args.vocab, device)
            old = time_ms(partial(before, logits, sampling, history), args.reps, device)
            # the penalties write over the logits: ours gets a copy of its own
            new = time_ms(partial(ours, logits.clone(), sampling, history), args.reps, device)
            gb = logits.nbytes / 1e9
            same = same_tokens(case, bs, args.vocab, args.draws, device)
            print(
                f"| {case} | {bs} | {old:.3f} | {gb / old * 1e3:.0f} | {new:.3f} "
                f"| {gb / new * 1e3:.0f} | {old / new:.2f}x | {same} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
