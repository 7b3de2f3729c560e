"""Chapter 30: watching the engine. A server on the CPU with its live page, and a workload in
four acts, each made to show one earlier chapter at work; during each act we read
/dashboard/state, the snapshot the page draws, and print what it shows.

1. a shared system prompt: the radix cache (chapter 11) serves it to every chat after the first;
2. a prompt longer than the prefill budget: chunked prefill (chapter 10);
3. more tokens wanted than the KV pool holds: preemption (chapter 9);
4. a burst of three requests: decode graphs (chapter 18, an EmulatedGraph on the CPU) pad it to 4.

Run from the repo root: python examples/ch30_dashboard.py
    --pace 2             waits 2 s between acts: open the printed address and watch
    --screenshots docs   saves the page during each act (needs chromium and selenium)
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

MODEL = "models/SmolLM2-135M-Instruct"
SERVER = ["--device", "cpu", "--dtype", "float32", "--max-seq-len-override", "512",
          "--page-size", "4", "--num-pages", "72", "--max-running-requests", "4",
          "--max-prefill-length", "48", "--cuda-graph-max-bs", "4",
          "--log-level", "WARNING"]  # fmt: skip
SYSTEM = (
    "You are the guide of a small museum of maps. You answer in two sentences, you name the "
    "century of every map you mention, and you never invent a map that is not in the museum."
)
QUESTIONS = ["Which is your oldest map?", "Do you have a map of the Nile?",
             "Who drew the sea charts?", "What is in the first room?"]  # fmt: skip
LONG = "The caravan crossed the desert for forty days, resting at each oasis. " * 14


class Watcher:
    """Reads /dashboard/state in the background while an act runs, keeping every snapshot."""

    def __init__(self, base: str) -> None:
        self.base, self.snapshots, self.stop = base, [], threading.Event()
        self.when: list[tuple[Callable[[dict], bool], Callable[[], None]]] = []

    def state(self) -> dict[str, Any]:
        return httpx.get(self.base + "/dashboard/state", timeout=30).json()

    def poll(self) -> None:
        while not self.stop.wait(0.2):
            snap = self.state()
            self.snapshots.append(snap)
            for i, (check, then) in enumerate(self.when):
                if check(snap):
                    del self.when[i]
                    then()
                    break

    def act(self, work: Callable[[], Any], check=None, then=None) -> list[dict[str, Any]]:
        self.snapshots, self.when = [], [(check, then)] if check else []
        self.stop.clear()
        thread = threading.Thread(target=self.poll)
        thread.start()
        try:
            work()
        finally:
            self.stop.set()
            thread.join()
        done = time.time()
        while (snap := self.state())["time"] < done:  # the state the work left behind
            time.sleep(0.1)
        return self.snapshots + [snap]


def chat(base: str, user: str, max_tokens: int, system: str | None = SYSTEM) -> dict[str, Any]:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}
    ]
    body = {"model": Path(MODEL).name, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=600).json()


def at_once(base: str, users: list[str], max_tokens: int, system: str | None = SYSTEM) -> None:
    with ThreadPoolExecutor(len(users)) as pool:
        list(pool.map(lambda u: chat(base, u, max_tokens, system), users))


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "minisgl", "--model", MODEL, "--port", str(port), *SERVER]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    while True:
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.5)


def open_page(base: str, folder: str | None) -> Callable[[str], Callable[[], None]]:
    """A headless browser on the page; returns `shot(name)`, a callback that saves it."""
    if folder is None:
        return lambda name: lambda: None
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1366,1000", "--hide-scrollbars"):  # fmt: skip
        options.add_argument(arg)
    page = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    page.get(base + "/dashboard")
    time.sleep(2)

    def shot(name: str) -> Callable[[], None]:
        def save() -> None:
            time.sleep(0.4)  # the page draws the snapshot the check saw
            path = Path(folder) / f"ch30_{name}.png"
            page.save_screenshot(str(path))
            shrink(path)
            print(f"  (saved {path})")

        return save

    return shot


def shrink(path: Path) -> None:
    """A palette of 64 colours: the page has a dozen, and the file gets five times smaller."""
    from PIL import Image

    Image.open(path).convert("RGB").quantize(64).save(path, optimize=True)


def main() -> None:
    p = argparse.ArgumentParser(description="The live page, during a scripted workload.")
    p.add_argument("--pace", type=float, default=0.0, help="seconds between the acts")
    p.add_argument("--screenshots", default=None, help="a folder for PNGs of the page")
    args = p.parse_args()
    proc, base = start_server()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        print(f"the page: {base}/dashboard")
        shot = open_page(base, args.screenshots)
        watch = Watcher(base)
        acts(base, watch, shot, args.pace)
    finally:
        proc.terminate()
        proc.wait(30)


def acts(base: str, watch: Watcher, shot: Callable, pace: float) -> None:
    print("\n1. a shared system prompt, one chat first and then three at once")
    snaps = watch.act(
        lambda: (chat(base, QUESTIONS[0], 8), at_once(base, QUESTIONS[1:], 24)),
        lambda s: len(s["running"]) >= 3, shot("shared_prefix"),
    )  # fmt: skip
    last = snaps[-1]
    for r in reversed(last["finished"][:4]):
        print(f"  request {r['id']}: prompt {r['prompt_tokens']} tokens, "
              f"{r['cached_tokens']} from the radix cache")  # fmt: skip
    nodes = last["tree"]["nodes"]
    ends = [0] * len(nodes)
    for n in nodes[1:]:
        ends[n["id"]] = ends[n["parent"]] + n["tokens"]
    fork = max((n for n in nodes[1:] if n["children"] > 1), key=lambda n: ends[n["id"]])
    print(f"  the tree: {last['tree']['total_nodes']} nodes; the first {ends[fork['id']]} "
          f"tokens are shared, and fork into {fork['children']} branches there")  # fmt: skip
    time.sleep(pace)

    print("\n2. a prompt of about 200 tokens; the prefill budget is 48 a step")
    snaps = watch.act(
        lambda: chat(base, LONG, 4, system=None),
        lambda s: any(r["state"] == "prefilling" for r in s["running"]), shot("chunked_prefill"),
    )  # fmt: skip
    steps = snaps[-1]["steps"]
    prefills = [(t, c) for k, t, c in zip(steps["kind"], steps["tokens"], steps["chunks"])
                if k == "prefill"][-5:]  # fmt: skip
    print("  its prefill steps, tokens each:", ", ".join(
        f"{t}{' (a chunk)' if c else ''}" for t, c in prefills))  # fmt: skip
    seen = sorted({(r["computed_tokens"], r["prompt_tokens"]) for s in snaps for r in s["running"]
                   if r["state"] == "prefilling"})  # fmt: skip
    print("  snapshots that caught it prefilling showed it computed:",
          ", ".join(f"{c} of {p} tokens" for c, p in seen))  # fmt: skip
    time.sleep(pace)

    print("\n3. four requests of 90 tokens each, 72 pages of 4 tokens for all of them")
    before = snaps[-1]["counters"]["preemptions_total"]
    snaps = watch.act(
        lambda: at_once(base, [f"Tell me the story of map number {i}." for i in range(4)], 90),
        lambda s: any(r["state"] == "preempted" for r in s["waiting"]), shot("preemption"),
    )  # fmt: skip
    after = snaps[-1]["counters"]["preemptions_total"]
    full = max(snaps, key=lambda s: s["pool"]["running"] + s["pool"]["locked"])["pool"]
    print(f"  preemptions: {after - before}; at the fullest the pool had {full['free']} free, "
          f"{full['running']} held by requests, {full['locked']} locked, "
          f"{full['cached']} cached pages")  # fmt: skip
    preempted = sorted({r["id"] for s in snaps for r in s["waiting"] if r["state"] == "preempted"})
    print(f"  requests the page showed as preempted: {preempted}")
    time.sleep(pace)

    print("\n4. a burst of three; decode graphs were captured for 1, 2 and 4 requests")
    snaps = watch.act(
        lambda: at_once(base, ["Name a map.", "Name a sea.", "Name a city."], 12),
        lambda s: s["counters"]["running"] == 3 and s["steps"]["kind"][-1] == "decode",
        shot("graph_padding"),
    )  # fmt: skip
    for kind, size, padded, replays, steps in snaps[-1]["graphs"]:
        if kind == "decode":
            print(f"  decode steps of {size}: {steps}, {replays} replayed a graph of {padded}")


if __name__ == "__main__":
    main()
