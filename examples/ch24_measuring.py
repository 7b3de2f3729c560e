"""Chapter 24: measuring a serving engine. We start `python -m minisgl`, load it with
tools/bench_serving.py at a few Poisson request rates and at a fixed concurrency, check
Little's law and the server's /metrics counters against the load generator's numbers,
then profile decode steps with tools/profile_step.py and set them against the time
memory needs to read the weights.

Run from the repo root: python examples/ch24_measuring.py
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

MODEL = "models/SmolLM2-135M-Instruct"
# Short random prompts, every request its full length: small enough for two CPU cores.
WORKLOAD = ["--num-prompts", "12", "--random-input-len", "48", "--random-output-len", "16"]
WORKLOAD += ["--ignore-eos", "--warmup", "0", "--disable-tqdm"]
RATES = (0.5, 1.0, 2.0)
CONCURRENCY = 4


# ---- reading /metrics ---------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {'name{labels}': value}; HELP and TYPE lines skipped."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def scrape(base: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
        return parse_metrics(r.read().decode())


def in_system(m: dict[str, float]) -> float:
    return m["minisgl:num_requests_running"] + m["minisgl:num_requests_waiting"]


def histogram_quantile(before: dict, after: dict, name: str, q: float) -> float:
    """The q-quantile of what a histogram counted between two scrapes, from its buckets:
    linear inside the bucket that holds it, as Prometheus's histogram_quantile() reads it."""
    prefix = f'{name}_bucket{{le="'
    buckets = sorted(
        (float(k[len(prefix) : -2]), v - before.get(k, 0.0))
        for k, v in after.items()
        if k.startswith(prefix)
    )
    rank = q * buckets[-1][1]  # the last bucket, le="+Inf", counts everything
    lo, below = 0.0, 0.0
    for hi, count in buckets:
        if count >= rank and count > below:
            return lo if math.isinf(hi) else lo + (hi - lo) * (rank - below) / (count - below)
        lo, below = hi, count
    return float("nan")


class Sampler:
    """Scrapes the gauges in a thread; area() integrates the requests in the server over time."""

    def __init__(self, base: str, period: float = 0.05) -> None:
        self.base, self.period = base, period
        self.points: list[tuple[float, float]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self) -> None:
        while not self.done.is_set():
            with contextlib.suppress(OSError):  # a missed scrape: the last value holds longer
                self.points.append((time.perf_counter(), in_system(scrape(self.base))))
            self.done.wait(self.period)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()

    def area(self) -> float:
        return area(self.points)


def area(points: list[tuple[float, float]]) -> float:
    """Integral of a step function sampled as (time, value): each value holds until the next."""
    return sum(n * (t1 - t0) for (t0, n), (t1, _) in zip(points, points[1:]))


def littles_law(result: dict, area_s: float, e2e_sum_s: float) -> dict[str, float]:
    """Both sides of L = lambda * W over one run of the load generator (its JSON)."""
    duration = result["duration_s"]
    lam = result["completed"] / duration  # everything that arrived also left
    w = result["e2e_ms"]["mean"] / 1000
    return {
        "lambda": lam,
        "W": w,
        "lambda_W": lam * w,
        "L_gauges": area_s / duration,  # mean of running + waiting over the run
        "L_histogram": e2e_sum_s / duration,  # the server's own time in system, summed
    }


# ---- the server and the tools -------------------------------------------------------------


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "minisgl", "--model", MODEL, "--device", "cpu"]
    cmd += ["--dtype", "float32", "--port", str(port), "--log-level", "warning"]
    print("$ OMP_NUM_THREADS=1", " ".join(["python", *cmd[1:]]))
    # A session of its own: its whole process tree can be found, and ended, by group.
    return subprocess.Popen(cmd, start_new_session=True), f"http://127.0.0.1:{port}"


def wait_ready(server: subprocess.Popen, base: str) -> None:
    t0 = time.perf_counter()
    while True:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with code {server.returncode} while starting")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5):
                break
        except OSError:
            if time.perf_counter() - t0 > 180:
                raise SystemExit("the server did not answer /health within 180 s") from None
            time.sleep(0.5)
    # One request first, so that no measured one pays for the first forward.
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 4}).encode()
    req = urllib.request.Request(
        f"{base}/v1/completions", body, {"Content-Type": "application/json"}
    )
    urllib.request.urlopen(req, timeout=60).read()
    print(f"ready and warmed up after {time.perf_counter() - t0:.1f} s")


