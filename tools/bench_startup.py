"""How long a fresh server takes to answer /health, and where the time goes.

    python tools/bench_startup.py --model /tmp/qwen3-0.6b              # the defaults
    python tools/bench_startup.py --model /tmp/qwen3-0.6b --runs 2 -- --attn fi

Starts `python -m minisgl --model M` (plus any arguments after `--`) as a user would, polls
/health until it answers 200, and prints the time from the start, then a timeline read from
the server's log (each line's time since the start, and the process that wrote it): the
launcher's interpreter, imports and arguments, each worker's imports, the tokenizer's load,
the engine's phases ("engine ready in": weights, KV pool, attention backend, kernel choice,
each kind of graph), each worker ready, the HTTP server listening. The time not in "engine
ready in" is outside the engine. The server is then stopped (SIGTERM, then SIGKILL after
30 s) and the next run starts; on a fresh machine the first run pays every cache (Triton's
kernels, FlashInfer's JIT, the kernel choice's times), the later ones only what is not cached.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHOWN = (
    "start-up: ",
    "worker ready",
    "engine ready in",
    "attention backend:",
    "kernel choice",
    "captured ",
    "kernels ahead",
)
# "2026-12-03 15:56:56,442 tokenizer INFO message": the log format of every process
LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\S+) [A-Z]+ (.*)$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def start_once(model: str, extra: list[str], timeout: float) -> tuple[float | None, str, float]:
    """(seconds to a 200 from /health, or None if it never came; the server's log; the wall
    clock time it was started at)."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "minisgl", "--model", model, "--port", str(port), *extra]
    with tempfile.TemporaryFile("w+") as log:
        started_at, start = time.time(), time.perf_counter()
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  cwd=ROOT, start_new_session=True)  # fmt: skip
        ready = None
        try:
            while time.perf_counter() - start < timeout and server.poll() is None:
                if healthy(port):
                    ready = time.perf_counter() - start
                    break
                time.sleep(0.1)
        finally:
            stop(server)
        log.seek(0)
        return ready, log.read(), started_at


def stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (it drains and stops its workers), then SIGKILL."""
    if server.poll() is not None:
        return
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def timeline(log: str, started_at: float) -> list[tuple[float, str, str]]:
    """(seconds since the start, process, message) of each start-up line of the log."""
    events = []
    for line in log.splitlines():
        found = LOG_LINE.match(line)
        if found is None or not any(key in found[3] for key in SHOWN):
            continue
        when = datetime.strptime(found[1], "%Y-%m-%d %H:%M:%S,%f").timestamp() - started_at
        process = "launcher" if found[2] == "minisgl" else found[2]
        events.append((when, process, found[3].removeprefix("start-up: ")))
    return events


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for /health")
    p.add_argument("server_args", nargs="*", help="after --: more arguments for the server")
    args = p.parse_args()
    for run in range(1, args.runs + 1):
        ready, log, started_at = start_once(args.model, args.server_args, args.timeout)
        if ready is None:
            print(f"run {run}: no answer from /health within {args.timeout:.0f}s; log tail:")
            print(log[-3000:])
            sys.exit(1)
        print(f"run {run}: /health answered 200 after {ready:.1f} s")
        print("   at (s)  process    what")
        for when, process, what in timeline(log, started_at):
            print(f"  {when:7.2f}  {process:<9}  {what}")
        if found := re.search(r"engine ready in ([\d.]+)s", log):
            print(f"  outside the engine: {ready - float(found[1]):.1f} s")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
