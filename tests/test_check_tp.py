"""tools/check_tp.py as a command: tp=2 against tp=1 on the tiny Qwen3, by teacher-forced
prompt logprobs (chapter 25's), prefill and decode, over gloo on the CPU."""

from __future__ import annotations

from helpers import TINY, need, run_tool


def test_check_tp_passes_prefill_and_decode_at_tp2() -> None:
    need(TINY["qwen3"])
    args = ("--model", str(TINY["qwen3"]), "--device", "cpu", "--tp-size", "2")
    done = run_tool("check_tp.py", *args, "--prompt-lens", "9,30", "--output-len", "6")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "PASS" in done.stdout and "decode:" in done.stdout
