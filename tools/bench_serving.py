"""Online serving benchmark: an OpenAI-API load generator for any compatible server.

Requests arrive as a Poisson process at --request-rate (or all at once, at most
--max-concurrency in flight), each one streamed, and the client times what a user feels:
time to first token (TTFT), time per output token after the first (TPOT), the gaps between
streamed chunks (ITL) and the whole request (E2E). The same tool measures minisgl,
`transformers serve`, vLLM or SGLang; it talks to --base-url and nothing else.

    python tools/bench_serving.py --base-url http://127.0.0.1:1919 \\
        --model models/SmolLM2-135M-Instruct --num-prompts 64 --request-rate 2
    python tools/bench_serving.py ... --sweep 1,2,4,8 --output-json minisgl.json
    python tools/bench_serving.py --compare minisgl.json hf.json --plot serving.png

Prompts are random token ids of random lengths (decoded to text, so the server's own
tokenizer counts them; the token counts reported come from the server's `usage`), or the
conversations of a JSONL file (`{"messages": [...]}` or ShareGPT's `{"conversations": ...}`),
each cut before its last assistant turn, whose length becomes the request's max_tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

try:
    import httpx
except ModuleNotFoundError:  # the openai client may come with the httpx2 fork instead
    import httpx2 as httpx


@dataclass
class Request:
    prompt: str | list[dict[str, str]]  # text for /v1/completions, messages for chat
    max_tokens: int


@dataclass
class Outcome:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


# ---- the dataset ------------------------------------------------------------------------


def load_tokenizer(path: str) -> Any:
    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        sys.exit(f"no tokenizer at {file}: pass --tokenizer with a local model folder")
    return Tokenizer.from_file(str(file))


def spread(mean: int, ratio: float, rng: random.Random) -> int:
    return max(1, rng.randint(int(mean * (1 - ratio)), int(mean * (1 + ratio))))


def random_dataset(args: argparse.Namespace, seed: int) -> list[Request]:
    tok = load_tokenizer(args.tokenizer)
    vocab, rng = tok.get_vocab_size(), random.Random(seed)
    reqs = []
    for _ in range(args.num_prompts):
        ids = [rng.randrange(vocab) for _ in range(spread(args.random_input_len, args.ratio, rng))]
        text = tok.decode(ids, skip_special_tokens=True) or "hello"
        reqs.append(Request(text, spread(args.random_output_len, args.ratio, rng)))
    return reqs


def chat_turns(record: dict[str, Any]) -> list[dict[str, str]]:
    if "messages" in record:
        return [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
    roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
    return [
        {"role": roles.get(t["from"], t["from"]), "content": t["value"]}
        for t in record["conversations"]
    ]


def jsonl_dataset(args: argparse.Namespace, seed: int) -> list[Request]:
    tok = load_tokenizer(args.tokenizer) if args.tokenizer else None
    pool = []
    with open(args.dataset_path) as f:
        for line in f:
            if not line.strip():
                continue
            turns = chat_turns(json.loads(line))
            reply = turns.pop() if turns and turns[-1]["role"] == "assistant" else None
            if not turns:
                continue
            n = len(tok.encode(reply["content"]).ids) if reply and tok else args.random_output_len
            pool.append(Request(turns, max(1, min(n, args.max_output_len))))
    if not pool:
        sys.exit(f"{args.dataset_path} has no conversation with a user turn")
    random.Random(seed).shuffle(pool)
    return [pool[i % len(pool)] for i in range(args.num_prompts)]


# ---- one request ------------------------------------------------------------------------


def request_body(args: argparse.Namespace, req: Request) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": args.model,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body["messages" if isinstance(req.prompt, list) else "prompt"] = req.prompt
    if args.ignore_eos and args.backend == "transformers":  # it takes a generation config
        n = req.max_tokens
        config = {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False}
        body["generation_config"] = json.dumps(config)
    elif args.ignore_eos:
        body["ignore_eos"] = True  # vLLM's, SGLang's and minisgl's extension
    return {**body, **args.extra_request_body}


async def send(client: httpx.AsyncClient, args: argparse.Namespace, req: Request) -> Outcome:
    chat = isinstance(req.prompt, list)
    url = args.base_url + ("/v1/chat/completions" if chat else "/v1/completions")
    out, chunks = Outcome(), 0
    start = last = time.perf_counter()
    async with client.stream("POST", url, json=request_body(args, req)) as r:
        if r.status_code != 200:
            out.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                out.error = str(chunk["error"])[:200]
                return out
            if usage := chunk.get("usage"):
                out.prompt_tokens = usage.get("prompt_tokens", 0)
                out.output_tokens = usage.get("completion_tokens", 0)
            for choice in chunk.get("choices", []):
                text = choice.get("delta", {}).get("content") if chat else choice.get("text")
                if not text:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    out.ttft = now - start
                else:
                    out.itl.append(now - last)
                last, chunks = now, chunks + 1
    out.latency = time.perf_counter() - start
    out.output_tokens = out.output_tokens or chunks  # a server without usage: one per chunk
    out.ok = chunks > 0 or out.output_tokens > 0
    out.error = "" if out.ok else "no tokens came back"
    return out


async def timed(client: httpx.AsyncClient, args: argparse.Namespace, req: Request) -> Outcome:
    try:  # one deadline for the whole request: a server that stalls mid-stream is an error
        return await asyncio.wait_for(send(client, args, req), args.request_timeout)
    except asyncio.TimeoutError:
        return Outcome(error=f"no complete answer within {args.request_timeout:.0f} s")
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        return Outcome(error=f"{type(e).__name__}: {e}"[:200])


# ---- one run ----------------------------------------------------------------------------


async def run(args: argparse.Namespace, reqs: list[Request], rate: float) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.request_timeout)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        # Prompts of their own: a prefix cache must not get a head start on the measured ones.
        hello = f"Hello number {{}}, {args.seed}"
        chat = isinstance(reqs[0].prompt, list)
        warm = [
            Request([{"role": "user", "content": hello.format(i)}] if chat else hello.format(i), 4)
            for i in range(args.warmup)
        ]
        for outcome in await asyncio.gather(*(timed(client, args, r) for r in warm)):
            if not outcome.ok:  # together: the server meets a batch before the clock starts
                sys.exit(f"warm-up request to {args.base_url} failed: {outcome.error}")
        gate = asyncio.Semaphore(args.max_concurrency or len(reqs))
        bar = tqdm(total=len(reqs), desc=f"rate {rate:g}/s", disable=args.disable_tqdm)

        async def one(req: Request) -> Outcome:
            async with gate:
                outcome = await timed(client, args, req)
            bar.update()
            return outcome

        arrivals = random.Random(args.seed)
        tasks = []
        start = time.perf_counter()
        for req in reqs:
            tasks.append(asyncio.create_task(one(req)))
            if math.isfinite(rate):
                await asyncio.sleep(arrivals.expovariate(rate))
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return summarize(outcomes, duration, rate, args.max_concurrency)


def percentiles(values: list[float]) -> dict[str, float]:
    """mean, p50, p90, p99 in milliseconds."""
    if not values:
        return {k: float("nan") for k in ("mean", "p50", "p90", "p99")}
    ms = np.asarray(values) * 1000
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"mean": float(ms.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(outcomes: list[Outcome], duration: float, rate: float, conc: int) -> dict[str, Any]:
    good = [o for o in outcomes if o.ok]
    output = sum(o.output_tokens for o in good)
    errors: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            errors[o.error] = errors.get(o.error, 0) + 1
    return {
        "request_rate": rate if math.isfinite(rate) else "inf",
        "max_concurrency": conc,
        "duration_s": duration,
        "completed": len(good),
        "failed": len(outcomes) - len(good),
        "errors": errors,
        "input_tokens": sum(o.prompt_tokens for o in good),
        "output_tokens": output,
        "request_throughput": len(good) / duration,
        "output_throughput": output / duration,
        "ttft_ms": percentiles([o.ttft for o in good]),
        "tpot_ms": percentiles(
            [(o.latency - o.ttft) / (o.output_tokens - 1) for o in good if o.output_tokens > 1]
        ),
        "itl_ms": percentiles([gap for o in good for gap in o.itl]),
        "e2e_ms": percentiles([o.latency for o in good]),
    }


def print_result(r: dict[str, Any]) -> None:
    rows = [
        ("request rate (req/s)", r["request_rate"]),
        ("max concurrency", r["max_concurrency"] or "-"),
        ("duration (s)", f"{r['duration_s']:.1f}"),
        ("completed", r["completed"]),
        ("failed", r["failed"]),
        ("input tokens", r["input_tokens"]),
        ("output tokens", r["output_tokens"]),
        ("requests/s", f"{r['request_throughput']:.2f}"),
        ("output tok/s", f"{r['output_throughput']:.1f}"),
    ]
    print("\n".join(f"{name:<24}{value:>12}" for name, value in rows))
    print(f"{'(ms)':<8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = r[f"{name}_ms"]
        print(
            f"{name.upper():<8}" + "".join(f"{s[k]:>10.1f}" for k in ("mean", "p50", "p90", "p99"))
        )
    for error, count in r["errors"].items():
        print(f"error x{count}: {error}")


# ---- sweeps and plots -------------------------------------------------------------------


def sustainable(points: list[dict[str, Any]], slo_ms: float) -> float | None:
    """The highest rate that lost nothing and kept TTFT p99 under the SLO."""
    good = [p for p in points if not p["failed"] and p["ttft_ms"]["p99"] < slo_ms]
    return max((float(p["request_rate"]) for p in good), default=None)


def print_sweep(label: str, points: list[dict[str, Any]], slo_ms: float) -> None:
    print(f"\n{label}")
    print("| rate (req/s) | done | failed | req/s | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 |")
    print("|---|---|---|---|---|---|---|---|")
    for p in points:
        t, o = p["ttft_ms"], p["tpot_ms"]
        print(
            f"| {p['request_rate']} | {p['completed']} | {p['failed']} "
            f"| {p['request_throughput']:.2f} | {p['output_throughput']:.1f} "
            f"| {t['p50']:.0f} ms | {t['p99']:.0f} ms | {o['p50']:.1f} ms |"
        )
    print(f"sustainable rate (TTFT p99 < {slo_ms:.0f} ms): {sustainable(points, slo_ms)} req/s")


def gather_sweeps(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sweeps, and single runs grouped by label into sweeps (runs interleaved by hand)."""
    by_label: dict[str, dict[str, Any]] = {}
    for r in reports:
        sweep = by_label.setdefault(r["label"], {**r, "points": []})
        sweep["points"] += r.get("points", [r])
    for sweep in by_label.values():
        sweep["points"].sort(key=lambda p: float(p["request_rate"]))
    return list(by_label.values())


