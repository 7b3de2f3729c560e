"""What a verify step costs against a decode step, and where its time goes.

    python tools/bench_verify_cost.py --model models/SmolLM2-135M-Instruct --profile
    python tools/bench_verify_cost.py --model /root/qwen3-8b --batches 1,8 --ks 1,8,16
    python tools/bench_verify_cost.py --model models/tiny-llama --device cpu --ks 1,2 \\
        --batches 1,2 --steps 4 --rounds 1 --profile
    python tools/bench_verify_cost.py --model /root/qwen3-0.6b --ks 8 --batches 1,4 \\
        --variants "extend:VERIFY_ATTN=extend;split:VERIFY_ATTN=split" --rounds 3

A verify step pays when the tokens it makes (each request's own, plus its drafts taken)
outrun the plain decode steps it replaces. What it costs does not depend on which drafts
are taken, so here every request drafts k random tokens (the model takes none of them, and
each verify makes one token a request, as a decode step does), and the engine verifies
them: speculation on, `speculative_always`, the drafter replaced. One engine runs every
side, warmed once on each, then in `--rounds` rounds of runs that alternate: for each k, a
plain run, a run that verifies every step, and one that verifies every `--every`-th step.
Each run generates from as many random prompts as the batch has requests and times
`--steps` scheduler steps once all of them decode: the interval from one step's start to
the next, as the engine's own step costs do (minisgl/speculative/cost.py).

Printed:

- the cost curve, per batch and k: a decode step (median interval of the plain run), a
  verify step (median interval of the verify run: verifies back to back, nothing to drain),
  their ratio; and a verify among decode steps, the way speculation meets it: the run's
  time beyond its plain steps (at the adjacent plain run's cost) per verify. With overlap
  scheduling that one carries the pipeline drained before it and refilled after it (none
  drained before it where it is launched behind the plain step in flight:
  `MINISGL_SPECULATIVE_BEHIND`). Beside
  it, the ratio the engine measured in that run (its StepCosts, fresh for the run): where
  the two agree, the engine's decisions rest on the right number. The noise floor is the
  spread of the plain runs' medians within the batch.
- the host's timeline of one verify step and one decode step at `--timeline-k` drafts, in
  runs of their own (the timers cost a few microseconds a call): drafting, the drain of
  the step in flight, pages, batch metadata, the drafts into the token pool, the forward
  and the sampling or acceptance (launched; on a CPU, computed), the copy of the accepted
  tokens back and the wait for them, emitting them; the rest is the scheduler's own work,
  and outside the step the offline loop's.
- where verifies go ahead (overlap scheduling on, `MINISGL_SPECULATIVE_AHEAD` on), a run
  whose drafts are the plain run's own tokens, each verify launched before the one before it
  is read (speculative/step.py): its step against a decode step, the drafts it took (bf16
  may part from the plain run at near-ties) and the share of its rows that came to nothing.
- with `--profile`, torch.profiler's table of the smallest batch at `--timeline-k`: the
  kernels of a verify step against a decode step, by device time per step (on a CPU the
  operators, by CPU time).

`--variants NAME:KNOB=V,...;NAME:...` compares settings of MINISGL_* knobs in one process
instead (tools/bench_latency.py's form): each round builds a fresh engine per variant in
turn (ABAB...), warms it and times one round of its curve, so every side meets the same
host, whose speed can differ between processes on one machine by 2x; printed per variant,
batch and k: each round's verify / decode and their mean, against the first variant's.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from common import add_engine_args, engine_kwargs, parse, parse_variants, set_knobs, sync
from profile_step import Clock, patched
from torch.profiler import ProfilerActivity, profile

SKIP = 3  # steady steps before the measured ones: the pipeline is under way


class RandomDrafts:
    """Every request drafts what it is asked for, random tokens, at the steps where `on`; or
    where `oracle` holds a plain run's outputs (by prompt), those: the tokens that follow
    its text and the tokens pending after it."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.rng, self.vocab, self.on = random.Random(seed), vocab, True
        self.oracle: dict[tuple[int, ...], list[int]] | None = None
        self.input_len = 0

    def propose(self, reqs: list, ks: list[int], pending: list | None = None) -> list[list[int]]:
        ks = [k if self.on else 0 for k in ks]
        if self.oracle is None:
            return [[self.rng.randrange(self.vocab) for _ in range(k)] for k in ks]
        out = []
        for i, (req, k) in enumerate(zip(reqs, ks)):
            ids = req.input_ids.tolist() + (pending[i] if pending else [])
            done = len(ids) - self.input_len
            out.append(self.oracle[tuple(ids[: self.input_len])][done : done + k])
        return out

    def retain(self, uids: set[int]) -> None:
        pass


