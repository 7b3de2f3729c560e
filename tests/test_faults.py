"""Faults and overload, against live servers: a worker killed mid-request, SIGTERM under load,
a flood against a small queue, and a bug in one request.

The promises (docs/failures.md): every client gets a status
within a bound, never a hang; a dead worker is a 503 for everyone at once and an exit
code 1; SIGTERM drains and exits 0; beyond the queue a 503 with Retry-After; no process
and no socket folder outlive the server. Four servers start together: one for each
worker fault, and one that takes the flood and then SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from helpers import (
    CONTEXT,
    MODEL,
    SMOL,
    SMOL_CPU,
    Server,
    descendants,
    httpx,
    ipc_dir,
    launch,
    metrics,
    need,
    stop,
    wait_gone,
    wait_ready,
)

from minisgl.core import SamplingParams
from minisgl.engine.limits import EngineLimits
from minisgl.message.frontend import RejectedMsg, TokenizeMsg
from minisgl.tokenizer.worker import TokenizerWorker

PROMPT = "The capital of France is"
LONG = CONTEXT - 16  # tokens: a request that is still running when the fault comes
SHORT = 8
STUCK_AFTER = 3  # --worker-timeout of the server whose scheduler stops
DRAIN = 5  # --shutdown-timeout of the server that gets SIGTERM


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[dict[str, Server]]:
    need(SMOL)
    log_dir = tmp_path_factory.mktemp("faults")
    small = ("--num-pages", "256", "--max-running-requests", "2")
    launched = {
        "scheduler": launch(log_dir, *SMOL_CPU, *small),
        "tokenizer": launch(log_dir, *SMOL_CPU, *small),
        "stuck": launch(log_dir, *SMOL_CPU, *small, "--worker-timeout", str(STUCK_AFTER)),
        # The flood first, then SIGTERM: one server serves both.
        "last": launch(
            log_dir,
            *SMOL_CPU,
            *("--max-running-requests", "8", "--max-queued-requests", "32"),
            *("--shutdown-timeout", str(DRAIN)),
        ),
    }
    try:
        for s in launched.values():
            wait_ready(s)
        yield launched
    finally:
        for s in launched.values():
            stop(s)


def worker_pid(server: Server, title: str) -> int:
    """The process that calls itself `minisgl::<title>` (processes.py names them)."""
    for pid in descendants(server.proc.pid):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] == title.encode():
                return pid
        except FileNotFoundError:
            continue
    pytest.fail(f"no {title} process under the server {server.proc.pid}")


def client(server: Server, timeout: float = 60) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=server.base + "/v1", api_key="none", timeout=timeout, max_retries=0
    )


async def complete(api: openai.AsyncOpenAI, max_tokens: int, stream: bool) -> tuple[str, float]:
    """The text, or the error's status (a stream's error event has none: "stream error");
    and the time the answer ended."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0)
    try:
        if not stream:
            out = await api.completions.create(**kw, extra_body={"ignore_eos": True})
            return out.choices[0].text, time.monotonic()
        parts = []
        events = await api.completions.create(**kw, stream=True, extra_body={"ignore_eos": True})
        async for chunk in events:
            parts.append(chunk.choices[0].text)
        return "".join(parts), time.monotonic()
    except openai.APIStatusError as e:
        return f"{e.status_code}: {e.message}", time.monotonic()
    except openai.APIError as e:  # an error event inside a stream
        return f"stream error: {e.message}", time.monotonic()


def peak_rss(server: Server) -> int:
    """The API server process's peak resident memory so far, in kB."""
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")))


def running(server: Server, n: int, timeout: float = 60) -> None:
    """Wait until the scheduler runs `n` requests."""
    deadline = time.monotonic() + timeout
    while metrics(server)["minisgl:num_requests_running"] < n:
        assert time.monotonic() < deadline, f"{n} requests never ran:\n{server.tail()}"
        time.sleep(0.1)


