"""Speculative decoding, measured fairly: output tok/s with drafts against without.

The first runs of an engine pay for compiling kernels and capturing graphs, and a benchmark
that always runs one side first hands it that bill: the order alone can look like a
1.4x speed-up. So here one engine, built with the drafter, runs every workload with
speculation switched off and on: first one warm-up run of each on the workload's own
prompts and batch size (every shape either side will meet), then alternating timed runs
(off, on, off, on, ...; --pairs of them). The table shows each side's median tok/s with
its range, the speed-up of the medians, and the noise floor: how far the off runs spread
among themselves. A speed-up inside the noise floor is reported as such, not as a gain.

Workloads, greedy, through the model's chat template. The tuning set (below; what the
drafters' settings were chosen on): "copy" asks to repeat, edit or continue given text,
"chat" asks open questions. The held-out set (tools/spec_heldout.json, written once and
never tuned on): "transform" (JSON and CSV), "multi-turn" (chats that quote earlier
turns), "summary" (summaries that quote), "open-chat". Each runs one request at a time
(batch 1) and all at once (repeated up to each of --batches).

The on runs' tokens must be the off runs'. Where they are not (bf16 may differ: docs/ch26),
the last column shows the fewest tokens before a first difference. Suffix drafts learn
from earlier answers, so every timed run starts with a drafter that has seen none of the
earlier runs' (same prompts') answers: a run draws only on the requests before it.

With --costs, nothing is timed: the scheduler decides with the step costs given (batch size:
plain step ms: verify step ms, as a GPU measured them; tools/bench_verify_cost.py) instead of
measuring its own, and each side's time is modelled as the sum of its decode steps' costs.
That puts a GPU's decisions on a CPU: which steps verify, and what the drafts they took
were worth, with the real model's drafts and acceptance (fp32, so both sides make the same
tokens). Verifies are not launched ahead (a CPU has no overlap).

    python tools/bench_speculative.py --model models/SmolLM2-135M-Instruct --attn triton
    python tools/bench_speculative.py --model models/tiny-llama --device cpu --smoke
    python tools/bench_speculative.py --model models/SmolLM2-135M-Instruct --device cpu \
        --speculative suffix --sets tuning --batches 1,4 --costs 1:0.703:1.480,4:0.963:1.656
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

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
HELD_OUT = Path(__file__).with_name("spec_heldout.json")


def workloads(sets: list[str]) -> dict[str, tuple[str, list[list[dict]]]]:
    """name -> (set, conversations)."""
    out: dict[str, tuple[str, list[list[dict]]]] = {}
    if "tuning" in sets:
        for name, texts in (("copy", COPY), ("chat", CHAT)):
            out[name] = ("tuning", [[{"role": "user", "content": t}] for t in texts])
    if "heldout" in sets:
        for name, chats in json.loads(HELD_OUT.read_text())["workloads"].items():
            out[name] = ("held-out", chats)
    return out


def prompts_of(tokenizer: object, chats: list[list[dict]]) -> list[list[int]]:
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
    """Drafts accepted, requests verified, verify forwards, their graph replays; verifies
    launched ahead and behind a plain step, the latter's rows whose guess missed, drains."""
    s: Any = spec
    return (s.num_accepted, s.num_steps, s.num_forwards, replays.count("verify"), s.num_ahead,
            s.num_behind, s.num_behind_missed, s.num_drained)  # fmt: skip


def agreement(runs: list[list[list[int]]], reference: list[list[int]]) -> int | None:
    """None if every run has the reference's tokens, else the fewest tokens any output
    shares with its reference before the first difference."""
    firsts = [
        next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        for out in runs
        for got, want in zip(out, reference)
        if got != want
    ]
    return min(firsts) if firsts else None


