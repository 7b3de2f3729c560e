"""The serving tools against a live server: the load generator's counts agree with the
server's own /metrics, and a two-minute soak loses nothing and leaves the server idle.

Both run the tools as a user would, as commands, against one CPU server started the way
test_server.py starts its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ROOT, SMOL, SMOL_CPU, Server, metrics, serving, wait_idle

TOOLS = ROOT / "tools"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    with serving(tmp_path_factory.mktemp("serving-tools"), *SMOL_CPU) as srv:
        yield srv


def run_tool(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(TOOLS / script), *args, "--disable-tqdm"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_bench_serving_agrees_with_server_metrics(server: Server, tmp_path: Path) -> None:
    before = wait_idle(server)
    out = tmp_path / "bench.json"
    done = run_tool(
        "bench_serving.py",
        *("--base-url", server.base, "--model", SMOL.name, "--tokenizer", str(SMOL)),
        *("--num-prompts", "8", "--request-rate", "4", "--seed", "3", "--warmup", "0"),
        *("--random-input-len", "24", "--random-output-len", "6", "--ignore-eos"),
        *("--output-json", str(out)),
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    r = json.loads(out.read_text())
    after = wait_idle(server)
    grew = {k: after[k] - before[k] for k in after if k.endswith(("_total", "_count", "_sum"))}
    assert (r["completed"], r["failed"]) == (8, 0), r["errors"]
    assert grew["minisgl:requests_total"] == r["completed"]
    assert grew["minisgl:prompt_tokens_total"] == r["input_tokens"]
    assert grew["minisgl:generation_tokens_total"] == r["output_tokens"]
    # Lengths are 6 +- 50%, EOS ignored: every request produced 3 to 9 tokens.
    assert 8 * 3 <= r["output_tokens"] <= 8 * 9
    assert grew["minisgl:time_to_first_token_seconds_count"] == r["completed"]
    assert grew["minisgl:e2e_request_latency_seconds_count"] == r["completed"]
    # The client's TTFT holds the server's (which starts once the prompt is tokenized).
    server_ttft = grew["minisgl:time_to_first_token_seconds_sum"] / r["completed"]
    assert r["ttft_ms"]["mean"] / 1000 >= server_ttft - 1e-3
    assert r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"] <= r["e2e_ms"]["p99"]
    assert "TTFT" in done.stdout and "output tok/s" in done.stdout  # the table, for a person


def test_soak_two_minutes(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    done = run_tool(
        "soak.py",
        *("--base-url", server.base, "--model", SMOL.name, "--duration", "120"),
        *("--concurrency", "6", "--server-pid", str(server.proc.pid), "--seed", "1"),
        *("--output-json", str(out)),
        timeout=420,
    )
    report = json.loads(out.read_text()) if out.exists() else {}
    assert done.returncode == 0, f"{report or done.stdout}\n{done.stderr[-3000:]}"
    assert report["failed"] == 0
    kinds = report["requests"]
    for kind in ("whole", "streamed", "dropped stream", "abandoned whole"):
        assert kinds.get(kind, 0) >= 3, kinds
    assert sum(n for k, n in kinds.items() if k.startswith("bad: ")) >= 5, kinds
    assert "hung" not in kinds and "broken" not in kinds, kinds
    assert report["idle_after"] == {
        "num_requests_running": 0,
        "num_requests_waiting": 0,
        "kv_pages_used": 0,
    }
    assert report["rss_start_mib"] > 100  # the model's weights, at least: we measured the server
    assert metrics(server)["minisgl:num_requests_running"] == 0