class Bench:
    def __init__(self, llm: Any, args: argparse.Namespace) -> None:
        self.llm, self.args = llm, args
        self.sched, self.spec = llm.scheduler, llm.scheduler.spec
        self.drafts = RandomDrafts(llm.engine.model_config.vocab_size, args.seed)
        self.drafts.input_len = args.input_len
        self.spec.drafter = self.drafts
        self.can_go_ahead = self.spec.ahead_on  # random drafts never do: on for "ahead" alone

    def prompts(self, batch: int) -> list[list[int]]:
        rng = random.Random(self.args.seed)
        vocab = self.llm.engine.model_config.vocab_size
        return [[rng.randrange(vocab) for _ in range(self.args.input_len)] for _ in range(batch)]

    def run(
        self, batch: int, mode: str, k: int, on: Clock | profile | None = None
    ) -> list[tuple[str, float]]:
        """One generate: mode "plain", "verify" (every step), "every" (every `--every`-th
        step) or "ahead" (every step, the drafts the plain run's own tokens, each verify
        launched ahead of the one before it), k drafts a request. The (kind, seconds) of the
        measured steps; `on` (a clock or a profiler) runs over them."""
        from minisgl.core import SamplingParams
        from minisgl.speculative.cost import StepCosts

        args, sched, spec = self.args, self.sched, self.spec
        spec.enabled = mode != "plain"
        spec.ahead_on = mode == "ahead"
        if mode != "ahead":
            self.drafts.oracle = None
        spec.costs = StepCosts()  # what the engine measures in this run alone
        spec.acceptance.draft_len = lambda uid: k  # as many as the request's length allows
        step_fn = type(sched).step.__get__(sched)
        starts: list[float] = []
        kinds: list[str] = []

        def step() -> list:
            steady = not sched.prefill.has_work and len(sched.decode.running) == batch
            n = len(starts)
            every = mode == "every" and n % args.every == 0
            self.drafts.on = mode in ("verify", "ahead") or every
            if not steady:
                self.drafts.on = False
            if on is not None and steady and n == SKIP:
                switch(on, True, args.device)
            forwards, began = spec.num_forwards, time.perf_counter()
            if on is not None and steady and n == SKIP + args.steps:
                switch(on, False, args.device)  # after the last interval's end
            out = on.step(step_fn) if isinstance(on, Clock) and on.on else step_fn()
            if steady and n <= SKIP + args.steps:
                starts.append(began)
                kinds.append("verify" if spec.num_forwards > forwards else "plain")
            return out

        tokens = generated(args, k if mode == "ahead" else 0)
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        prompts = self.prompts(batch)
        with patched({(sched, "step"): step}):
            outs = self.llm.generate(prompts, params, use_tqdm=False)
        if mode == "plain":  # what an "ahead" run drafts
            self.plain = {tuple(p): o["token_ids"] for p, o in zip(prompts, outs)}
        if len(starts) < SKIP + args.steps + 1:
            raise SystemExit(f"batch {batch}: the requests never decoded steadily together")
        return [(kinds[i], starts[i + 1] - starts[i]) for i in range(SKIP, SKIP + args.steps)]

    def round(self, batch: int) -> list[dict]:
        """For each k: a plain run, a verify run, a run that verifies every --every-th."""
        rows = []
        for k in self.args.ks:
            plain = statistics.median(s for _, s in self.run(batch, "plain", k))
            runs = self.run(batch, "verify", k)
            verify = statistics.median(s for kind, s in runs if kind == "verify")
            steps = self.run(batch, "every", k)
            verifies = sum(kind == "verify" for kind, _ in steps)
            among = (sum(s for _, s in steps) - (len(steps) - verifies) * plain) / max(verifies, 1)
            engine = self.spec.costs.ratio(batch)
            row = dict(k=k, plain=plain, verify=verify, among=among, engine=engine)
            if self.can_go_ahead:
                self.drafts.oracle = self.plain
                spec = self.spec
                before = (spec.num_accepted, spec.num_steps, spec.num_ahead, spec.num_ahead_dead)
                runs = self.run(batch, "ahead", k)
                row["ahead"] = statistics.median(s for kind, s in runs if kind == "verify")
                taken, verified, ahead, dead = (
                    now - then
                    for now, then in zip(
                        (spec.num_accepted, spec.num_steps, spec.num_ahead, spec.num_ahead_dead),
                        before,
                    )
                )
                row["taken"] = taken / max(verified, 1)  # drafts taken a request and verify
                row["dead"] = dead / max(ahead * batch, 1)  # rows launched ahead in vain
            rows.append(row)
        return rows


