"""Offline throughput: minisgl vs Hugging Face `generate`, side by side in one run.

The workload has nano-vllm's shape: random token prompts, input and output lengths drawn
uniformly from ranges, EOS ignored so every request produces exactly its output length.
The defaults are scaled down so a CPU run takes minutes; on a GPU raise them.

    python tools/bench_offline.py --model models/SmolLM2-135M-Instruct --num-seqs 16

`--steps` times each scheduler step of the timed run (from one forward's start to the next:
with overlap scheduling, the host's work and the device's of one step) and prints where the
run went: prefill steps, and decode steps by batch size.
"""

from __future__ import annotations

import argparse
import platform
import random
import time

import torch
from common import add_engine_args, engine_kwargs, parse, sync
from tqdm import tqdm


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    return [
        (
            [rng.randrange(vocab) for _ in range(rng.randint(args.min_input, args.max_input))],
            rng.randint(args.min_output, args.max_output),
        )
        for _ in range(args.num_seqs)
    ]


class StepTimes:
    """A scheduler listener: each forward's phase, batch size, new tokens and start time."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, int, int, float]] = []

    def forward_begins(self, batch) -> None:
        tokens = batch.size if batch.is_decode else sum(r.extend_len for r in batch.reqs)
        self.steps.append((batch.phase, batch.size, tokens, time.perf_counter()))

    def forward_launched(self, batch) -> None:
        pass

    def table(self, end: float) -> str:
        """Steps by kind: prefill (and verify), decode by batch size in powers of two."""
        groups: dict[tuple[int, str], list[float]] = {}
        tokens: dict[tuple[int, str], int] = {}
        # each step ends where the next begins; the last one's end is the run's, which
        # gathers every output after it: it is left out, and said apart
        ends = [t for *_, t in self.steps[1:]]
        for (phase, size, new, start), stop in zip(self.steps, ends):
            key = (0, phase)
            if phase == "decode":
                hi = 1 << (size - 1).bit_length()
                lo = hi // 2 + 1 if hi > 2 else hi
                key = (-hi, f"decode, batch {lo}-{hi}" if lo < hi else f"decode, batch {hi}")
            groups.setdefault(key, []).append(stop - start)
            tokens[key] = tokens.get(key, 0) + new
        lines = ["| steps | count | time (s) | ms/step | tokens/step |", "|---|---|---|---|---|"]
        for key in sorted(groups, key=lambda k: (k[0] != 0, k)):
            times, n = groups[key], len(groups[key])
            lines.append(
                f"| {key[1]} | {n} | {sum(times):.2f} | {1e3 * sum(times) / n:.2f}"
                f" | {tokens[key] / n:.0f} |"
            )
        if self.steps:
            lines.append(
                f"(the last step to the run's end: {1e3 * (end - self.steps[-1][3]):.2f} ms)"
            )
        return "\n".join(lines)


def bench_minisgl(args: argparse.Namespace, reqs: list[tuple[list[int], int]]) -> float:
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    llm = LLM(**engine_kwargs(args), max_running_req=args.max_running_req)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for _, n in reqs]
    # Warm-up on other prompts of the same shape: a full prefill chunk's kernels compile (and
    # the matmul library picks its algorithms) on first use, seconds that are not throughput.
    from minisgl.models.config import ModelConfig

    vocab = ModelConfig.from_path(args.model).vocab_size
    warm = workload(argparse.Namespace(**{**vars(args), "seed": args.seed + 1}), vocab)
    jit = llm.engine.jit
    llm.generate([ids for ids, _ in warm[:16]], SamplingParams(max_tokens=2), use_tqdm=False)
    sync(args.device)
    print(f"Triton in the warm-up: {jit.summary()}")
    built = len(jit.builds)
    steps = StepTimes()
    if args.steps:
        llm.scheduler.listeners.append(steps)
    start = time.perf_counter()
    outputs = llm.generate([ids for ids, _ in reqs], params)
    sync(args.device)
    elapsed = time.perf_counter() - start
    if args.steps:
        print(steps.table(start + elapsed))
    print(f"Triton in the timed run: {jit.summary(jit.builds[built:])}")
    assert [len(o["token_ids"]) for o in outputs] == [n for _, n in reqs]
    llm.shutdown()
    return elapsed


def bench_hf(args: argparse.Namespace, reqs: list[tuple[list[int], int]], batched: bool) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()

    def generate(batch: list[tuple[list[int], int]]) -> None:
        width = max(len(ids) for ids, _ in batch)
        # left padding, so every prompt ends where generation starts
        input_ids = torch.tensor([[0] * (width - len(ids)) + ids for ids, _ in batch])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch])
        new = max(n for _, n in batch)
        with torch.no_grad():
            model.generate(
                input_ids.to(args.device),
                attention_mask=mask.to(args.device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )

    generate([([1, 2, 3], 2)])  # warm-up
    sync(args.device)
    start = time.perf_counter()
    if batched:
        for i in tqdm(range(0, len(reqs), args.hf_batch_size), desc="hf batched"):
            generate(reqs[i : i + args.hf_batch_size])
    else:
        for req in tqdm(reqs, desc="hf one at a time"):
            generate([req])
    sync(args.device)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(p, model="models/SmolLM2-135M-Instruct")
    p.add_argument("--num-seqs", type=int, default=16)
    p.add_argument("--min-input", type=int, default=16)
    p.add_argument("--max-input", type=int, default=256)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--max-running-req", type=int, default=256)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--skip-hf", action="store_true", help="measure minisgl only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", action="store_true", help="where the run went, by kind of step")
    args = parse(p)

    from minisgl.models.config import ModelConfig

    reqs = workload(args, ModelConfig.from_path(args.model).vocab_size)
    useful = sum(n for _, n in reqs)
    machine = (
        torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    )
    print(
        f"{len(reqs)} requests, input {args.min_input}-{args.max_input}, output "
        f"{args.min_output}-{args.max_output} ({useful} output tokens), {args.dtype}, {machine}"
    )
    rows = [("minisgl", bench_minisgl(args, reqs))]
    if not args.skip_hf:
        rows.append(("HF generate, one request at a time", bench_hf(args, reqs, batched=False)))
        rows.append(
            (
                f"HF generate, batches of {args.hf_batch_size} (padded)",
                bench_hf(args, reqs, batched=True),
            )
        )
    base = rows[0][1]
    print("\n| engine | time (s) | output tok/s | minisgl speed-up |\n|---|---|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.1f} | {useful / seconds:.1f} | {seconds / base:.2f}x |")


if __name__ == "__main__":
    main()
