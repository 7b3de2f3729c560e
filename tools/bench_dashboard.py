"""What the live page costs the scheduler: decode step time with a page watching and without.

The scheduler runs as its worker loop runs it (scheduler/io.py): each step, its stats, the
observer's snapshot when one is due, and the whole output encoded with msgpack as for the
socket; only the socket itself is left out. Each batch size is run in alternating rounds,
without a watch lease and with one (what an open page holds), so that a drift of the
machine falls on both; the figure is the median time between two steps where every
request decodes. Beside it: how long building and encoding one snapshot takes, what the
host spends a step on the page while it watches (the step log's two hooks, and `publish`
on the steps without a snapshot), and what the two hooks cost a step when nobody watches
(the scheduler calls them anyway).

    python tools/bench_dashboard.py --model /tmp/qwen3-0.6b --batch-sizes 1,64
    python tools/bench_dashboard.py --model models/SmolLM2-135M-Instruct --batch-sizes 1,8
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
import timeit
from typing import Any

from common import add_engine_args, engine_kwargs, parse

UIDS = itertools.count()


def timed(spent: list[float], fn: Any) -> Any:
    """`fn`, adding the seconds each call takes to `spent[0]`, and one to `spent[1]`."""

    def call(*a: Any) -> Any:
        began = time.perf_counter()
        out = fn(*a)
        spent[0] += time.perf_counter() - began
        spent[1] += 1
        return out

    return call


def run_round(observer: object, prompts: list[list[int]], args: argparse.Namespace, watch: bool):
    """One batch to completion through the worker loop; (step gaps s, snapshot costs s,
    host seconds a step in the hooks, in `publish` without a snapshot)."""
    from minisgl.core import SamplingParams
    from minisgl.message.backend import SchedulerOutput, UserMsg
    from minisgl.message.codec import encode
    from minisgl.message.dashboard import WatchMsg
    from minisgl.scheduler.io import scheduler_stats

    sched = observer.s
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    msgs = [UserMsg(next(UIDS), ids, params) for ids in prompts]
    messages = ([WatchMsg(3600.0)] if watch else []) + msgs
    observer.receive(messages)
    sched.receive(messages)
    log, hooks, quiet = observer.log, [0.0, 0], []
    log.forward_begins = timed(hooks, type(log).forward_begins.__get__(log))
    log.forward_launched = timed(hooks, type(log).forward_launched.__get__(log))
    stamps, snapshots = [], []
    while sched.has_work:
        tokens = sched.step()
        began = time.perf_counter()
        output = SchedulerOutput(tokens, scheduler_stats(sched))
        published = time.perf_counter()
        output.dashboard = observer.publish(tokens)
        if output.dashboard is None and watch:
            quiet.append(time.perf_counter() - published)
        encode(output)
        if output.dashboard is not None:
            snapshots.append(time.perf_counter() - began)
        if not sched.prefill.has_work and sched.decode.running:
            stamps.append(time.perf_counter())
    if watch:  # the page closes: the lease ends at the next publish
        observer.receive([WatchMsg(0.0)])
        observer.publish([])
    gaps = [b - a for a, b in zip(stamps, stamps[1:])][2:]  # the first steps warm up
    del log.forward_begins, log.forward_launched
    per_step = 2 * hooks[0] / max(hooks[1], 1)  # a forward calls both hooks
    return gaps, snapshots, per_step, statistics.median(quiet) if quiet else 0.0


def hooks_ns(llm: object) -> float:
    """ns a step for telling the forward's listeners while nobody watches (there are none)."""
    from minisgl.core import Batch

    listeners, batch = llm.scheduler.listeners, Batch([], "decode")

    def tell() -> None:  # what Scheduler.forward does around the forward
        for listener in listeners:
            listener.forward_begins(batch)
        for listener in listeners:
            listener.forward_launched(batch)

    n = 200_000
    spent = timeit.timeit(tell, number=n)
    empty = timeit.timeit(lambda: None, number=n)  # the lambda's own call
    return (spent - empty) / n * 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(p)
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each, alternating")
    p.add_argument("--seed", type=int, default=0)
    args = parse(p)
    sizes = [int(x) for x in args.batch_sizes.split(",")]

    from minisgl.llm import LLM
    from minisgl.models.config import ModelConfig
    from minisgl.scheduler.observe import Observer

    tokens = args.input_len + args.output_len + 8
    llm = LLM(
        **engine_kwargs(args),
        max_running_req=max(sizes),
        num_page_override=max(sizes) * tokens * 2,  # room for the radix cache to keep some
        max_seq_len_override=tokens,
        cuda_graph_bs=sorted(set(sizes)),
    )
    observer = Observer(llm.scheduler)
    vocab, rng = ModelConfig.from_path(args.model).vocab_size, random.Random(args.seed)

    def prompts(n: int) -> list[list[int]]:  # fresh ones: the prefix cache never helps
        return [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(n)]

    import torch

    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"{name}, {args.model}, {args.dtype}, prompt {args.input_len}, {args.output_len} steps")
    print(f"the step log's two hooks without a page: {hooks_ns(llm):.0f} ns a step\n")
    print(
        "| batch | step ms, no page | step ms, page open | cost | snapshots | ms each"
        " | hooks us/step | publish us/step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for bs in sizes:
        run_round(observer, prompts(bs), args, watch=False)  # warm-up
        off, on, snaps, hook_s, publish_s = [], [], [], [], []
        for _ in range(args.rounds):
            off += run_round(observer, prompts(bs), args, watch=False)[0]
            gaps, costs, hooks, quiet = run_round(observer, prompts(bs), args, watch=True)
            on += gaps
            snaps += costs
            hook_s.append(hooks)
            publish_s.append(quiet)
        a, b = statistics.median(off) * 1e3, statistics.median(on) * 1e3
        each = statistics.median(snaps) * 1e3 if snaps else float("nan")
        hooks, quiet = statistics.median(hook_s) * 1e6, statistics.median(publish_s) * 1e6
        cost, host = f"{100 * (b / a - 1):+.2f}%", f"{hooks:.1f} | {quiet:.1f}"
        print(f"| {bs} | {a:.3f} | {b:.3f} | {cost} | {len(snaps)} | {each:.2f} | {host} |")
    llm.shutdown()


if __name__ == "__main__":
    main()
