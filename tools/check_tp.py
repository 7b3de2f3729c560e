"""Tensor parallelism against one rank, on the same weights: teacher-forced log-probabilities.

    python tools/check_tp.py --model /root/q06 --tp-size 2             # GPUs, bf16
    python tools/check_tp.py --model models/tiny-qwen3 --device cpu --tp-size 2

Two comparisons, each of the log-probability of a given token at a given place:

- prefill: the prompt tokens' log-probabilities under tp=1 and under tp=N;
- decode: tp=N generates greedily (its decode CUDA graphs, all-reduces inside), and
  reports each chosen token's log-probability as it goes; tp=1 then scores the same tokens
  under teacher forcing (prompt + tp=N's tokens as one prompt). Both must agree.

The difference is reported relative to the scale of the values (the largest magnitude),
and the run fails (exit 1) above `--tol`. How many greedy tokens tp=1 and tp=N pick alike
is printed as well but not judged: on random weights the logits are close to flat, and
a last-bit difference in a sum changes the argmax.
"""

from __future__ import annotations

import argparse
import random
import sys

import torch
from common import add_engine_args, engine_kwargs, parse


def run(args: argparse.Namespace, tp: int, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    tokens = max(len(p) for p in prompts) + args.output_len + 8
    llm = LLM(
        **engine_kwargs(args, tp_size=tp),
        max_running_req=len(prompts),
        num_page_override=len(prompts) * tokens,
        max_seq_len_override=tokens,
        cuda_graph_max_bs=len(prompts),
    )
    try:
        params = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, logprobs=True, prompt_logprobs=True
        )
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()


def prompt_lp(result: dict, start: int = 1) -> torch.Tensor:
    return torch.tensor([x["logprob"] for x in result["prompt_logprobs"][start:]])


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / a.abs().max().clamp_min(1e-6)).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(p, tp_size=2)
    p.add_argument("--prompt-lens", default="40,97,13,200")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument(
        "--tol",
        type=float,
        default=None,
        help="largest relative difference (default: 2e-2 in 16-bit, 1e-4 in fp32)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = parse(p)
    tol = args.tol if args.tol is not None else (1e-4 if args.dtype == "float32" else 2e-2)

    from minisgl.models.config import ModelConfig

    vocab = ModelConfig.from_path(args.model).vocab_size
    rng = random.Random(args.seed)
    lens = [int(n) for n in args.prompt_lens.split(",")]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lens]

    one = run(args, 1, prompts, args.output_len)
    many = run(args, args.tp_size, prompts, args.output_len)
    # tp=1 scores tp=N's greedy tokens under teacher forcing: prompt + tokens as one prompt.
    forced = run(args, 1, [q + r["token_ids"] for q, r in zip(prompts, many)], 1)

    prefill = max(rel_diff(prompt_lp(a), prompt_lp(b)) for a, b in zip(one, many))
    decode = 0.0
    for q, r, f in zip(prompts, many, forced):
        reported = torch.tensor([x["logprob"] for x in r["logprobs"]])
        decode = max(decode, rel_diff(prompt_lp(f, len(q)), reported))
    alike = sum(a == b for x, y in zip(one, many) for a, b in zip(x["token_ids"], y["token_ids"]))
    total = sum(len(x["token_ids"]) for x in one)
    print(f"tp={args.tp_size} vs tp=1, {args.model}, {args.dtype} on {args.device}, prompts {lens}")
    print(f"  prefill: prompt log-probabilities, max difference {prefill:.2e} of their scale")
    print(
        f"  decode:  tp={args.tp_size}'s greedy tokens, max difference {decode:.2e} of their scale"
    )
    print(f"  greedy tokens alike (not judged): {alike}/{total}")
    worst = max(prefill, decode)
    print(f"{'PASS' if worst <= tol else 'FAIL'} (tolerance {tol:g})")
    sys.exit(0 if worst <= tol else 1)


if __name__ == "__main__":
    main()
