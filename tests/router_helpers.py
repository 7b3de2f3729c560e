"""Processes for the router tests: minisgl servers, SGLang's router, and what they report.

Every process runs torch on one thread and in a session of its own, and its output goes to
a log file that a failing test prints. `stop` ends a process and every process it started,
whatever state a test left it in.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

NO_ROUTER = (
    "sglang-router is not installed (no wheel for this platform?):"
    ' pip install "minisgl[router]" to run the router tests'
)
START_TIMEOUT = 180.0  # loading a model on a busy two-core machine


def skip_without_router(what: str) -> None:
    """Skip a module (or, called in one, a test) where the router is missing, and say why."""
    if importlib.util.find_spec("sglang_router") is None:
        print(f"\n{what}: skipped: {NO_ROUTER}", file=sys.__stderr__)
        pytest.skip(NO_ROUTER, allow_module_level=True)


@dataclass
class Proc:
    proc: subprocess.Popen
    base: str
    log: Path
    metrics: str = ""  # a router's Prometheus page
    events: str = ""  # a worker's KV-event endpoint, where it publishes them

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(cmd: list[str], log: Path, port: int) -> Proc:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return Proc(proc, f"http://127.0.0.1:{port}", log)


def server(model: Path, log_dir: Path, *extra: str) -> Proc:
    """`python -m minisgl` on CPU in fp32, not waited for (see `wait_ready`)."""
    port = free_port()
    cmd = [sys.executable, "-m", "minisgl", "--model", str(model), "--device", "cpu"]
    cmd += ["--dtype", "float32", "--port", str(port), *extra]
    return spawn(cmd, log_dir / f"server-{port}.log", port)


def router(
    urls: list[str], policy: str, log_dir: Path, *extra: str, module: str = "sglang_router"
) -> Proc:
    """SGLang's router, or (module="vllm_router") vLLM's fork of it: the same flags."""
    port = free_port()
    cmd = [sys.executable, "-m", f"{module}.launch_router", "--worker-urls", *urls]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    metrics = free_port()
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics), *extra]
    p = spawn(cmd, log_dir / f"{module}-{policy}-{port}.log", port)
    p.metrics = f"http://127.0.0.1:{metrics}/metrics"
    return p


def wait_ready(p: Proc, path: str = "/health", timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.proc.poll() is not None:
            pytest.fail(f"{p.base} exited with {p.proc.returncode}:\n{p.tail()}")
        try:
            if httpx.get(p.base + path, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    pytest.fail(f"{p.base}{path} did not answer 200 in {timeout:.0f} s:\n{p.tail()}")


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                kids = [int(k) for k in children.read_text().split()]
            except OSError:  # the thread or the process just went
                continue
            out += kids
            todo += kids
    return out


def alive(pid: int) -> bool:
    """Running; a zombie counts as gone (a container's init may never reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def child_titled(pid: int, title: str) -> int:
    """The descendant of `pid` whose process title is `title` (minisgl::scheduler, ...)."""
    for child in descendants(pid):
        try:
            if Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0] == title.encode():
                return child
        except OSError:
            continue
    raise AssertionError(f"no process titled {title} under {pid}")


def stop(p: Proc, timeout: float = 20) -> None:
    tree = descendants(p.proc.pid)
    if p.proc.poll() is None:
        p.proc.send_signal(signal.SIGTERM)
        try:
            p.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait()
    for pid in wait_gone(tree, 5):
        os.kill(pid, signal.SIGKILL)


def counters(p: Proc) -> dict[str, float]:
    """The server's /metrics, name -> value, for the series without labels."""
    text = httpx.get(p.base + "/metrics", timeout=10).text
    return {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#") and "{" not in line
    }
