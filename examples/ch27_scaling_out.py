"""Chapter 27: two replicas behind SGLang's router, started by one command, on the CPU.

The same shared-prefix conversations run under round_robin and under cache_aware; the
router's /engine_metrics (every replica's /metrics, labelled by replica) tells how many
requests each replica served and how many prompt tokens came from its prefix cache.
"""

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx

MODEL = "models/SmolLM2-135M-Instruct"
TOPICS = [
    "You are a ship's navigator in 1850. Describe the stars you steer by and the night watch.",
    "You are a baker in a mountain village. Describe your oven and the flour from the mill.",
    "You are a lighthouse keeper. Describe the great lamp and the storms of winter.",
]


def start(policy: str) -> tuple[subprocess.Popen, str]:
    """`python -m minisgl --dp-size 2`: two replicas and the router, on a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "minisgl", "--model", MODEL, "--device", "cpu"]
    cmd += ["--dtype", "float32", "--max-seq-len-override", "512", "--port", str(port)]
    cmd += ["--dp-size", "2", "--router-policy", policy, "--log-level", "WARNING"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc: subprocess.Popen, base: str) -> None:
    while status_of(base + "/readiness") != 200:
        assert proc.poll() is None, f"the launcher exited with {proc.returncode}"
        time.sleep(0.5)


def status_of(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.TransportError:
        return None


def converse(base: str, model: str) -> list[str]:
    chats = [[{"role": "user", "content": topic}] for topic in TOPICS]
    answers = []
    for turn in range(3):
        for chat in chats:
            body = {"model": model, "messages": chat, "max_tokens": 8, "temperature": 0}
            r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120).json()
            answers.append(r["choices"][0]["message"]["content"])
            chat += [{"role": "assistant", "content": answers[-1]}]
            chat += [{"role": "user", "content": f"Go on, part {turn + 2}."}]
    return answers


def per_replica(base: str, name: str) -> list[int]:
    text = httpx.get(base + "/engine_metrics", timeout=10).text
    rows = re.findall(rf'^minisgl_{name}_total{{worker_addr="[^"]+"}} (\S+)$', text, re.M)
    return [int(float(v)) for v in rows]


if importlib.util.find_spec("sglang_router") is None:
    print('SGLang\'s router is not installed: pip install "minisgl[router]"')
    sys.exit(0)

signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the set
answers = {}
for policy in ("round_robin", "cache_aware"):
    proc, base = start(policy)
    try:
        wait_ready(proc, base)
        model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        answers[policy] = converse(base, model)
        requests = per_replica(base, "requests")
        prompt, cached = per_replica(base, "prompt_tokens"), per_replica(base, "cached_tokens")
    finally:  # one command started them all; one signal stops them all
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    print(f"{policy:>11}: requests per replica {requests}, prompt tokens {sum(prompt)},")
    print(f"{'':>11}  from the prefix cache {sum(cached)} ({sum(cached) / sum(prompt):.0%})")
    print(f"{'':>11}  SIGTERM: the launcher exited with {code}")

print("the model's name, as the router lists it:", model)
print("same answers under both policies:", answers["round_robin"] == answers["cache_aware"])
print("turn 3 of the navigator's conversation:", repr(answers["cache_aware"][6]))