def generated(args: argparse.Namespace, taken: int) -> int:
    """Tokens a run generates: enough for its measured steps when each takes `taken` drafts."""
    return (SKIP + args.steps + 2) * (taken + 1) + max(args.ks) + 4


def switch(on: Clock | profile, start: bool, device: str) -> None:
    """The clock or the profiler on at the first measured step, off after the last."""
    sync(device)
    if isinstance(on, Clock):
        on.on = start
    elif start:
        on.start()
    else:
        on.stop()


def curve(bench: Bench, args: argparse.Namespace) -> list[dict]:
    """The cost curve: every batch and k, warmed, then --rounds alternating rounds."""
    out = []
    for batch in args.batches:
        bench.round(batch)  # the warm-up: every shape either side meets
        rounds = [bench.round(batch) for _ in range(args.rounds)]
        plains = [r["plain"] for rows in rounds for r in rows]
        noise = (max(plains) - min(plains)) / statistics.median(plains)
        for i, k in enumerate(args.ks):
            runs = [rows[i] for rows in rounds]

            def med(key: str, runs: list[dict] = runs) -> float:
                return statistics.median(r[key] for r in runs)

            out.append(
                dict(
                    batch=batch,
                    k=k,
                    decode_ms=med("plain") * 1e3,
                    verify_ms=med("verify") * 1e3,
                    ratio=statistics.median(r["verify"] / r["plain"] for r in runs),
                    among_ms=med("among") * 1e3,
                    among_ratio=statistics.median(r["among"] / r["plain"] for r in runs),
                    engine_ratio=med("engine"),
                    noise=noise,
                )
            )
            if "ahead" in runs[0]:  # verifies launched ahead, drafts the model's own tokens
                out[-1].update(
                    ahead_ms=med("ahead") * 1e3,
                    ahead_ratio=statistics.median(r["ahead"] / r["plain"] for r in runs),
                    taken=med("taken"),
                    dead=med("dead"),
                )
    return out


PHASES = [
    ("drafting", "spec", "_draft"),
    ("drain: the step in flight, processed", "sched", "drain"),
    ("pages", "cache", "allocate"),
    ("batch metadata", "engine", "prepare_batch"),
    ("drafts into the token pool", "spec", "_place"),
    ("forward (launched)", "engine", "logits"),
    ("sampling (launched)", "engine", "sample_logits"),
    ("acceptance (launched)", "module", "accept_into_pool"),
    ("a hybrid's states rolled back (launched)", "pool", "keep_accepted"),  # [ch31]
    ("copy back and wait for the device", "spec", "_read_back"),
    ("emit the accepted tokens", "spec", "_emit"),
]
REST = "the rest of the step (scheduling, glue)"
OUTSIDE = "outside the step (the offline loop)"


def timeline(bench: Bench, batch: int, k: int) -> dict[str, dict[str, float]]:
    """ms per step by phase, for a verify step and a decode step (runs of their own)."""
    import minisgl.speculative.step as step_module

    owners = {
        "spec": bench.spec,
        "sched": bench.sched,
        "cache": bench.sched.cache,
        "engine": bench.llm.engine,
        "module": step_module,
        "pool": bench.llm.engine.state_pool,  # None but for a hybrid  # [ch31]
    }
    table: dict[str, dict[str, float]] = {}
    for side, mode in (("verify", "verify"), ("decode", "plain")):
        clock = Clock()
        wraps = {}
        for name, owner, attr in PHASES:
            if (obj := owners[owner]) is not None:
                wraps[(obj, attr)] = clock.wrap(name, getattr(obj, attr))
        with patched(wraps):
            steps = bench.run(batch, mode, k, on=clock)
        interval = sum(s for _, s in steps) / len(steps)
        column = {name: clock.wall.get(name, 0.0) / len(steps) for name, _, _ in PHASES}
        whole = clock.wall.get("step", 0.0) / len(steps)
        column[REST] = whole - sum(column.values())
        column["the step"] = whole
        column[OUTSIDE] = interval - whole
        column["interval between steps"] = interval
        for name, seconds in column.items():
            table.setdefault(name, {})[side] = seconds * 1e3
    return table