def plot(sweeps: list[dict[str, Any]], path: str, slo_ms: float) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for s in sweeps:
        rates = [float(p["request_rate"]) for p in s["points"]]
        left.plot(rates, [p["ttft_ms"]["p99"] / 1000 for p in s["points"]], "o-", label=s["label"])
        right.plot(rates, [p["tpot_ms"]["p50"] for p in s["points"]], "o-", label=s["label"])
    left.axhline(slo_ms / 1000, color="grey", linestyle="--", linewidth=1, label="TTFT SLO")
    left.set(xlabel="request rate (req/s)", ylabel="TTFT p99 (s, log scale)", yscale="log")
    left.yaxis.set_minor_locator(matplotlib.ticker.LogLocator(subs=(2.0, 5.0)))
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    left.yaxis.set_major_formatter(plain)
    left.yaxis.set_minor_formatter(plain)
    right.set(xlabel="request rate (req/s)", ylabel="TPOT p50 (ms)", ylim=(0, None))
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(sweeps[0].get("workload", ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


# ---- the command line -------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:1919")
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct", help="the served name")
    p.add_argument("--tokenizer", help="a local model folder (default: --model)")
    p.add_argument("--backend", choices=["openai", "transformers"], default="openai")
    p.add_argument("--dataset", choices=["random", "jsonl"], default="random")
    p.add_argument("--dataset-path", help="the JSONL file of --dataset jsonl")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument(
        "--random-range-ratio",
        dest="ratio",
        type=float,
        default=0.5,
        help="lengths are uniform in [len * (1 - r), len * (1 + r)]",
    )
    p.add_argument("--max-output-len", type=int, default=512, help="cap on a JSONL reply")
    p.add_argument("--ignore-eos", action="store_true", help="every request its full length")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="req/s (Poisson)")
    p.add_argument("--max-concurrency", type=int, default=0, help="0: no limit")
    p.add_argument("--sweep", help="comma-separated request rates, one run each")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--warmup", type=int, default=4, help="requests before timing starts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extra-request-body", type=json.loads, default={}, help="JSON merged in")
    p.add_argument("--label", help="the name in tables and plots (default: --base-url)")
    p.add_argument("--output-json")
    p.add_argument("--plot", help="PNG of a --sweep or of --compare")
    p.add_argument("--compare", nargs="+", help="result JSON files drawn together, no requests")
    p.add_argument("--disable-tqdm", action="store_true")
    args = p.parse_args()
    args.base_url = args.base_url.rstrip("/")
    args.tokenizer = args.tokenizer or (args.model if Path(args.model).is_dir() else None)
    if args.dataset == "random" and not args.tokenizer and not args.compare:
        p.error("random prompts need a local tokenizer: pass --tokenizer")
    if args.dataset == "jsonl" and not args.dataset_path:
        p.error("--dataset jsonl needs --dataset-path")
    return args


def main() -> None:
    args = parse_args()
    if args.compare:
        sweeps = gather_sweeps([json.loads(Path(f).read_text()) for f in args.compare])
        for s in sweeps:
            print_sweep(s["label"], s["points"], args.slo_ttft_ms)
        plot(sweeps, args.plot or "serving.png", args.slo_ttft_ms)
        return
    make = jsonl_dataset if args.dataset == "jsonl" else random_dataset
    label = args.label or args.base_url
    if args.dataset == "random":
        n_in, n_out, r = args.random_input_len, args.random_output_len, args.ratio
        workload = f"{args.num_prompts} random prompts, input {n_in}, output {n_out} (+-{r:.0%})"
    else:
        workload = f"{args.num_prompts} conversations of {args.dataset_path}"
    workload += ", EOS ignored" if args.ignore_eos else ""
    if not args.sweep:
        result = asyncio.run(run(args, make(args, args.seed), args.request_rate))
        print(f"\n{label}: {workload}")
        print_result(result)
        report: dict[str, Any] = {"label": label, "workload": workload, **result}
    else:
        rates = [float(r) for r in args.sweep.split(",")]
        points = []
        for i, rate in enumerate(rates):  # fresh prompts per rate: no prefix cache across runs
            points.append(asyncio.run(run(args, make(args, args.seed + i), rate)))
            print_result(points[-1])
        print_sweep(label, points, args.slo_ttft_ms)
        report = {"label": label, "workload": workload, "points": points}
        report["sustainable_rate"] = sustainable(points, args.slo_ttft_ms)
        if args.plot:
            plot([report], args.plot, args.slo_ttft_ms)
    report["args"] = {k: str(v) if v == float("inf") else v for k, v in vars(args).items()}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