def stop_server(server: subprocess.Popen) -> list[str]:
    """SIGTERM, then wait for the whole process group; what had to be killed is returned."""
    problems = []
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        problems.append("the server did not exit within 30 s of SIGTERM")
    deadline = time.monotonic() + 10  # its workers exit on their own, shortly after it
    while time.monotonic() < deadline:
        try:
            os.killpg(server.pid, 0)
        except ProcessLookupError:
            return problems
        time.sleep(0.2)
    os.killpg(server.pid, signal.SIGKILL)
    server.wait()
    return [*problems, "processes of the server were left behind (killed)"]


def tool(*args: str) -> str:
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)
    if r.returncode:
        raise SystemExit(
            f"{args[0]} failed ({r.returncode}):\n{r.stdout[-1500:]}{r.stderr[-1500:]}"
        )
    return r.stdout


def weight_bytes(model: str, itemsize: int) -> int:
    """Values in the model's safetensors files (read from their headers) x bytes each."""
    total = 0
    for file in Path(model).glob("*.safetensors"):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total * itemsize


def read_bandwidth() -> float:
    """GB/s one thread reads weights at: the best of five 512 MiB matrix-vector products,
    the operation a batch-1 decode step is made of."""
    import numpy as np  # here: after main() has set OMP_NUM_THREADS, which BLAS reads once

    w, x = np.ones((1 << 15, 1 << 12), dtype=np.float32), np.ones(1 << 12, dtype=np.float32)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        w @ x
        best = min(best, time.perf_counter() - t0)
    return w.nbytes / best / 1e9


# ---- the chapter --------------------------------------------------------------------------


