"""tools/check_tp.py as a command: tp=2 against tp=1 on the tiny Qwen3, by teacher-forced
prompt logprobs (chapter 25's), prefill and decode, over gloo on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers import TINY, need

TOOL = Path(__file__).resolve().parents[1] / "tools" / "check_tp.py"


def test_check_tp_passes_prefill_and_decode_at_tp2() -> None:
    need(TINY["qwen3"])
    args = ("--model", str(TINY["qwen3"]), "--device", "cpu", "--tp-size", "2")
    cmd = [sys.executable, str(TOOL), *args, "--prompt-lens", "9,30", "--output-len", "6"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "PASS" in done.stdout and "decode:" in done.stdout
