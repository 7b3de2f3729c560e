"""`python -m minisgl --dp-size 2`: one command, replicas behind SGLang's router, one exit.

- The command line refuses what a replica set cannot do, and a missing router names the
  package that brings it.
- Each replica gets GPUs of its own (CUDA_VISIBLE_DEVICES, --tp-size apiece), none on CPU.
- Live, on CPU with the tiny Llama: the router answers on --port under the served name and
  --router-policy round_robin shares the requests out; SIGTERM stops every process (exit 0);
  a replica that dies takes the whole set down (exit 1). Nothing is left behind either way.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch
from helpers import (
    TINY,
    Server,
    descendants,
    launch,
    need,
    stop,
    wait_gone,
    wait_ready,
)
from router_helpers import skip_without_router

from minisgl.server.args import parse_args
from minisgl.server.replicas import gpu_sets

MODEL = TINY["llama"]
KEY = "replica-key-5e3a"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def router_installed(monkeypatch) -> None:
    """find_spec finds a router, whether or not this machine has one."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: real("json") if name == "sglang_router" else real(name, *a),
    )


def test_the_command_line_refuses_what_replicas_cannot_do(capsys, monkeypatch, router_installed):
    base = ["--model", str(need(MODEL)), "--device", "cpu"]
    wrong = {
        "--dp-size takes a number >= 1": ["--dp-size", "0"],
        "--shell chats with one server": ["--dp-size", "2", "--shell"],
        "for replicas on several": ["--dp-size", "2", "--dist-init-addr", "host:29500"],
        "accepts one API key": ["--dp-size", "2", "--api-key", "k1", "--api-key", "k2"],
    }
    for message, flags in wrong.items():
        with pytest.raises(SystemExit):
            parse_args(base + flags)
        assert message in capsys.readouterr().err
    assert parse_args(base + ["--dp-size", "1"]).replicas is None
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "sglang_router" else real(n, *a)
    )
    with pytest.raises(SystemExit):
        parse_args(base + ["--dp-size", "2"])
    assert 'pip install "minisgl[router]"' in capsys.readouterr().err


def test_each_replica_gets_gpus_of_its_own(monkeypatch, router_installed):
    def sets(*flags: str, count: int = 4, visible: str | None = None) -> list[str | None]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        return gpu_sets(parse_args(["--model", str(need(MODEL)), "--dp-size", "2", *flags]))

    assert sets() == ["0", "1"]
    assert sets("--tp-size", "2") == ["0,1", "2,3"]
    assert sets(visible="3,5") == ["3", "5"]
    assert sets("--device", "cpu") == [None, None]
    with pytest.raises(RuntimeError, match="needs 4 GPUs; 3 are visible"):
        sets("--tp-size", "2", count=3)


def replica_set(tmp_path, *flags: str) -> Server:
    skip_without_router(__name__)
    replicas = ("--dp-size", "2", "--shutdown-timeout", "5")
    p = launch(tmp_path, "--device", "cpu", *replicas, *flags, model=MODEL)
    wait_ready(p, "/readiness")
    return p


def replica_urls(p: Server) -> list[str]:
    return re.findall(r"replica \d: (http://127\.0\.0\.1:\d+)", p.log.read_text())


def test_one_command_serves_two_replicas_and_sigterm_stops_every_process(tmp_path):
    p = replica_set(tmp_path, "--router-policy", "round_robin", "--api-key", KEY)
    try:
        # The router asked the replicas who they are with the key: it knows the model's name.
        models = httpx.get(p.base + "/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == [MODEL.name]
        body = {"model": MODEL.name, "prompt": "Hello", "max_tokens": 3}
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(p.base + "/v1/completions", json=body, headers=headers, timeout=60)
            assert r.status_code == 401, r.text
        for i in range(4):
            body = {"model": MODEL.name, "prompt": f"Hello {i}", "max_tokens": 3}
            r = httpx.post(p.base + "/v1/completions", json=body, headers=AUTH, timeout=60)
            assert r.status_code == 200, r.text
        served = [
            httpx.get(url + "/metrics", timeout=10).text.count("minisgl:requests_total 2.0")
            for url in replica_urls(p)
        ]
        assert served == [1, 1]  # round_robin: two requests each
        tree = descendants(p.proc.pid)
        assert len(tree) >= 7  # two replicas, their schedulers and tokenizers, the router
        p.proc.send_signal(signal.SIGTERM)
        assert p.proc.wait(30) == 0
        assert wait_gone(tree, 10) == [], "processes outlived the launcher"
        assert KEY not in p.log.read_text()
    finally:
        stop(p)


def test_a_replica_that_dies_takes_the_set_down(tmp_path):
    p = replica_set(tmp_path)
    try:
        tree = descendants(p.proc.pid)
        port = replica_urls(p)[1].rsplit(":", 1)[1]
        [victim] = [
            pid
            for pid in tree
            if f"--port\0{port}\0".encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        started = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        assert p.proc.wait(30) == 1
        assert wait_gone(tree, 10) == [], "processes outlived the launcher"
        assert "replica 1 exited with code -9: stopping the others" in p.log.read_text()
        print(f"the set was down {time.monotonic() - started:.1f} s after a replica died")
    finally:
        stop(p)