def measure(base: str, tmp: Path) -> list[str]:
    failures = []
    runs = [(f"rate {r:g}/s", ["--request-rate", str(r)]) for r in RATES]
    runs.append((f"{CONCURRENCY} at a time", ["--max-concurrency", str(CONCURRENCY)]))
    start, rows = scrape(base), []
    for i, (label, extra) in enumerate(runs):
        out = tmp / f"run{i}.json"
        name = "minisgl" if "rate" in label else f"minisgl, {CONCURRENCY} at a time"
        args = ["tools/bench_serving.py", "--base-url", base, "--model", MODEL, *WORKLOAD]
        # A seed per run: the same prompts again would be served from the prefix cache.
        args += [*extra, "--seed", str(i), "--label", name, "--output-json", str(out)]
        if i == 0:
            print("\n$ python", " ".join(args).replace(base, "$BASE").replace(str(tmp), "$TMP"))
        before, sampler = scrape(base), Sampler(base)
        try:
            text = tool(*args)
        finally:
            sampler.stop()
        after, result = scrape(base), json.loads(out.read_text())
        if i == 0:
            print(text.strip())
        e2e = "minisgl:e2e_request_latency_seconds_sum"
        law = littles_law(result, sampler.area(), after[e2e] - before[e2e])
        ttft = "minisgl:time_to_first_token_seconds"
        law["ttft_p99_server"] = histogram_quantile(before, after, ttft, 0.99)
        rows.append((label, result, law))
        if result["failed"]:
            failures.append(f"{label}: {result['failed']} requests failed: {result['errors']}")

    print("\n$ python tools/bench_serving.py --compare run0.json run1.json run2.json --plot ...")
    files = [str(tmp / f"run{i}.json") for i in range(len(RATES))]
    compare = tool("tools/bench_serving.py", "--compare", *files, "--plot", str(tmp / "s.png"))
    print("\n".join(line for line in compare.strip().splitlines() if not line.startswith("plot")))

    print("\nLittle's law, L = lambda x W (requests in the server = arrival rate x time in it):")
    print(f"{'run':<14}{'lambda/s':>9}{'W (s)':>8}{'lambda x W':>12}{'L gauges':>10}", end="")
    print(f"{'L e2e sum':>11}{'TTFT p99 (s)':>14}{'histogram':>11}")
    for label, result, law in rows:
        p99 = result["ttft_ms"]["p99"] / 1000
        print(f"{label:<14}{law['lambda']:>9.2f}{law['W']:>8.2f}{law['lambda_W']:>12.2f}", end="")
        print(f"{law['L_gauges']:>10.2f}{law['L_histogram']:>11.2f}", end="")
        print(f"{p99:>14.2f}{law['ttft_p99_server']:>11.2f}")
        # The server's clock starts after the request is parsed and stops before the last
        # bytes leave: a little less than the client's, never more. The gauges count only
        # the scheduler's requests, not those being tokenized or detokenized: less again.
        for side, low in (("L_gauges", 0.65), ("L_histogram", 0.9)):
            if not low * law["lambda_W"] <= law[side] <= 1.02 * law["lambda_W"] + 0.02:
                failures.append(
                    f"{label}: {side} = {law[side]:.2f}, lambda W = {law['lambda_W']:.2f}"
                )
    closed = rows[-1][2]["L_histogram"]
    if not CONCURRENCY * 0.8 <= closed <= CONCURRENCY:
        failures.append(f"{CONCURRENCY} at a time kept {closed:.2f} requests in the server")

    for _ in range(100):  # the scheduler's last report comes just after the last token
        end = scrape(base)
        if in_system(end) == 0:
            break
        time.sleep(0.1)
    print("\n/metrics counter                 grew by   the load generator counted")
    keys = {"requests_total": "completed", "prompt_tokens_total": "input_tokens"}
    keys["generation_tokens_total"] = "output_tokens"
    for counter, field in keys.items():
        grew = end[f"minisgl:{counter}"] - start[f"minisgl:{counter}"]
        counted = sum(result[field] for _, result, _ in rows)
        print(f"minisgl:{counter:<25}{grew:>8.0f}{counted:>12}")
        if grew != counted:
            failures.append(
                f"minisgl:{counter} grew by {grew:.0f}, the generator counted {counted}"
            )
    idle = {k: end[f"minisgl:{k}"] for k in ("num_requests_running", "num_requests_waiting")}
    idle["kv_pages_used"] = end["minisgl:kv_pages_used"]
    print(f"after the load: {', '.join(f'{k} {v:.0f}' for k, v in idle.items())}")
    if any(idle.values()):
        failures.append(f"the server is not idle after the load: {idle}")
    return failures


def profile(tmp: Path) -> list[str]:
    args = ["tools/profile_step.py", "--model", MODEL, "--device", "cpu", "--steps", "8"]
    args += ["--input-len", "32", "--top", "6", "--output-json", str(tmp / "profile.json")]
    print("\n$ python", " ".join(args).replace(str(tmp), "$TMP"))
    print(tool(*args).strip())
    step_ms = json.loads((tmp / "profile.json").read_text())["step_ms"]
    weights, bandwidth = weight_bytes(MODEL, 4), read_bandwidth()
    floor_ms = weights / (bandwidth * 1e9) * 1e3
    print(f"\nweights read per step {weights / 1e9:.3f} GB; one thread reads {bandwidth:.1f} GB/s")
    print(f"bandwidth floor {floor_ms:.1f} ms per step; measured {step_ms:.1f} ms", end="")
    print(f" ({floor_ms / step_ms:.0%} of the step is reading the weights)")
    if step_ms < 0.9 * floor_ms:  # 10% for the noise of two measurements
        return [f"a step ({step_ms:.1f} ms) beat the bandwidth floor ({floor_ms:.1f} ms)"]
    return []


def main() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"  # one torch thread in every process started here
    server, base = start_server()
    failures, stopped = [], False
    try:
        with tempfile.TemporaryDirectory() as tmp:
            wait_ready(server, base)
            failures += measure(base, Path(tmp))
            left = stop_server(server)  # before profiling, which needs the cores to itself
            stopped = True
            print(f"\nserver stopped (exit code {server.returncode}); {left or 'nothing left'}")
            failures += left
            failures += profile(Path(tmp))
    finally:
        if not stopped:
            stop_server(server)
    if failures:
        raise SystemExit("FAILED: " + "; ".join(failures))


if __name__ == "__main__":
    main()
