"""Processes for the router tests: minisgl servers, SGLang's router, and what they report.

Every process runs torch on one thread and in a session of its own, and its output goes to
a log file that a failing test prints (helpers.py starts and stops them).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import httpx
import pytest
from helpers import CPU, Server, descendants, free_port, launch, spawn

NO_ROUTER = (
    "sglang-router is not installed (no wheel for this platform?):"
    ' pip install "minisgl[router]" to run the router tests'
)


def skip_without_router(what: str) -> None:
    """Skip a module (or, called in one, a test) where the router is missing, and say why."""
    if importlib.util.find_spec("sglang_router") is None:
        print(f"\n{what}: skipped: {NO_ROUTER}", file=sys.__stderr__)
        pytest.skip(NO_ROUTER, allow_module_level=True)


def server(model: Path, log_dir: Path, *extra: str) -> Server:
    """A worker: `python -m minisgl` on CPU in fp32, not waited for (see `wait_ready`)."""
    return launch(log_dir, *CPU, *extra, model=model)


def router(
    urls: list[str], policy: str, log_dir: Path, *extra: str, module: str = "sglang_router"
) -> Server:
    """SGLang's router, or (module="vllm_router") vLLM's fork of it: the same flags."""
    port = free_port()
    cmd = [sys.executable, "-m", f"{module}.launch_router", "--worker-urls", *urls]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    metrics = free_port()
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics), *extra]
    p = spawn(cmd, log_dir / f"{module}-{policy}-{port}.log", port)
    p.metrics = f"http://127.0.0.1:{metrics}/metrics"
    return p


def child_titled(pid: int, title: str) -> int:
    """The descendant of `pid` whose process title is `title` (minisgl::scheduler, ...)."""
    for child in descendants(pid):
        try:
            if Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0] == title.encode():
                return child
        except OSError:
            continue
    raise AssertionError(f"no process titled {title} under {pid}")


def counters(p: Server) -> dict[str, float]:
    """The server's /metrics, name -> value, for the series without labels."""
    text = httpx.get(p.base + "/metrics", timeout=10).text
    return {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#") and "{" not in line
    }
