"""Speculative decoding, side by side: output tok/s with and without n-gram drafts.

Two workloads of real text through the model's chat template, greedy: "copy" prompts ask to
repeat, edit or continue text they give (where n-gram drafts pay), "chat" prompts ask open
questions (where they rarely do). Each runs one request at a time (batch 1) and all at once
(repeated up to each of --batches), first without drafts, then with them; the outputs must
be the same tokens. Reported next to the speed: accepted drafts per verify step and how
many verify forwards replayed a CUDA graph.

    python tools/bench_speculative.py --model models/SmolLM2-135M-Instruct --attn triton
    python tools/bench_speculative.py --model models/tiny-llama --device cpu --smoke
"""

from __future__ import annotations

import argparse
import json
import time

from common import add_engine_args, engine_kwargs, parse, sync

CODE = """def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
"""
TEXT = (
    "The river town of Amberley grew up around a stone bridge built in 1742. Traders came "
    "for the wool market every autumn, and the inns along the High Street filled with "
    "farmers, carters and travelling musicians. When the railway arrived in 1861 the "
    "market moved to the station yard, and the old bridge became a quiet place for "
    "walkers, anglers and painters."
)
COPY = [
    "Repeat the following text exactly, word for word:\n\n" + TEXT,
    "Add type hints to this function and change nothing else:\n\n" + CODE,
    "Rename the variable `total` to `running_sum` in this code:\n\n" + CODE,
    "Fix the spelling and output the whole corrected text:\n\n" + TEXT.replace("the", "teh"),
    "Rewrite this text in the present tense, sentence by sentence:\n\n" + TEXT,
    "Add a docstring to this function and output the whole function:\n\n" + CODE,
    "Copy this list and add one more line in the same style:\n"
    + "\n".join(f"- item {i}: {w}" for i, w in enumerate(TEXT.split()[:16])),
    "Translate the comments into French; there are none, so return the code as it is:\n\n" + CODE,
]
CHAT = [
    "What are three good habits for writing readable code?",
    "Explain in a few sentences why the sky looks blue.",
    "Give me a short recipe for a vegetable soup.",
    "What is the difference between a list and a tuple in Python?",
    "Suggest a name for a small bakery and say why.",
    "How do I keep a houseplant alive while I am away for two weeks?",
    "Write a haiku about autumn rain.",
    "What should I pack for a day of hiking?",
]


def prompts_of(tokenizer: object, texts: list[str]) -> list[list[int]]:
    chats = [[{"role": "user", "content": t}] for t in texts]
    return [tokenizer.encode(tokenizer.apply_chat_template(c), False) for c in chats]  # type: ignore[attr-defined]


def run(llm: object, prompts: list[list[int]], params: object, one_at_a_time: bool) -> tuple:
    sync(llm.engine.device.type)  # type: ignore[attr-defined]
    start = time.perf_counter()
    if one_at_a_time:
        out = [llm.generate([p], params, use_tqdm=False)[0]["token_ids"] for p in prompts]  # type: ignore[attr-defined]
    else:
        out = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]  # type: ignore[attr-defined]
    sync(llm.engine.device.type)  # type: ignore[attr-defined]
    return out, time.perf_counter() - start


def counters(spec: object, replays: list[str]) -> tuple[int, ...]:
    s = spec
    return (s.num_drafted, s.num_accepted, s.num_steps, s.num_forwards, replays.count("verify"))  # type: ignore[attr-defined]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(p, tp_size=None)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument(
        "--batches",
        default="1,8,32,64",
        help="batch sizes: 1 runs one request at a time, N all at once",
    )
    p.add_argument(
        "--speculative-max-bs",
        type=int,
        default=None,
        help="larger batches do not speculate (default: the engine's)",
    )
    p.add_argument("--smoke", action="store_true", help="two prompts, 8 tokens: does it run")
    p.add_argument("--output-json", default=None)
    args = parse(p)
    if args.speculative == "off":
        args.speculative = "ngram"
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM
    from minisgl.tokenizer.tokenizer import Tokenizer

    tokenizer = Tokenizer(args.model)
    workloads = {"copy": COPY, "chat": CHAT}
    max_tokens = 8 if args.smoke else args.max_tokens
    batches = [int(b) for b in args.batches.split(",")]
    if args.smoke:
        workloads = {name: texts[:2] for name, texts in workloads.items()}
        batches = [1, 4]
    params = SamplingParams(max_tokens=max_tokens)
    results: dict[str, dict] = {}
    outputs: dict[tuple, list] = {}
    for mode in ("off", args.speculative):
        kw = engine_kwargs(args, max_running_req=max(*batches, 8))
        if mode == "off":
            kw.pop("speculative", None)
            kw.pop("draft_model", None)
        else:
            kw["speculative"] = mode
            if args.speculative_max_bs is not None:
                kw["speculative_max_bs"] = args.speculative_max_bs
        llm = LLM(**kw)
        replays: list[str] = []
        runner = llm.engine.graph_runner
        replay = runner.replay
        runner.replay = lambda b, log=replays, inner=replay: (log.append(b.phase), inner(b))[1]
        spec = llm.scheduler.spec
        run(llm, prompts_of(tokenizer, workloads["chat"][:1]), params, True)  # warm-up
        for name, texts in workloads.items():
            prompts = prompts_of(tokenizer, texts)
            for size in batches:
                label, alone = f"batch {size}", size == 1
                reqs = prompts if alone else (prompts * (size // len(prompts) + 1))[:size]
                before = counters(spec, replays)
                out, seconds = run(llm, reqs, params, alone)
                drafted, accepted, steps, forwards, graphs = (
                    now - then for now, then in zip(counters(spec, replays), before)
                )
                tokens = sum(len(o) for o in out)
                outputs[name, label, mode] = out
                row = results.setdefault(f"{name}, {label}", {})
                row[mode] = {"tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds}
                if mode != "off":
                    row[mode] |= {
                        "drafted": drafted,
                        "accepted": accepted,
                        "accepted_per_verify": accepted / max(steps, 1),
                        "verify_forwards": forwards,
                        "verify_graph_share": graphs / max(forwards, 1),
                        "same_tokens": out == outputs[name, label, "off"],
                    }
        llm.shutdown()
    mode = args.speculative
    print(
        f"\n| workload | off tok/s | {mode} tok/s | speed-up | accepted per request-verify |",
        end="",
    )
    print(" verify forwards in a graph | same tokens |\n|---|---|---|---|---|---|---|")
    for key, row in results.items():
        on = row[mode]
        print(
            f"| {key} | {row['off']['tok_s']:.1f} | {on['tok_s']:.1f} | "
            f"{on['tok_s'] / row['off']['tok_s']:.2f}x | {on['accepted_per_verify']:.2f} | "
            f"{on['verify_graph_share']:.0%} | {on['same_tokens']} |"
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
