"""What SGLang's router costs, and when two replicas on one GPU beat one process.

Two comparisons, each measured side by side in one run on one machine:

1. Router overhead at batch 1: one server, asked directly and through the router (with
   that server its only worker), one request at a time, in turns (direct, router, direct,
   router): TTFT and ms per output token (TPOT).
2. Two replicas on one GPU against one process: the one process's KV pages (its
   /server_info) split in half between two processes on the same GPU, behind the router
   (round_robin), against the one process alone, on the same random prompts at several
   concurrencies: output tokens/s, TTFT and TPOT.

    python tools/bench_router.py --model /tmp/q06 --out /tmp/router      # the GPU figures
    python tools/bench_router.py --model models/tiny-llama --device cpu --smoke --out /tmp/r

The servers are `python -m minisgl` processes started from the working directory (so
PYTHONPATH=. is enough, nothing installed); the load is tools/bench_serving.py. Results go
to OUT/summary.json and the tables for docs/benchmarks.md are printed; servers' and the
router's logs stay in OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent


class Proc:
    """A child process in a session of its own, its output in OUT/<name>.log."""

    def __init__(self, name: str, cmd: list[str], out: Path, port: int, env: dict) -> None:
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        with (out / f"{name}.log").open("wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def wait_ready(self, path: str, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"{self.name} exited with {self.proc.returncode}; see its log")
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        sys.exit(f"{self.name} was not ready after {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server(args: argparse.Namespace, name: str, *extra: str) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "minisgl", "--model", args.model, "--port", str(port)]
    cmd += ["--device", args.device, *args.server_args.split(), *extra]
    if args.device == "cpu":
        cmd += ["--dtype", "float32"]
    env = dict(os.environ)
    if args.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    p = Proc(name, cmd, args.out, port, env)
    p.wait_ready("/health")
    return p


def router(args: argparse.Namespace, name: str, workers: list[Proc]) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--policy", "round_robin"]
    cmd += ["--worker-urls", *[w.url for w in workers], "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--prometheus-host", "127.0.0.1"]
    cmd += ["--prometheus-port", str(free_port()), "--log-level", "warn"]
    p = Proc(name, cmd, args.out, port, dict(os.environ))
    p.wait_ready("/readiness")
    return p


def bench(args: argparse.Namespace, url: str, label: str, conc: int, n: int, seed: int) -> dict:
    """One tools/bench_serving.py run: n random prompts, at most `conc` at a time."""
    out = args.out / f"{label}.json"
    cmd = [sys.executable, str(ROOT / "tools" / "bench_serving.py"), "--base-url", url]
    cmd += ["--model", args.name, "--tokenizer", args.model, "--num-prompts", str(n)]
    cmd += ["--random-input-len", str(args.input_len), "--random-output-len"]
    cmd += [str(args.output_len), "--random-range-ratio", "0", "--ignore-eos"]
    cmd += ["--max-concurrency", str(conc), "--warmup", str(min(conc, 8)), "--seed", str(seed)]
    cmd += ["--label", label, "--output-json", str(out), "--disable-tqdm"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    r = json.loads(out.read_text())
    if r["failed"]:
        sys.exit(f"{label}: {r['failed']} requests failed: {r['errors']}")
    return r


def batch1(args: argparse.Namespace, direct: Proc, routed: Proc) -> dict[str, Any]:
    runs: dict[str, list[dict]] = {"direct": [], "router": []}
    bench(args, routed.url, "batch1-warmup", 1, args.batch1_prompts, seed=99)  # not counted
    for turn in range(args.turns):
        for how, p in (("direct", direct), ("router", routed)):
            label = f"batch1-{how}-{turn}"
            runs[how].append(bench(args, p.url, label, 1, args.batch1_prompts, seed=turn))
    return {
        how: {
            "ttft_ms": statistics.median(r["ttft_ms"]["mean"] for r in rs),
            "tpot_ms": statistics.median(r["tpot_ms"]["mean"] for r in rs),
        }
        for how, rs in runs.items()
    }


def sweep(args: argparse.Namespace, url: str, setup: str) -> list[dict[str, Any]]:
    points = []
    for i, conc in enumerate(args.concurrency):
        n = max(args.min_prompts, 2 * conc)
        r = bench(args, url, f"{setup}-c{conc}", conc, n, seed=100 + i)
        points.append(
            {
                "concurrency": conc,
                "output_tok_s": r["output_throughput"],
                "ttft_ms": r["ttft_ms"]["mean"],
                "tpot_ms": r["tpot_ms"]["mean"],
            }
        )
    return points


def main() -> None:
    a = parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"model": a.model, "device": a.device}
    one = server(a, "one-process")
    try:
        info = httpx.get(one.url + "/server_info", timeout=10).json()
        a.name = info["served_model_name"]
        pages = info["max_total_num_tokens"] // info["page_size"]
        summary["kv_pages_one_process"] = pages
        front = router(a, "router-one-worker", [one])
        try:
            summary["batch1"] = batch1(a, one, front)
        finally:
            front.stop()
        summary["one_process"] = sweep(a, one.url, "one-process")
    finally:
        one.stop()
    half = str(pages // 2)
    replicas: list[Proc] = []
    try:
        for i in range(2):  # one after the other: each takes its memory before the next starts
            replicas.append(server(a, f"replica-{i}", "--num-pages", half))
        front = router(a, "router-two-replicas", replicas)
        try:
            summary["two_replicas"] = sweep(a, front.url, "two-replicas")
        finally:
            front.stop()
    finally:
        for p in replicas:
            p.stop()
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    report(summary)


def report(s: dict[str, Any]) -> None:
    b = s["batch1"]
    print(f"\nmodel {s['model']} on {s['device']}; batch 1, medians of the runs' means")
    print("| path | TTFT ms | TPOT ms |\n|---|---|---|")
    for how in ("direct", "router"):
        print(f"| {how} | {b[how]['ttft_ms']:.2f} | {b[how]['tpot_ms']:.3f} |")
    d_ttft = b["router"]["ttft_ms"] - b["direct"]["ttft_ms"]
    d_tpot = b["router"]["tpot_ms"] - b["direct"]["tpot_ms"]
    print(f"| router - direct | {d_ttft:+.2f} | {d_tpot:+.3f} |")
    print(f"\none process ({s['kv_pages_one_process']} KV pages) vs two replicas (half each)")
    print("| concurrency | one: tok/s | two: tok/s | ratio | one: TTFT / TPOT ms | two |")
    print("|---|---|---|---|---|---|")
    for o, t in zip(s["one_process"], s["two_replicas"]):
        ratio = t["output_tok_s"] / o["output_tok_s"]
        print(
            f"| {o['concurrency']} | {o['output_tok_s']:.0f} | {t['output_tok_s']:.0f} |"
            f" {ratio:.2f}x | {o['ttft_ms']:.1f} / {o['tpot_ms']:.2f} |"
            f" {t['ttft_ms']:.1f} / {t['tpot_ms']:.2f} |"
        )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="a model folder (random weights will do)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", type=Path, required=True, help="a folder for results and logs")
    p.add_argument("--server-args", default="", help="more `python -m minisgl` flags")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch1-prompts", type=int, default=32, help="per batch-1 run")
    p.add_argument("--turns", type=int, default=2, help="batch-1 runs per path, alternating")
    p.add_argument("--concurrency", default="1,16,64,256", help="the sweep's levels")
    p.add_argument("--min-prompts", type=int, default=32, help="per level (at least 2x it)")
    p.add_argument("--smoke", action="store_true", help="a few tiny requests: does it run?")
    a = p.parse_args()
    a.model = str(Path(a.model).resolve())  # the servers may start elsewhere
    if a.smoke:
        a.input_len, a.output_len, a.batch1_prompts, a.min_prompts = 16, 4, 2, 4
        a.concurrency = "1,4"
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    return a


if __name__ == "__main__":
    main()
