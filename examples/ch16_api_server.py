"""Chapter 16: the OpenAI-compatible API server. We start `python -m minisgl` as any user
would, talk to it with the official `openai` client, and stop it with SIGTERM.

Run from the repo root: python examples/ch16_api_server.py
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai

MODEL = "models/SmolLM2-135M-Instruct"
failures = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (Linux: from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric(base: str, name: str) -> float:
    for line in get(f"{base}/metrics")[1].splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise KeyError(name)


port = free_port()
base = f"http://127.0.0.1:{port}"
cmd = [sys.executable, "-m", "minisgl", "--model", MODEL, "--device", "cpu", "--dtype", "float32"]
cmd += ["--port", str(port), "--max-seq-len-override", "512", "--log-level", "warning"]
print("$", " ".join(["python", *cmd[1:]]))
server = subprocess.Popen(cmd)
try:
    t0 = time.perf_counter()
    while True:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with code {server.returncode} while starting")
        try:
            status, body = get(f"{base}/health")
            break
        except OSError:
            time.sleep(0.5)
    print(f"GET /health -> {status} {body} after {time.perf_counter() - t0:.1f}s")
    workers = children(server.pid)
    names = [Path(f"/proc/{p}/comm").read_text().strip() for p in workers]
    print(f"server pid {server.pid}, its child processes: {dict(zip(workers, names))}")

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    model = client.models.list().data[0].id
    print(f"GET /v1/models -> {model!r}")

    # 1. A chat completion, whole.
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    reply = chat.choices[0].message.content
    print(f"\nchat: {reply!r}")
    print(f"  finish_reason={chat.choices[0].finish_reason}, usage={dict(chat.usage)}")
    if "Paris" not in reply:
        failures.append(f"the chat reply does not mention Paris: {reply!r}")

    # 2. A completion, streamed: each server-sent event carries a piece of text.
    print("\nstream:", end=" ", flush=True)
    pieces, finish = [], None
    stream = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=10, temperature=0, stream=True
    )
    for chunk in stream:
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
        print(repr(chunk.choices[0].text), end=" ", flush=True)
    print(f"\n  {len(pieces)} events, finish_reason={finish}, text {''.join(pieces)!r}")
    if finish != "length" or "Paris" not in "".join(pieces):
        failures.append("the streamed completion should mention Paris and stop for length")

    # 3. A request the server refuses: a 400 with an OpenAI-style error body.
    try:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=0
        )
        failures.append("max_tokens=0 was accepted")
    except openai.BadRequestError as e:
        print(f"\nmax_tokens=0 -> {e.status_code} {json.dumps(e.response.json())}")

    # 4. A client that hangs up mid-stream: the server aborts its request.
    req = urllib.request.Request(
        f"{base}/v1/completions",
        data=json.dumps(
            {
                "model": model,
                "prompt": "Count:",
                "max_tokens": 400,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        first = [r.readline() for _ in range(2)][0]  # one event: "data: {...}" and a blank line
    print(f"\nread one event of a 400-token stream, then hung up: {first[:60]!r}...")
    t0 = time.perf_counter()
    while (
        running := metric(base, "minisgl:num_requests_running")
    ) and time.perf_counter() - t0 < 20:
        time.sleep(0.2)
    took = time.perf_counter() - t0  # the abort races the first look: say it in whole seconds
    when = "under a second" if took < 1 else f"{took:.1f}s"
    print(f"  requests running {when} later: {running:.0f}")
    if running:
        failures.append("the abandoned stream is still running")

    # 5. /metrics, in the Prometheus text format.
    print("\nGET /metrics (some lines):")
    for line in get(f"{base}/metrics")[1].splitlines():
        if line.startswith(
            (
                "minisgl:requests_total",
                "minisgl:failed_requests_total",
                "minisgl:error_responses_total",
                "minisgl:generation_tokens_total",
                "minisgl:kv_pages_capacity",
                "minisgl:time_to_first_token_seconds_count",
            )
        ):
            print("  " + line)
finally:
    server.send_signal(signal.SIGTERM)
    try:
        code = server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        code = server.wait()
        failures.append("the server did not exit within 30 s of SIGTERM")
workers = locals().get("workers", [])
deadline = time.monotonic() + 10  # the workers and multiprocessing's helper exit on their own
while (left := [p for p in workers if alive(p)]) and time.monotonic() < deadline:
    time.sleep(0.2)
# 0 after a drain (supervisor.py); 143 = 128 + SIGTERM if the signal came while starting.
print(f"\nSIGTERM -> server exit code {code}; child processes still alive: {left}")
if code not in (0, 143) or left:
    failures.append(f"expected a clean exit and no children left, got {code} and {left}")
for p in left:
    os.kill(p, signal.SIGKILL)

if failures:
    raise SystemExit("; ".join(failures))
