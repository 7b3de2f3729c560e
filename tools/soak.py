"""Soak: drive a running server for a fixed time with a mixed load, then check what is left.

Workers send, until the time is up, a mix of requests: greedy completions and chats,
streamed and whole, of random prompt and output lengths; streams the client drops after a
few tokens or before the first; requests it gives up on while they wait; and bad requests
(malformed JSON, out-of-range fields, a prompt longer than any context). Then it checks:

- every good request got a correct, complete answer: the text is the prefix of the answer
  the same prompt got alone at the start (greedy, EOS ignored), with exactly the tokens
  asked for, finish_reason "length", and a stream ends with [DONE];
- every bad request got a 4xx, never a 5xx or no answer;
- nothing hung: no request ran past --request-timeout;
- afterwards /metrics comes back to no running or waiting request and no KV page in use,
  and /health is still ok.

With --server-pid it samples the resident memory (RSS) of the server and its children and
reports how much it grew. Everything is bounded: the run by --duration and a request count,
each request by --request-timeout, the settling by --settle. It exits 1 if a check fails.

    python tools/soak.py --base-url http://127.0.0.1:1919 --duration 1800 --server-pid PID
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

try:
    import httpx
except ModuleNotFoundError:  # the openai client may come with the httpx2 fork instead
    import httpx2 as httpx

_WORD_TEXT = """the river city morning light quiet market old bridge stone garden winter road
north window paper story music table green small people water early house letter night"""
WORDS = _WORD_TEXT.split()


@dataclass
class Tally:
    counts: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def add(self, kind: str, failure: str | None = None) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if failure is not None:
            self.failures.append(f"{kind}: {failure}")


@dataclass
class Prompt:
    chat: bool
    text: str
    reference: str = ""  # the greedy answer alone, --max-tokens long

    def body(self, max_tokens: int, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.text}]
        else:
            body["prompt"] = self.text
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return body

    def url(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.tally = args, Tally()
        self.rng = random.Random(args.seed)
        self.prompts = [
            Prompt(i % 2 == 1, " ".join(self.rng.choices(WORDS, k=self.rng.randint(3, 120))))
            for i in range(args.num_prompts)
        ]

    # ---- requests ---------------------------------------------------------------------

    async def post(self, client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Any:
        body = {"model": self.args.model, **body}
        return await client.post(self.args.base_url + url, json=body)

    async def references(self, client: httpx.AsyncClient) -> None:
        """Each prompt's answer, asked alone before the load starts."""
        for p in tqdm(self.prompts, desc="references", disable=self.args.disable_tqdm):
            r = await self.post(client, p.url(), p.body(self.args.max_tokens, stream=False))
            r.raise_for_status()
            p.reference = answer_text(r.json(), p.chat)

    def check(self, p: Prompt, n: int, text: str, finish: Any, tokens: Any) -> str | None:
        if finish != "length" or tokens != n:
            return f"finish_reason {finish!r} with {tokens} tokens; expected 'length' with {n}"
        if not p.reference.startswith(text) or (n == self.args.max_tokens and text != p.reference):
            return f"{text!r} is not the prefix of the answer alone, {p.reference!r}"
        return None

    async def whole(self, client: httpx.AsyncClient, p: Prompt, n: int) -> str | None:
        r = await self.post(client, p.url(), p.body(n, stream=False))
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {r.text[:200]}"
        out = r.json()
        finish = out["choices"][0]["finish_reason"]
        return self.check(p, n, answer_text(out, p.chat), finish, out["usage"]["completion_tokens"])

    async def streamed(self, client: httpx.AsyncClient, p: Prompt, n: int, drop: int) -> Any:
        """A stream read to its end, or dropped after `drop` events (0: right away)."""
        url, body = self.args.base_url + p.url(), {"model": self.args.model, **p.body(n, True)}
        parts, finish, tokens, done, events = [], None, None, False, 0
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                return f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                if events == drop:
                    return None  # the client hangs up; the server must free what it held
                events += 1
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for c in chunk.get("choices", []):
                    parts.append((c.get("delta", {}).get("content") if p.chat else c["text"]) or "")
                    finish = c.get("finish_reason") or finish
        if not done:
            return "the stream ended without [DONE]"
        return self.check(p, n, "".join(parts), finish, tokens)

    async def impatient(self, client: httpx.AsyncClient, p: Prompt, n: int) -> None:
        """A whole request the client stops waiting for."""
        try:
            wait = self.rng.uniform(0.05, 1.0)
            await asyncio.wait_for(self.post(client, p.url(), p.body(n, stream=False)), wait)
        except asyncio.TimeoutError:
            pass

    async def bad(self, client: httpx.AsyncClient, rng: random.Random) -> tuple[str, str | None]:
        url = self.args.base_url
        cases: list[tuple[str, str, Any]] = [
            ("malformed JSON", "/v1/completions", b'{"prompt": "hi", "max_tokens": '),
            ("empty prompt", "/v1/completions", {"prompt": ""}),
            ("max_tokens -1", "/v1/completions", {"prompt": "hi", "max_tokens": -1}),
            ("temperature -1", "/v1/completions", {"prompt": "hi", "temperature": -1}),
            ("top_p 1.5", "/v1/chat/completions", {"messages": [], "top_p": 1.5}),
            ("messages not a list", "/v1/chat/completions", {"messages": "hello"}),
            ("token id outside vocabulary", "/v1/completions", {"prompt": [10**12]}),
            ("prompt past the context", "/v1/completions", {"prompt": [1] * 300_000}),
            ("n 0, streamed", "/v1/completions", {"prompt": "hi", "n": 0, "stream": True}),
        ]
        name, path, body = rng.choice(cases)
        if isinstance(body, bytes):
            headers = {"content-type": "application/json"}
            r = await client.post(url + path, content=body, headers=headers)
        else:
            r = await client.post(url + path, json={"model": self.args.model, **body})
        ok = 400 <= r.status_code < 500
        return f"bad: {name}", None if ok else f"HTTP {r.status_code}: {r.text[:200]}"

    # ---- the load ---------------------------------------------------------------------

    async def one(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        p, n = rng.choice(self.prompts), rng.randint(1, self.args.max_tokens)
        roll = rng.random()
        if roll < 0.35:
            kind, failure = "whole", await self.whole(client, p, n)
        elif roll < 0.65:
            kind, failure = "streamed", await self.streamed(client, p, n, drop=-1)
        elif roll < 0.75:
            kind, failure = "dropped stream", await self.streamed(client, p, n, rng.randint(0, 4))
        elif roll < 0.85:
            kind, failure = "abandoned whole", await self.impatient(client, p, n)
        else:
            kind, failure = await self.bad(client, rng)
        self.tally.add(kind, failure)

    async def worker(self, client: httpx.AsyncClient, w: int, deadline: float, bar: Any) -> None:
        rng = random.Random(self.args.seed * 1000 + w)
        for _ in range(self.args.max_requests):  # bounded by count as well as by time
            if time.monotonic() >= deadline:
                return
            try:
                await asyncio.wait_for(self.one(client, rng), self.args.request_timeout)
            except asyncio.TimeoutError:
                self.tally.add("hung", f"no answer within {self.args.request_timeout:.0f} s")
            except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
                self.tally.add("broken", f"{type(e).__name__}: {e}"[:200])
            bar.update()

    async def settle(self, client: httpx.AsyncClient) -> dict[str, float]:
        """Poll /metrics until nothing runs, waits or holds KV pages; returns the last sample."""
        deadline = time.monotonic() + self.args.settle
        while True:
            text = (await client.get(self.args.base_url + "/metrics")).text
            m = {key: value for key, value in gauges(text).items() if key in IDLE_GAUGES}
            if all(v == 0 for v in m.values()) or time.monotonic() > deadline:
                return m
            await asyncio.sleep(0.5)

    async def run(self) -> dict[str, Any]:
        a = self.args
        limits = httpx.Limits(max_connections=a.concurrency * 2 + 4)
        async with httpx.AsyncClient(timeout=a.request_timeout, limits=limits) as client:
            await self.references(client)
            rss = Rss(a.server_pid)
            deadline = time.monotonic() + a.duration
            with tqdm(desc="soak", unit="req", disable=a.disable_tqdm) as bar:
                workers = [self.worker(client, w, deadline, bar) for w in range(a.concurrency)]
                await asyncio.gather(*workers, rss.watch(deadline, a.rss_interval))
            idle = await self.settle(client)
            healthy = (await client.get(a.base_url + "/health")).status_code == 200
        rss.sample()
        t = self.tally
        missing = [g for g in IDLE_GAUGES if g not in idle]
        if missing:
            t.failures.append(f"/metrics has no {', '.join(missing)}")
        if any(v != 0 for v in idle.values()):
            t.failures.append(f"not idle {a.settle:.0f} s after the load: {idle}")
        if not healthy:
            t.failures.append("/health is not ok after the load")
        return {
            "duration_s": a.duration,
            "concurrency": a.concurrency,
            "requests": dict(sorted(t.counts.items())),
            "failed": len(t.failures),
            "failures": t.failures[:20],
            "idle_after": idle,
            **rss.report(),
        }


# ---- reading answers, metrics and memory --------------------------------------------------

IDLE_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_pages_used")


def answer_text(out: dict[str, Any], chat: bool) -> str:
    choice = out["choices"][0]
    return choice["message"]["content"] if chat else choice["text"]


def gauges(text: str) -> dict[str, float]:
    """Prometheus text as {name without its prefix: value}, for unlabelled samples."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name.split(":")[-1]] = float(value)
    return out


class Rss:
    """Resident memory of a process and its descendants, read from /proc."""

    def __init__(self, pid: int | None) -> None:
        self.pid, self.samples = pid, []
        self.sample()

    def sample(self) -> None:
        if self.pid is not None:
            self.samples.append(sum(rss_kib(p) for p in [self.pid, *children(self.pid)]))

    async def watch(self, deadline: float, interval: float) -> None:
        while time.monotonic() < deadline:
            await asyncio.sleep(max(0.0, min(interval, deadline - time.monotonic())))
            self.sample()

    def report(self) -> dict[str, Any]:
        if not self.samples:
            return {}
        mib = [s / 1024 for s in self.samples]
        return {
            "rss_start_mib": round(mib[0], 1),
            "rss_end_mib": round(mib[-1], 1),
            "rss_peak_mib": round(max(mib), 1),
            "rss_growth_mib": round(mib[-1] - mib[0], 1),
        }


def children(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for tasks in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            try:
                found = [int(c) for c in tasks.read_text().split()]
            except OSError:  # a thread or process that ended while we looked
                continue
            out += found
            todo += found
    return out


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:1919")
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct", help="the served name")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=6, help="workers, one request each")
    p.add_argument("--num-prompts", type=int, default=12, help="prompts with a reference")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--max-requests", type=int, default=100_000, help="per worker")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--settle", type=float, default=60.0, help="seconds to wait for idle")
    p.add_argument("--server-pid", type=int, help="measure this process tree's RSS")
    p.add_argument("--rss-interval", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json")
    p.add_argument("--disable-tqdm", action="store_true")
    args = p.parse_args()
    args.base_url = args.base_url.rstrip("/")
    report = asyncio.run(Soak(args).run())
    text = json.dumps(report, indent=1)
    print(text)
    if args.output_json:
        Path(args.output_json).write_text(text + "\n")
    sys.exit(1 if report["failures"] else 0)


if __name__ == "__main__":
    main()
