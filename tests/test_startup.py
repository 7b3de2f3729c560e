"""Start-up: the processes that never compute with tensors never import torch, the workers
start together, and tools/bench_startup.py reads the phases back from a real server's log."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from helpers import ROOT, TINY, need, run_tool

HEAVY = ("torch", "transformers", "triton", "numpy")


@pytest.mark.parametrize(
    "module",
    [
        "minisgl.server.launch",  # the launcher: the API server's process
        "minisgl.tokenizer.worker",  # the tokenizer worker
        "minisgl.server.processes",  # what each worker imports before its own module
    ],
)
def test_processes_without_tensors_import_no_torch(module: str) -> None:
    check = f"import sys, {module}; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.strip() == "[]", f"importing {module} imported {out.stdout.strip()}"


def test_the_command_line_names_a_dtype_that_the_scheduler_resolves() -> None:
    from minisgl.engine.config import EngineConfig
    from minisgl.server.args import parse_args

    model = str(need(TINY["llama"]))
    assert parse_args(["--model", model, "--dtype", "bfloat16"]).scheduler.dtype == "bfloat16"
    assert parse_args(["--model", model]).scheduler.dtype is None  # auto
    with pytest.raises(ValueError, match="dtype must be one of bfloat16, float16, float32"):
        EngineConfig(model, dtype="float64")


def test_the_workers_start_together_and_the_phases_are_logged() -> None:
    model = str(need(TINY["llama"]))
    out = run_tool("bench_startup.py", "--model", model, "--", "--device", "cpu", timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"/health answered 200 after [\d.]+ s", out.stdout), out.stdout
    rows = re.findall(r"^ +([\d.]+) +(\S+) +(.+)$", out.stdout, re.MULTILINE)
    at = {what: (float(t), process) for t, process, what in rows}

    def when(prefix: str, process: str) -> float:
        found = [t for what, (t, p) in at.items() if what.startswith(prefix) and p == process]
        assert found, f"no {prefix!r} from the {process} in:\n{out.stdout}"
        return found[0]

    started = when("starting the scheduler and tokenizer workers", "launcher")
    tokenizer = when("tokenizer loaded in", "tokenizer")
    engine = when("engine ready in", "scheduler")
    assert started < when("scheduler imports took", "scheduler") < engine
    assert started < when("tokenizer imports took", "tokenizer") < tokenizer
    # The tokenizer is loaded while the engine loads, not after it is ready.
    assert tokenizer < engine, out.stdout
    assert engine <= when("tokenizer worker ready", "launcher")
    assert when("tokenizer worker ready", "launcher") <= when("HTTP server listening", "launcher")
    assert re.search(r"outside the engine: [\d.]+ s", out.stdout)