def kernels(bench: Bench, batch: int, k: int, top: int) -> list[dict]:
    """torch.profiler over the measured steps of a verify run and a plain run: the top
    kernels (on a CPU, operators) by time per step, verify beside decode."""
    cuda = bench.args.device.startswith("cuda")
    per: dict[str, dict[str, tuple[float, float]]] = {}
    for side, mode in (("verify", "verify"), ("decode", "plain")):
        prof = profile(
            activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        )
        steps = len(bench.run(batch, mode, k, on=prof))
        for e in prof.key_averages():
            if cuda and e.device_type.name != "CUDA":
                continue
            us = e.self_device_time_total if cuda else e.self_cpu_time_total
            if us > 0:
                per.setdefault(e.key, {})[side] = (us / 1e3 / steps, e.count / steps)
    rows = [
        dict(
            name=name,
            **{f"{s}_ms": v.get(s, (0.0, 0.0))[0] for s in ("verify", "decode")},
            **{f"{s}_calls": v.get(s, (0.0, 0.0))[1] for s in ("verify", "decode")},
        )
        for name, v in per.items()
    ]
    rows.sort(key=lambda r: -max(r["verify_ms"], r["decode_ms"]))
    total = {s: sum(r[f"{s}_ms"] for r in rows) for s in ("verify", "decode")}
    calls = {s: sum(r[f"{s}_calls"] for r in rows) for s in ("verify", "decode")}
    return [
        dict(
            name="all",
            **{f"{s}_ms": total[s] for s in total},
            **{f"{s}_calls": calls[s] for s in calls},
        )
    ] + rows[:top]


