"""Every tool in tools/ runs: each one answers --help and is listed in tools/README.md, and
the benchmarks run their CPU smoke mode on a tiny model, a few seconds each.

The tools that chapters bring are run at full length with their chapters: profile_step.py
in test_measuring.py, check_tp.py in test_check_tp.py, bench_serving.py and soak.py
against a live server in test_serving_tools.py, steps.py in test_steps.py, figures.py (its
pictures that need no model) in test_figures.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ROOT, TINY, need, run_tool

TOOLS = ROOT / "tools"
SCRIPTS = sorted(p for p in TOOLS.rglob("*.py") if 'if __name__ == "__main__":' in p.read_text())

# One process asks every tool for its help, so torch and minisgl are imported once.
HELP = """
import contextlib, io, runpy, sys
failed = []
for path in sys.argv[1:]:
    sys.argv, sys.path[0], out = [path, "--help"], path.rsplit("/", 1)[0], io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if e.code == 0 and "usage:" in out.getvalue():
            continue
    failed.append(path)
print("failed:", *failed)
"""


def test_every_tool_answers_help() -> None:
    assert len(SCRIPTS) >= 14, SCRIPTS
    r = subprocess.run(
        [sys.executable, "-c", HELP, *map(str, SCRIPTS)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and r.stdout.strip() == "failed:", r.stdout + r.stderr[-3000:]


def test_shell_recipes_parse() -> None:
    for script in TOOLS.rglob("*.sh"):
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, f"{script}: {r.stderr}"


def test_every_tool_is_in_the_index() -> None:
    index = (TOOLS / "README.md").read_text()
    tools = [*SCRIPTS, *TOOLS.rglob("*.sh"), TOOLS / "common.py", TOOLS / "chapters.toml"]
    missing = [p.relative_to(ROOT).as_posix() for p in tools]
    missing = [p for p in missing if f"`{p}" not in index]
    assert not missing, f"not in tools/README.md: {missing}"


MODEL = ("--model", str(TINY["llama"]), "--device", "cpu")
SMOKE = {
    "bench_offline.py": (
        [*MODEL, "--num-seqs", "4", "--max-input", "24", "--min-output", "4", "--max-output", "8"]
        + ["--skip-hf", "--steps"],
        "| prefill | 1 |",
    ),
    "bench_latency.py": (
        [*MODEL, "--batch-sizes", "1,2", "--input-len", "8", "--output-len", "8"]
        + ["--step-tokens", "8", "--skip-hf", "--skip-eager"],
        "| 2 |",
    ),
    "bench_prefill.py": (
        [*MODEL, "--modes", "off,breakable", "--lengths", "8", "--repeat", "1", "--warmup", "0"]
        + ["--peak-tokens", "64"],
        "| 8 |",
    ),
    "bench_attention.py": (
        ["--device", "cpu", "--backends", "torch", "--batch-sizes", "2", "--context-lens", "16"]
        + ["--prefill-batches", "1", "--prefill-len", "8", "--iters", "2", "--head-dim", "16"],
        "| 2 | 16 |",
    ),
    "bench_speculative.py": (
        [*MODEL, "--smoke", "--speculative", "suffix"],
        "| open-chat, batch 2 | held-out |",
    ),
    "bench_sample.py": (
        ["--device", "cpu", "--vocab", "3000", "--batch-sizes", "3", "--reps", "1", "--draws", "2"]
        + ["--cases", "mixed,top_k_top_p,penalties"],
        "| top_k_top_p | 3 |",
    ),
    "bench_builds.py": (["--variants", "2", "--threads", "2", "--rounds", "1"], "| 2 |"),
    "bench_gated_delta.py": (
        ["--device", "cpu", "--models", "tiny", "--decode", "2", "--prefill", "2x5"]
        + ["--rounds", "1", "--calls", "1"],
        "| tiny | prefill | 2x5 | ours |",
    ),
    "bench_moe.py": (
        ["--device", "cpu", "--experts", "8", "--top-k", "2", "--hidden", "64", "--inter", "32"]
        + ["--tokens", "7", "--iters", "2", "--warmup", "1"],
        "| fused |",
    ),
}


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_benchmark_smoke_run_on_the_cpu(script: str) -> None:
    need(TINY["llama"])
    args, expected = SMOKE[script]
    done = run_tool(script, *args, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert expected in done.stdout, done.stdout
