"""Chapter 24's helpers on synthetic data: /metrics as prometheus-client writes it, a
histogram's quantile read from its buckets, the area under a sampled gauge, Little's law;
and tools/profile_step.py run as a command on a tiny model, in each of its three modes."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
from helpers import TINY, need, run_tool
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("ch24", ROOT / "examples/ch24_measuring.py")
ch24 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ch24)  # the example runs nothing on import


def registry() -> tuple[CollectorRegistry, Counter, Gauge, Histogram]:
    r = CollectorRegistry()
    counter = Counter("minisgl:requests", "Requests.", registry=r)
    gauge = Gauge("minisgl:num_requests_running", "Running.", registry=r)
    hist = Histogram("minisgl:ttft_seconds", "TTFT.", buckets=(0.1, 1.0, 10.0), registry=r)
    return r, counter, gauge, hist


def test_parse_metrics_reads_counters_gauges_and_buckets():
    r, counter, gauge, hist = registry()
    counter.inc(3)
    gauge.set(7)
    for v in [0.05] * 50 + [0.5] * 49 + [5.0]:
        hist.observe(v)
    m = ch24.parse_metrics(generate_latest(r).decode())
    assert m["minisgl:requests_total"] == 3
    assert m["minisgl:num_requests_running"] == 7
    assert m["minisgl:ttft_seconds_count"] == 100
    assert m["minisgl:ttft_seconds_sum"] == pytest.approx(0.05 * 50 + 0.5 * 49 + 5.0)
    assert m['minisgl:ttft_seconds_bucket{le="1.0"}'] == 99
    assert m['minisgl:ttft_seconds_bucket{le="+Inf"}'] == 100


def test_histogram_quantile_between_two_scrapes():
    r, _, _, hist = registry()
    for _ in range(10):
        hist.observe(20.0)  # before the window: past the last finite bucket
    before = ch24.parse_metrics(generate_latest(r).decode())
    for v in [0.05] * 50 + [0.5] * 49 + [5.0]:
        hist.observe(v)
    after = ch24.parse_metrics(generate_latest(r).decode())
    q = ch24.histogram_quantile
    assert q(before, after, "minisgl:ttft_seconds", 0.5) == pytest.approx(0.1)
    assert q(before, after, "minisgl:ttft_seconds", 0.99) == pytest.approx(1.0)
    assert q(before, after, "minisgl:ttft_seconds", 0.995) == pytest.approx(5.5)  # half of 1..10
    assert q({}, after, "minisgl:ttft_seconds", 0.99) == pytest.approx(10.0)  # the 10 count now


def test_area_holds_each_value_until_the_next_sample():
    assert ch24.area([(0.0, 1.0), (1.0, 3.0), (3.0, 0.0), (4.0, 2.0)]) == pytest.approx(7.0)
    assert ch24.area([(5.0, 4.0)]) == 0.0


def test_littles_law_holds_on_a_simulated_queue():
    # One server, first come first served, Poisson arrivals: the textbook queue.
    rng, now, free = random.Random(0), 0.0, 0.0
    spans = []
    for _ in range(200):
        now += rng.expovariate(2.0)
        free = max(free, now) + rng.uniform(0.1, 0.6)
        spans.append((now, free))
    events = sorted([(a, 1) for a, _ in spans] + [(d, -1) for _, d in spans])
    points, n = [], 0
    for t, step in events:  # the gauge, sampled at every change
        n += step
        points.append((t, float(n)))
    times = [d - a for a, d in spans]
    result = {
        "duration_s": spans[-1][1] - spans[0][0],
        "completed": len(spans),
        "e2e_ms": {"mean": sum(times) / len(times) * 1000},
    }
    law = ch24.littles_law(result, ch24.area(points), sum(times))
    assert law["lambda"] == pytest.approx(200 / result["duration_s"])
    assert law["L_gauges"] == pytest.approx(law["lambda_W"])
    assert law["L_histogram"] == pytest.approx(law["lambda_W"])
    assert law["lambda_W"] > 1.0  # a queue formed: the check is not about an empty server


def test_profile_step_reports_the_decode_steps_it_profiled(tmp_path: Path) -> None:
    need(TINY["qwen3"])
    out = tmp_path / "profile.json"
    args = ("--model", str(TINY["qwen3"]), "--device", "cpu", "--batch-size", "2")
    done = run_tool("profile_step.py", *args, "--steps", "5", "--output-json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["steps"] == 5 and result["batch_size"] == 2
    assert result["step_ms"] > 0
    assert "top host operations" in done.stdout


def test_profile_step_phases_add_up_and_count_calls(tmp_path: Path) -> None:
    need(TINY["llama"])
    out = tmp_path / "phases.json"
    args = ("--model", str(TINY["llama"]), "--device", "cpu", "--batch-size", "2", "--phases")
    args += ("--steps", "6", "--repeat", "2", "--cuda-graph-max-bs", "0", "--overlap", "on")
    done = run_tool("profile_step.py", *args, "--output-json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["steps"] == 6 and result["batch_size"] == 2 and result["overlap"] == "on"
    for clock in ("wall_ms", "cpu_ms"):
        t = result[clock]
        parts = ["schedule", "prepare_batch", "forward (launch)", "sample", "process results"]
        assert 0 < sum(t[p] for p in parts) <= t["step"] <= t["interval between steps"]
        assert t["of which the model's forward"] <= t["forward (launch)"]
        assert t["of which graph replay"] == 0.0  # no graphs asked for
        assert (
            0 < t["host work (the interval less the device's work)"] < t["interval between steps"]
        )
    calls = result["calls_per_step"]
    assert calls["torch calls"] > 0 and calls["to_device"] >= 1 and calls["to_host"] >= 1
    assert "torch calls" in done.stdout and "host work" in done.stdout


def test_profile_step_cprofile_lists_python_functions() -> None:
    need(TINY["llama"])
    args = ("--model", str(TINY["llama"]), "--device", "cpu", "--cprofile", "--steps", "6")
    done = run_tool("profile_step.py", *args, "--top", "5")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "cProfile of 6 decode steps" in done.stdout
    assert "filename:lineno(function)" in done.stdout and ".py:" in done.stdout