def report(out: dict[str, Any], args: argparse.Namespace) -> None:
    overlap = "on" if out["overlap"] else "off"
    print(
        f"\n{args.model}, {args.dtype} on {args.device}, overlap {overlap}, graphs up to batch "
        f"{args.cuda_graph_max_bs}; {args.steps} steps a run, medians of {args.rounds} rounds"
    )
    print(
        "| batch | drafts k | decode ms | verify ms | verify / decode | verify among decodes "
        f"(every {args.every}th) ms | among / decode | engine's estimate | noise floor |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in out["curve"]:
        print(
            f"| {r['batch']} | {r['k']} | {r['decode_ms']:.3f} | {r['verify_ms']:.3f} | "
            f"{r['ratio']:.2f} | {r['among_ms']:.3f} | {r['among_ratio']:.2f} | "
            f"{r['engine_ratio']:.2f} | ±{r['noise']:.1%} |"
        )
    if any("ahead_ms" in r for r in out["curve"]):
        print(
            "\nverifies launched ahead (drafts: the plain run's own tokens, each verify launched"
            " before the one before it is read)"
        )
        print("| batch | drafts k | decode ms | verify ahead ms | ahead / decode | "
              "drafts taken a verify | rows in vain |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        for r in out["curve"]:
            print(
                f"| {r['batch']} | {r['k']} | {r['decode_ms']:.3f} | {r['ahead_ms']:.3f} | "
                f"{r['ahead_ratio']:.2f} | {r['taken']:.2f} | {r['dead']:.0%} |"
            )
    for batch, table in out["timeline"].items():
        print(f"\nhost timeline, batch {batch}, {args.timeline_k} drafts (ms per step)")
        print("| phase | verify step | decode step |")
        print("|---|---|---|")
        for name, sides in table.items():
            print(f"| {name} | {sides['verify']:.3f} | {sides['decode']:.3f} |")
    if out.get("kernels"):
        what = "kernels by device time" if args.device.startswith("cuda") else "operators, CPU time"
        print(f"\n{what} per step, batch {min(args.batches)}, {args.timeline_k} drafts")
        print("| name | verify ms | verify calls | decode ms | decode calls |")
        print("|---|---|---|---|---|")
        for r in out["kernels"]:
            print(
                f"| {r['name'][:80]} | {r['verify_ms']:.3f} | {r['verify_calls']:.1f} | "
                f"{r['decode_ms']:.3f} | {r['decode_calls']:.1f} |"
            )


def engine(args: argparse.Namespace) -> Any:
    """The engine every run drives: speculation always on, the drafter replaced by `Bench`."""
    from minisgl.llm import LLM

    bs = max(args.batches)
    tokens = args.input_len + generated(args, max(args.ks)) + 2 * max(args.ks) + 8
    return LLM(
        **engine_kwargs(args),
        speculative="ngram",
        num_draft_tokens=max(args.ks),
        speculative_always=True,
        speculative_max_bs=bs,
        max_running_req=bs,
        num_page_override=bs * tokens + 64,
        max_seq_len_override=tokens,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
    )


def compare_variants(args: argparse.Namespace, variants: dict[str, dict[str, str]]) -> None:
    """Each round, a fresh engine per variant in turn, warmed, and one round of its curve."""
    from minisgl.env import ENV

    saved = {k: getattr(ENV, k).value for v in variants.values() for k in v}
    one = argparse.Namespace(**{**vars(args), "rounds": 1})
    runs: dict[str, list[list[dict]]] = {name: [] for name in variants}
    try:
        for r in range(args.rounds):
            for name, settings in variants.items():
                set_knobs(settings)
                llm = engine(one)
                try:
                    runs[name].append(curve(Bench(llm, one), one))
                finally:
                    llm.shutdown()
                row = runs[name][-1][-1]
                print(f"round {r + 1} {name}: batch {row['batch']} k {row['k']} verify "
                      f"{row['verify_ms']:.3f} ms, {row['ratio']:.2f} decode steps",
                      flush=True)  # fmt: skip
    finally:
        for knob, value in saved.items():
            getattr(ENV, knob).value = value
    first = next(iter(variants))
    print(f"\n{args.model}, {args.dtype} on {args.device}; {args.steps} steps a run, "
          f"{args.rounds} alternating rounds, each variant a fresh engine a round")  # fmt: skip
    print("| variant | batch | drafts k | decode ms, rounds | verify ms, rounds | "
          f"verify / decode, rounds | mean | {first}'s mean / this | among decodes (every "
          f"{args.every}th) / decode, rounds |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    means: dict[str, list[float]] = {}
    for name, rounds in runs.items():
        means[name] = []
        for i, row in enumerate(rounds[0]):
            rows = [r[i] for r in rounds]
            mean = statistics.mean(r["ratio"] for r in rows)
            means[name].append(mean)
            shown = (("decode_ms", ".3f"), ("verify_ms", ".3f"), ("ratio", ".2f"))
            cells = [" / ".join(f"{r[key]:{fmt}}" for r in rows) for key, fmt in shown]
            among = " / ".join(f"{r['among_ratio']:.2f}" for r in rows)
            print(f"| {name} | {row['batch']} | {row['k']} | {' | '.join(cells)} | {mean:.2f} | "
                  f"{means[first][i] / mean:.3f}x | {among} |")  # fmt: skip
    if args.output_json:
        found = {"variants": variants, "runs": runs}
        Path(args.output_json).write_text(json.dumps(found, indent=1))


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(p, tp_size=None)
    p.add_argument("--ks", type=ints, default=[1, 2, 4, 8, 16], help="drafts per request")
    p.add_argument("--batches", type=ints, default=[1, 2, 4, 8])
    p.add_argument("--steps", type=int, default=32, help="steps timed per run")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds after a warm-up")
    p.add_argument("--every", type=int, default=4, help="the mixed run verifies every Nth step")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--timeline-k", type=int, default=8, help="drafts for the timeline, profile")
    p.add_argument("--profile", action="store_true", help="torch.profiler's kernel table too")
    p.add_argument("--top", type=int, default=15, help="rows of the kernel table")
    p.add_argument("--overlap", choices=["on", "off"], help="default: the server's (on on a GPU)")
    p.add_argument("--cuda-graph-max-bs", type=int, help="default: the largest batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", help="NAME:KNOB=V,KNOB=V;NAME:...: MINISGL_* settings, ABAB")
    p.add_argument("--output-json")
    args = parse(p)
    if args.every < 2 or args.steps < args.every:
        p.error("--every must be at least 2 and at most --steps")
    if args.timeline_k not in args.ks:
        args.ks = sorted({*args.ks, args.timeline_k})
    if args.cuda_graph_max_bs is None:
        args.cuda_graph_max_bs = max(args.batches)
    args.steps -= args.steps % args.every  # whole periods of the mixed run

    from minisgl.env import ENV

    if args.overlap is not None:  # read when the scheduler is built
        ENV.DISABLE_OVERLAP_SCHEDULING.value = args.overlap == "off"
    args.speculative = "off"  # the engine's drafter is replaced; its settings are in `engine`
    if args.variants:
        return compare_variants(args, parse_variants(args.variants))
    llm = engine(args)
    try:
        bench = Bench(llm, args)
        out: dict[str, Any] = {"overlap": llm.scheduler.overlap, "curve": curve(bench, args)}
        out["timeline"] = {b: timeline(bench, b, args.timeline_k) for b in args.batches}
        if args.profile:
            out["kernels"] = kernels(bench, min(args.batches), args.timeline_k, args.top)
        report(out, args)
        if args.output_json:
            Path(args.output_json).write_text(json.dumps(out, indent=1))
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
