"""Tensor-parallel ranks that die: the offline LLM raises within seconds, the server answers
503 and exits 1; neither waits.

The offline scenarios are scripts of their own in a fresh interpreter, as a user would run
them: a rank is a spawned process that imports the script, and a failed rank 0 leaves its
process group behind, which must not leak into other tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from helpers import (
    CPU,
    ROOT,
    TINY,
    alive,
    descendants,
    launch,
    need,
    stop,
    titles,
    wait_gone,
    wait_ready,
)

NO_GUARD = """
import torch
from minisgl.llm import LLM

LLM({model!r}, dtype=torch.float32, device="cpu", tp_size=2)
print("started")
"""

KILL_A_RANK = """
import os, signal, threading, time
import torch
from minisgl.core import SamplingParams
from minisgl.llm import LLM

if __name__ == "__main__":
    llm = LLM({model!r}, dtype=torch.float32, device="cpu", tp_size=2, num_page_override=256)
    follower = llm._followers[0].pid
    threading.Timer(1.0, os.kill, (follower, signal.SIGKILL)).start()
    killed = time.monotonic() + 1.0
    try:
        llm.generate(["hello"] * 2, SamplingParams(max_tokens=1500, ignore_eos=True))
    except Exception as e:
        print(f"raised {{time.monotonic() - killed:.2f}} s after the kill: {{type(e).__name__}}")
    else:
        print("generate finished")
"""


def run_script(
    tmp_path: Path, text: str, timeout: float = 120
) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp_path / "script.py"
    script.write_text(text.format(model=str(need(TINY["llama"]))))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=timeout
    )
    return out, time.monotonic() - started


def test_tp_llm_in_a_script_without_the_main_guard_fails_naming_the_guard(tmp_path):
    out, took = run_script(tmp_path, NO_GUARD)
    assert out.returncode != 0 and "started" not in out.stdout, out.stdout
    assert 'put that code under `if __name__ == "__main__":`' in out.stderr, out.stderr[-2000:]
    assert took < 60, f"it took {took:.0f} s to fail"


def test_a_rank_killed_mid_generate_makes_generate_raise(tmp_path):
    out, _ = run_script(tmp_path, KILL_A_RANK)
    if out.returncode == -signal.SIGABRT and "terminate called" in out.stderr:
        # gloo's own threads, left with a pair whose peer was SIGKILLed, can abort the
        # interpreter (std::terminate) on a loaded machine: seen once in about eight runs on
        # the 2-core CI machine. That is torch's teardown, not what this test is about: once
        # more, and a second abort fails.
        print("gloo aborted the interpreter; running the script again:", out.stderr[-300:])
        out, _ = run_script(tmp_path, KILL_A_RANK)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "raised" in out.stdout, out.stdout + out.stderr[-2000:]
    seconds = float(out.stdout.split("raised ")[1].split(" s")[0])
    assert seconds < 10, out.stdout
    print(out.stdout.strip())


def test_a_rank_killed_mid_request_in_the_server_is_a_503_and_exit_1(tmp_path):
    model = need(TINY["llama"])
    flags = ("--max-seq-len-override", "128", "--num-pages", "256", "--tp-size", "2")
    server = launch(tmp_path, *CPU, *flags, model=model)
    try:
        base = wait_ready(server)
        pids = [server.proc.pid, *descendants(server.proc.pid)]
        rank = [p for p, t in zip(pids, titles(pids)) if t == "minisgl::scheduler-1"]
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        body = dict(
            model=model.name, prompt="Hello", max_tokens=120, extra_body={"ignore_eos": True}
        )
        chunks = client.completions.create(**body, stream=True)
        next(iter(chunks))  # it runs
        os.kill(rank[0], signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(openai.APIError, match="lost its minisgl-scheduler"):
            for _ in chunks:
                pass
        answered = time.monotonic() - killed
        assert answered < 2, f"the stream ended {answered:.1f} s after the kill"
        assert server.proc.wait(10) == 1, server.tail()
        assert not wait_gone(pids, 2), f"left: {[p for p in pids if alive(p)]}"
    finally:
        stop(server)