def exits(server: Server, tree: list[int], folder: Path, since: float) -> tuple[int, float]:
    """The server's exit code and the seconds from `since` until it and its workers are gone."""
    try:
        code = server.proc.wait(10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server still runs 10 s later:\n{server.tail()}")
    left = wait_gone(tree, 1)
    assert not left, f"processes left behind: {left}"
    assert not folder.exists(), f"{folder} is left behind"
    return code, time.monotonic() - since


FAULTS = {  # server: the worker, what it gets, what clients read, how soon after
    "scheduler": ("scheduler", signal.SIGKILL, "lost its minisgl-scheduler worker", 2.0),
    "tokenizer": ("tokenizer", signal.SIGKILL, "lost its minisgl-tokenizer worker", 2.0),
    "stuck": ("scheduler", signal.SIGSTOP, "heard nothing from its workers", STUCK_AFTER + 2),
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_a_dead_or_stuck_worker_fails_every_request_at_once_and_the_server_exits(servers, name):
    server = servers[name]
    worker, sig, why, bound = FAULTS[name]
    tree = [server.proc.pid, *descendants(server.proc.pid)]
    folder = ipc_dir(server.proc.pid)
    victim = worker_pid(server, f"minisgl::{worker}")
    api = client(server)

    async def scenario() -> tuple[list[tuple[str, float]], float]:
        # What a restarted server must answer again: the same greedy text (another server
        # stands for the restart).
        before, _ = await complete(api, SHORT, stream=False)
        again = client(servers["last"])
        assert (await complete(again, SHORT, stream=False))[0] == before
        await again.close()
        # Two running (--max-running-requests 2), two queued behind them; two of each streams.
        tasks = [asyncio.create_task(complete(api, LONG, stream=i % 2 == 1)) for i in range(4)]
        await asyncio.to_thread(running, server, 2)
        killed = time.monotonic()
        os.kill(victim, sig)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        # Until it exits (a second later), the server says why on /health.
        health = await asyncio.to_thread(httpx.get, server.base + "/health", timeout=5)
        assert health.status_code == 503, health.text
        await api.close()
        return results, killed

    results, killed = asyncio.run(scenario())
    for text, ended in results:
        assert text.startswith(("503: ", "stream error: ")), text
        assert f"the server {why}" in text, text
        assert ended - killed < bound, f"an answer came {ended - killed:.1f} s after the fault"
    code, took = exits(server, tree, folder, killed)
    assert code == 1, server.tail()
    print(f"{name}: last answer {max(e for _, e in results) - killed:.2f} s, exit {took:.2f} s")


def test_a_flood_gets_503s_beyond_the_queue_and_every_accepted_request_is_right(servers):
    server = servers["last"]
    clients = 500
    api = client(server, timeout=300)

    async def one() -> httpx.Response:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": SHORT, "temperature": 0}
        return await http.post("/v1/completions", json=body)

    async def flood() -> tuple[str, list[httpx.Response]]:
        reference, _ = await complete(api, SHORT, stream=False)
        await api.close()
        return reference, await asyncio.gather(*(one() for _ in range(clients)))

    limits = httpx.Limits(max_connections=clients)
    http = httpx.AsyncClient(base_url=server.base, timeout=300, limits=limits)
    before = metrics(server)
    rss_before = peak_rss(server)
    started = time.monotonic()
    reference, answers = asyncio.run(flood())
    took = time.monotonic() - started
    ok = [r for r in answers if r.status_code == 200]
    refused = [r for r in answers if r.status_code == 503]
    assert len(ok) + len(refused) == clients, {r.status_code for r in answers}
    assert len(ok) >= 40, len(ok)  # 8 running + 32 queued at least once
    assert all(r.json()["choices"][0]["text"] == reference for r in ok)
    for r in refused:
        assert r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "queue_full", r.text
    after = metrics(server)
    grew = after['minisgl:error_responses_total{status="503"}'] - before.get(
        'minisgl:error_responses_total{status="503"}', 0
    )
    assert grew == len(refused)
    print(
        f"flood: {len(ok)} served, {len(refused)} 503s in {took:.1f} s;"
        f" the server's peak RSS {rss_before} kB before, {peak_rss(server)} kB after"
    )


def test_sigterm_drains_running_requests_then_exits_0(servers):
    server = servers["last"]
    tree = [server.proc.pid, *descendants(server.proc.pid)]
    folder = ipc_dir(server.proc.pid)
    api = client(server)

    async def scenario() -> tuple[list[tuple[str, float]], float]:
        short = asyncio.create_task(complete(api, SHORT, stream=False))
        long = asyncio.create_task(complete(api, LONG, stream=True))  # past --shutdown-timeout
        await asyncio.to_thread(running, server, 2)
        sent = time.monotonic()
        # To the whole process group, as systemd sends it to every process of a service:
        # the workers leave the stopping to the launcher.
        os.killpg(server.proc.pid, signal.SIGTERM)
        await asyncio.sleep(0.3)
        # Not ready, still alive, and a new request is refused politely.
        async with httpx.AsyncClient(base_url=server.base, timeout=5) as http:
            assert (await http.get("/ready")).status_code == 503
            assert (await http.get("/health")).status_code == 200
            r = await http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT})
            assert r.status_code == 503 and "Retry-After" in r.headers, r.text
            assert "shutting down" in r.json()["error"]["message"]
        results = await asyncio.wait_for(asyncio.gather(short, long), 15)
        await api.close()
        return results, sent

    ((short, _), (long, ended)), sent = asyncio.run(scenario())
    assert not short.startswith(("503", "stream error")), short  # it finished in time
    assert long.startswith("stream error: the server is shutting down"), long
    assert DRAIN - 0.5 < ended - sent < DRAIN + 2, f"the long one ended {ended - sent:.1f} s after"
    code, took = exits(server, tree, folder, sent)
    assert code == 0, server.tail()
    print(f"sigterm: drained in {ended - sent:.2f} s, exited after {took:.2f} s")


def test_a_bug_in_one_request_fails_it_with_a_500_and_the_worker_goes_on(tmp_path, monkeypatch):
    limits = EngineLimits(256, 64, 16, 4, 49152)
    worker = TokenizerWorker(str(need(SMOL)), str(tmp_path), limits)
    sent: list = []
    monkeypatch.setattr(worker.to_api, "send", sent.append)
    monkeypatch.setattr(worker.to_scheduler, "send", sent.append)
    encode = worker.tokenizer.encode

    def buggy(text: str, **kw) -> list[int]:
        if text == "boom":
            raise KeyError("a bug")
        return encode(text, **kw)

    monkeypatch.setattr(worker.tokenizer, "encode", buggy)
    worker.handle_api(TokenizeMsg(1, SamplingParams(max_tokens=SHORT), prompt="boom"))
    worker.handle_api(TokenizeMsg(2, SamplingParams(max_tokens=SHORT), prompt=PROMPT))
    assert isinstance(sent[0], RejectedMsg) and sent[0].status == 500, sent
    assert "KeyError" in sent[0].message
    assert [type(m).__name__ for m in sent[1:]] == ["AcceptedMsg", "UserMsg"]