class StepTrace(list):
    """The scheduler's steps as they run, each as (kind, seconds): prefill, decode, verify,
    drained (a decode step after draining the pipeline for drafts), idle; and the garbage
    collector's passes meanwhile (gc0, gc1, gc2, within the steps' time). With overlap a
    step's seconds are its own host work and the wait for the step before it.

    With speculation on, a plain decode step is named for what it did: "decode, refill"
    (one of the REFILL steps after a verify or a drain, which refill the pipeline),
    "decode, declined" (the drafter gave drafts and no verify ran), "decode, nothing drafted"
    (it was asked and gave none) or "decode" (it was not asked)."""

    def __init__(self, llm: object) -> None:
        from minisgl.speculative.cost import REFILL

        super().__init__()
        sched: Any = llm.scheduler  # type: ignore[attr-defined]
        self.sched, self.step, self.schedule = sched, sched.step, sched._schedule
        spec, last = sched.spec, [None]
        asked = [0, 0]  # this step: requests asked for drafts, drafts given
        self.spec, self.propose = spec, spec._propose  # (the drafter may be replaced)
        self.own = "_propose" in vars(spec)  # else the class's method, given back by deleting
        self.refill = REFILL
        self.since = since = [REFILL]  # plain steps since the last verify or drain

        def propose(reqs, ks, *more) -> tuple:
            drafts, leads = self.propose(reqs, ks, *more)
            asked[0] += sum(k > 0 for k in ks)
            asked[1] += sum(len(d) > 0 for d in drafts)
            return drafts, leads

        def schedule() -> object:
            last[0] = self.schedule()
            return last[0]

        def step() -> list:
            forwards, drained, began = spec.num_forwards, spec.num_drained, time.perf_counter()
            last[0], asked[:] = None, [0, 0]
            out = self.step()
            batch: Any = last[0]
            kind = (
                "idle" if batch is None
                else "prefill" if not batch.is_decode
                else "verify" if spec.num_forwards > forwards
                else "drained" if spec.num_drained > drained
                else "decode, refill" if since[0] < REFILL
                else "decode, declined" if asked[1]
                else "decode, nothing drafted" if asked[0]
                else "decode"
            )  # fmt: skip
            if batch is not None and batch.is_decode:
                since[0] = 0 if kind in ("verify", "drained") else since[0] + 1
            self.append((kind, time.perf_counter() - began))
            return out

        sched._schedule, sched.step = schedule, step
        spec._propose = propose
        self.collected: list[tuple[int, float]] = []  # the garbage collector's passes meanwhile
        gc.callbacks.append(self._collecting)

    def _collecting(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.began = time.perf_counter()
        else:
            self.collected.append((info["generation"], time.perf_counter() - self.began))

    def clear(self) -> None:
        super().clear()
        self.collected.clear()
        self.since[0] = self.refill  # a run starts with no verify behind it

    def stop(self) -> None:
        self.sched.step, self.sched._schedule = self.step, self.schedule
        if self.own:
            self.spec._propose = self.propose
        else:
            del self.spec._propose
        gc.callbacks.remove(self._collecting)


def step_table(steps: list[tuple[str, float]]) -> dict[str, list[float]]:
    table = {}
    for kind in sorted({k for k, _ in steps}):
        ms = [t * 1e3 for k, t in steps if k == kind]
        table[kind] = [
            len(ms),
            round(sum(ms), 3),
            round(statistics.median(ms), 3),
            round(max(ms), 3),
        ]
    return table


def measure(llm: object, mode: str, prompts: list, params: object, alone: bool, pairs: int) -> dict:
    """Warm both sides on these prompts, then `pairs` timed runs of each, alternating."""
    from minisgl.speculative.suffix import SuffixDrafter

    spec = llm.scheduler.spec  # type: ignore[attr-defined]
    depth = getattr(spec.drafter, "depth", 0)  # as deep as --num-draft-tokens asks
    replays: list[str] = []
    runner = llm.engine.graph_runner  # type: ignore[attr-defined]
    replay = runner.replay
    runner.replay = lambda b: (replays.append(b.phase), replay(b))[1]
    tok_s: dict[str, list[float]] = {"off": [], "on": []}
    outputs: dict[str, list] = {"off": [], "on": []}
    steps: dict[str, list[tuple[str, float]]] = {"off": [], "on": []}
    record = StepTrace(llm)

    def one(side: str, timed: bool = True) -> tuple[list, float]:
        spec.enabled = side == "on"
        if mode == "suffix":  # no answers of earlier runs of these prompts
            spec.drafter = SuffixDrafter(depth=depth)
        record.clear()
        out = run(llm, prompts, params, alone)
        if timed:
            steps[side] += record
            steps[side] += [(f"gc{g}", t) for g, t in record.collected]
        return out

    start = counters(spec, replays)
    one("off", False), one("on", False)  # the warm-up: every shape either side meets
    before = counters(spec, replays)
    for _ in range(pairs):
        for side in ("off", "on"):
            out, seconds = one(side)
            tok_s[side].append(sum(len(o) for o in out) / seconds)
            outputs[side].append(out)
    runner.replay = replay
    record.stop()
    counts = [a - b for a, b in zip(counters(spec, replays), before)]
    accepted, verifies, forwards, graphs, ahead, behind, missed, drained = counts
    reference = outputs["off"][0]
    return {
        "tok_s": tok_s,
        "accepted_per_verify": accepted / max(verifies, 1),
        "verify_forwards": forwards,
        "verify_graph_share": graphs / max(forwards, 1),
        "verifies_ahead": ahead,
        "verifies_behind": behind,
        "behind_rows_missed": missed,
        "drains": drained,
        "warm_up_verifies": before[2] - start[2],
        # what the scheduler decided with at the end (ms): "plain@1", "verify@1", ...
        "step_costs_ms": {
            f"{k}@{b}": round(v * 1e3, 3) for (k, b), v in spec.costs.seconds.items()
        },
        # the scheduler's steps of the timed runs by kind: count, ms in all, median, longest
        "steps": {side: step_table(steps[side]) for side in steps},
        "off_runs_agree": agreement(outputs["off"], reference) is None,
        "first_difference": agreement(outputs["on"], reference),
    }


def parse_costs(text: str) -> dict[int, tuple[float, float]]:
    """ "1:0.70:1.48,4:0.96:1.66" -> {batch size: (plain step, verify step)}."""
    costs = {}
    for part in text.split(","):
        bs, plain, verify = part.split(":")
        costs[int(bs)] = (float(plain), float(verify))
    return costs


def cost_at(costs: dict[int, tuple[float, float]], bs: int) -> tuple[float, float]:
    """The step costs at batch size bs: linear between the sizes given, flat beyond them."""
    sizes = sorted(costs)
    if bs <= sizes[0] or bs >= sizes[-1]:
        return costs[sizes[0] if bs <= sizes[0] else sizes[-1]]
    hi = next(s for s in sizes if s >= bs)
    lo = max(s for s in sizes if s <= bs)
    if hi == lo:
        return costs[lo]
    w = (bs - lo) / (hi - lo)
    return tuple((1 - w) * a + w * b for a, b in zip(costs[lo], costs[hi]))  # type: ignore[return-value]


def modelled(
    llm: object, mode: str, prompts: list, params: object, alone: bool, costs: dict
) -> dict:
    """One run a side, the scheduler deciding with `costs`; each side's time the sum of
    its decode steps' costs (ms), and in a batch each request's time to its last token."""
    from minisgl.speculative.cost import StepCosts
    from minisgl.speculative.suffix import SuffixDrafter

    class Given(StepCosts):  # what a verify costs, as given: nothing measured here
        def start(self, kind: str | None, bs: int, now: float | None = None) -> None:
            pass

        def ratio(self, bs: int) -> float:
            plain, verify = cost_at(costs, bs)
            return verify / plain

        def measured(self, bs: int) -> bool:
            return True

    spec = llm.scheduler.spec  # type: ignore[attr-defined]
    depth = getattr(spec.drafter, "depth", 0)  # as deep as --num-draft-tokens asks
    spec.costs = Given()
    try_step = spec.try_step
    steps: list[tuple[int, bool, list[int]]] = []  # decode steps: size, verified, requests

    plain_host: list[float] = []  # the speculator's host time on a plain step (on side), µs

    def counted(batch: object) -> object:
        forwards, began = spec.num_forwards, time.perf_counter()
        out = try_step(batch)
        if batch.is_decode:  # type: ignore[attr-defined]
            uids = [r.uid for r in batch.reqs]  # type: ignore[attr-defined]
            steps.append((len(uids), spec.num_forwards > forwards, uids))
            if spec.enabled and out is None:  # nothing run yet: its host work alone
                plain_host.append((time.perf_counter() - began) * 1e6)
        return out

    spec.try_step = counted
    sides = {}
    for side in ("off", "on"):
        spec.enabled = side == "on"
        if mode == "suffix":
            spec.drafter = SuffixDrafter(depth=depth)
        steps.clear()
        before = counters(spec, [])
        out, _ = run(llm, prompts, params, alone)
        accepted, verifies, forwards = (a - b for a, b in zip(counters(spec, [])[:3], before))
        clock, done = 0.0, {}  # each request's last step's end: when it finished
        for bs, verified, uids in steps:
            clock += cost_at(costs, bs)[verified]
            done.update(dict.fromkeys(uids, clock))
        ends = [done[uid] for uid in sorted(done)] if not alone else []
        sides[side] = (out, clock, forwards, accepted / max(verifies, 1), len(steps), ends)
    spec.try_step = try_step
    off, on = sides["off"], sides["on"]
    host = statistics.median(plain_host) if plain_host else 0.0
    host_ms = sum(plain_host) / 1e3  # every plain step's, on the on side
    return {
        "off_ms": off[1],
        "on_ms": on[1],
        "speedup": off[1] / on[1],
        "finish_speedup": sum(off[5]) / sum(on[5]) if on[5] else off[1] / on[1],
        "steps": (off[4], on[4]),
        "verify_forwards": on[2],
        "accepted_per_verify": on[3],
        "first_difference": agreement([on[0]], off[0]),
        "plain_host_us": host,  # this machine's, not the GPU host's: compare within a run
        # where a step is bound by the host (a small model), its plain steps' extra host time
        # adds to the on side's: the speed-up with it, this machine's host for the GPU's
        "speedup_with_host": off[1] / (on[1] + host_ms),
    }


def summarise(row: dict) -> dict:
    off, on = row["tok_s"]["off"], row["tok_s"]["on"]
    m_off, m_on = statistics.median(off), statistics.median(on)
    noise = (max(off) - min(off)) / m_off
    speedup = m_on / m_off
    verdict = "within noise" if abs(speedup - 1) <= noise else "faster" if speedup > 1 else "slower"
    return {"off": m_off, "on": m_on, "speedup": speedup, "noise": noise, "verdict": verdict}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(p, tp_size=None)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument(
        "--batches", default="1,8,32,64", help="batch sizes: 1 runs one request at a time"
    )
    p.add_argument("--pairs", type=int, default=3, help="timed off/on pairs after the warm-up")
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every answer runs to --max-tokens: in a batch, tok/s then does not follow where"
        " bf16 outputs part and one side's answers end sooner",
    )
    p.add_argument("--sets", default="tuning,heldout", help="tuning, heldout or both")
    p.add_argument(
        "--speculative-max-bs",
        type=int,
        default=None,
        help="larger batches do not speculate (default: the engine's)",
    )
    p.add_argument(
        "--smoke", action="store_true", help="a prompt a workload, 8 tokens: does it run"
    )
    p.add_argument(
        "--costs",
        default=None,
        help="B:PLAIN:VERIFY,... (ms): decide with these step costs and model the time",
    )
    p.add_argument("--output-json", default=None)
    args = parse(p)
    if args.speculative == "off":
        args.speculative = "ngram"
    if args.pairs < (1 if args.costs else 2):  # modelled times are the same every run
        p.error("--pairs must be at least 2: the noise floor is the spread of the off runs")
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    loads = workloads(args.sets.split(","))
    max_tokens, batches = args.max_tokens, [int(b) for b in args.batches.split(",")]
    if args.smoke:
        loads = {name: (kind, chats[:1]) for name, (kind, chats) in loads.items()}
        max_tokens, batches, args.pairs = 8, [1, 2], 2
    kw = engine_kwargs(args, max_running_req=max(*batches, 8))
    if args.speculative_max_bs is not None:
        kw["speculative_max_bs"] = args.speculative_max_bs
    llm = LLM(**kw)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=args.ignore_eos)
    costs = parse_costs(args.costs) if args.costs else None
    results: dict[str, dict] = {}
    for name, (kind, chats) in loads.items():
        prompts = prompts_of(llm.tokenizer, chats)
        for size in batches:
            reqs = prompts if size == 1 else (prompts * (size // len(prompts) + 1))[:size]
            if costs:
                row = modelled(llm, args.speculative, reqs, params, size == 1, costs)
                results[f"{name}, batch {size}"] = row | {"set": kind}
                continue
            row = measure(llm, args.speculative, reqs, params, size == 1, args.pairs)
            results[f"{name}, batch {size}"] = row | {"set": kind} | summarise(row)
    llm.shutdown()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)
    if costs:
        print_modelled(results, args.speculative, args.costs)
        return

    mode = args.speculative
    print(f"\n{args.pairs} alternating pairs after a warm-up of each side; medians [range]")
    print(
        f"| workload | set | off tok/s | {mode} tok/s | speed-up | noise floor | verdict |"
        " accepted per verify | verifies in a graph | greedy agreement |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key, r in results.items():
        off, on = r["tok_s"]["off"], r["tok_s"]["on"]
        first = r["first_difference"]
        agree = "same tokens" if first is None else f"first difference after {first} tokens"
        if not r["off_runs_agree"]:
            agree += " (off runs differ among themselves)"
        print(
            f"| {key} | {r['set']} | {r['off']:.1f} [{min(off):.1f}-{max(off):.1f}] | "
            f"{r['on']:.1f} [{min(on):.1f}-{max(on):.1f}] | {r['speedup']:.2f}x | "
            f"±{r['noise']:.1%} | {r['verdict']} | {r['accepted_per_verify']:.2f} | "
            f"{r['verify_graph_share']:.0%} | {agree} |"
        )


def print_modelled(results: dict, mode: str, given: str) -> None:
    print(f"\nstep costs given (batch: plain ms: verify ms): {given}; decode steps' time modelled")
    print(
        f"| workload | set | off ms | {mode} ms | modelled speed-up | requests finish sooner |"
        " decode steps off / on |"
        " verifies | accepted per verify | speculator's host time a plain step |"
        " speed-up with it | greedy agreement |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for key, r in results.items():
        first = r["first_difference"]
        agree = "same tokens" if first is None else f"first difference after {first} tokens"
        print(
            f"| {key} | {r['set']} | {r['off_ms']:.1f} | {r['on_ms']:.1f} | {r['speedup']:.3f}x"
            f" | {r['finish_speedup']:.3f}x | {r['steps'][0]} / {r['steps'][1]} |"
            f" {r['verify_forwards']} | {r['accepted_per_verify']:.2f} |"
            f" {r['plain_host_us']:.0f} µs | {r['speedup_with_host']:.3f}x | {agree} |"
        )


if __name__ == "__main__":
    main()
