"""What the live page shows, recorded by the scheduler only while a page looks (chapter 30).

Two parts. `StepLog` listens to the scheduler's forwards: a fixed-size ring of the last
steps (their kind, batch, tokens, graph and time) and the graph hits by batch size.
`Observer` is driven by the worker loop: it takes the watch leases the API server sends,
registers the step log with the scheduler while one lasts, notes when requests arrive and
produce their first token, and at a few snapshots a second reads the scheduler's own state
(its requests, the owner of every KV page, the radix tree) into a `DashboardSnapshot`.

Without a lease nothing is recorded: the step log is not among the scheduler's listeners,
the observer's `publish` returns None, and that is the whole cost. With one, the step log
costs a clock read on the host and a record per step, and `publish` keeps the step's tokens
as they are, with the time: they are counted (per request, first tokens, ends) only when a
snapshot is due, off the steps in between.
Building a snapshot is kept under about 1% of the loop's time by spacing snapshots out
when one takes long (a big tree, a big pool).
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from minisgl.core import Batch
from minisgl.kvcache.radix_cache import RadixCache, RadixNode, access_tick
from minisgl.message.backend import AbortMsg, TokenMsg, UserMsg
from minisgl.message.dashboard import DashboardSnapshot, WatchMsg
from minisgl.scheduler.hybrid_cache import state_counters  # [ch31]
from minisgl.scheduler.views import pool_view, tree_view
from minisgl.scheduler.window_cache import window_counters
from minisgl.utils import cdiv

if TYPE_CHECKING:
    from minisgl.scheduler.scheduler import Scheduler

STEPS = 256  # forwards kept in the ring
FINISHED = 24  # finished requests kept for the page
WAITING = 64  # queued requests listed (all are counted)
EVERY_S = 0.25  # between two snapshots, at least
PENDING = 256  # steps whose tokens wait to be counted, at most
BUDGET = 0.005  # the share of the time that building snapshots may take
WINDOW_S = 5.0  # rates are over this many seconds
TICK_EVERY_S = 0.05  # the radix clock is read this often, to date a node's last use
PROMPT_IDS, OUTPUT_IDS = 32, 32  # token ids sent for text: a prompt's last, an output's last
STEP_FIELDS = ("step", "time", "kind", "size", "tokens", "chunks", "graph", "padded", "ms")


class StepLog:
    """The last forwards, in a ring: a listener of the scheduler while a page is watching.

    A step's time is the loop's pace, read on the host: from its start to the next step's
    start. While the device is the bound that is the device's time a step (the host launches
    the next step once this one's tokens are in), and while the host is, the host's: what a
    step costs either way. No device call: a CUDA event's record cost the host 12-32 us on
    an H100 machine, and two a step were most of the page's cost at batch 64."""

    def __init__(self) -> None:
        self.on = False  # a lease lasts: registered with the scheduler
        self.began = 0.0  # the start of the latest step (perf_counter)
        self.last: list[Any] | None = None  # the latest record: the next start gives its time
        self.ring: deque[list[Any]] = deque(maxlen=STEPS)
        self.count = 0
        self.graphs: dict[tuple[str, int, int], list[int]] = {}  # -> [replays, steps]

    def forward_begins(self, batch: Batch) -> None:
        """Before a forward is prepared: the step before it ends here."""
        now = time.perf_counter()
        if self.last is not None:
            self.last[-1] = round((now - self.began) * 1e3, 3)
        self.began = now

    def forward_launched(self, batch: Batch) -> None:
        """After the forward is launched: one record, its time to come."""
        graph = batch.graphed
        key = (batch.phase, batch.size, batch.padded_size if graph else batch.size)
        hits = self.graphs.setdefault(key, [0, 0])
        hits[0] += graph
        hits[1] += 1
        self.count += 1
        if batch.is_decode:  # one new token a request, none mid-prompt: no loop over them
            tokens, chunks = batch.size, 0
        else:
            tokens = sum(r.extend_len for r in batch.reqs)
            chunks = sum(r.mid_prompt for r in batch.reqs)
        self.last = [self.count, time.time(), batch.phase, batch.size, tokens, chunks, graph]
        self.last += [key[2], None]
        self.ring.append(self.last)

    def idle(self) -> None:
        """The loop waits for work: the latest step's time stays unknown (the wait is not its)."""
        self.last = None

    def columns(self) -> dict[str, list[Any]]:
        """The ring as one list per field; the latest step's ms is None until the next starts."""
        cols = [list(c) for c in zip(*self.ring)] if self.ring else [[] for _ in STEP_FIELDS]
        return dict(zip(STEP_FIELDS, cols))


class Observer:
    """Turns the scheduler's state into snapshots, while a watch lease lasts."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self.log = StepLog()
        self.until = 0.0  # the lease's end (monotonic)
        self.text = False
        self.seq = 0
        self.next_at = 0.0
        self.reqs: dict[int, dict[str, Any]] = {}  # by uid: arrival, first token, counts
        self.finished: deque[dict[str, Any]] = deque(maxlen=FINISHED)
        self.ttfts: deque[float] = deque(maxlen=64)
        self.outputs: deque[tuple[float, int]] = deque(maxlen=4096)  # (time, tokens out)
        self.pending: list[tuple[float, list[TokenMsg]]] = []  # steps' tokens, not counted yet
        self.ticks: deque[tuple[int, float]] = deque(maxlen=4096)  # the radix clock, dated
        self.engine_info = engine_info(scheduler)

    def receive(self, messages: list[Any]) -> None:
        now = time.monotonic()
        if self.pending and any(isinstance(m, AbortMsg) for m in messages):
            self._flush()  # an aborted request's tokens counted before it ends
        for msg in messages:
            if isinstance(msg, WatchMsg):
                if not self.log.on:
                    self._start(now)
                self.until, self.text = now + msg.seconds, msg.text
            elif not self.log.on:
                continue
            elif isinstance(msg, UserMsg):
                ids = msg.input_ids[-PROMPT_IDS:]
                self.reqs[msg.uid] = _req_info(now, len(msg.input_ids), 0, ids, [])
            elif isinstance(msg, AbortMsg) and (info := self.reqs.pop(msg.uid, None)):
                self.finished.appendleft(self._ended(msg.uid, info, "abort", None, now))

    def publish(self, tokens: list[TokenMsg]) -> DashboardSnapshot | None:
        """A snapshot when one is due (None most steps, and always without a lease)."""
        if not self.log.on:
            return None
        now = time.monotonic()
        if now >= self.until:
            self._stop()
            return None
        if not self.ticks or now - self.ticks[-1][1] >= TICK_EVERY_S:
            self.ticks.append((access_tick(), now))
        self.pending.append((now, tokens))
        if not self.s.has_work:
            self.log.idle()
        if now < self.next_at and self.s.has_work:  # the state it idles in is always sent
            if len(self.pending) >= PENDING:
                self._flush()
            return None
        self._flush()
        snapshot = self.snapshot(now)
        spent = time.monotonic() - now
        self.next_at = now + max(EVERY_S, spent / BUDGET)
        return snapshot

    def _start(self, now: float) -> None:
        self.log.on, self.next_at = True, 0.0
        self.s.listeners.append(self.log)
        for req in self.s.reqs.values():  # those already running, their arrival unknown
            out = req.seq_len - req.prompt_len
            self.reqs[req.uid] = _req_info(None, req.prompt_len, out, [], [])
        for p in self.s.prefill.pending:
            out = len(p.input_ids) - p.prompt_len
            self.reqs[p.uid] = _req_info(None, p.prompt_len, out, [], [])

    def _stop(self) -> None:
        self.log.on, self.log.last = False, None
        self.s.listeners.remove(self.log)
        self.reqs.clear()  # requests may end unseen from now on
        self.pending.clear()

    def _flush(self) -> None:
        """Count the steps' tokens kept since the last time, each at its step's time."""
        for now, tokens in self.pending:
            self._count(tokens, now)
        self.pending.clear()

    def _count(self, tokens: list[TokenMsg], now: float) -> None:
        out = 0
        for msg in tokens:
            info = self.reqs.get(msg.uid)
            if info is None or msg.error is not None:
                continue
            out += 1
            info["output_tokens"] += 1
            if self.text:
                info["output_ids"] = (info["output_ids"] + [msg.token])[-OUTPUT_IDS:]
            if info["ttft_ms"] is None and info["arrived"] is not None:
                info["ttft_ms"] = round((now - info["arrived"]) * 1e3, 1)
                self.ttfts.append(info["ttft_ms"])
            if msg.finished:
                del self.reqs[msg.uid]
                self.finished.appendleft(
                    self._ended(msg.uid, info, msg.finish_reason, msg.cached_tokens, now)
                )
        self.outputs.append((now, out))

    def _ended(
        self, uid: int, info: dict[str, Any], reason: str | None, cached: int | None, now: float
    ) -> dict[str, Any]:
        view = {"id": uid, "state": "finished", "reason": reason, "cached_tokens": cached}
        view.update({k: info[k] for k in ("prompt_tokens", "output_tokens", "ttft_ms")})
        view["time"] = time.time()
        if info["arrived"] is not None:
            view["latency_s"] = round(now - info["arrived"], 3)
        if self.text:
            view["prompt_ids"], view["output_ids"] = info["prompt_ids"], info["output_ids"]
        return view

    # ---- the snapshot ---------------------------------------------------------------------

    def snapshot(self, now: float) -> DashboardSnapshot:
        self.seq += 1
        s = self.s
        steps = self.log.columns()
        graphs = [[*key, *hits] for key, hits in sorted(self.log.graphs.items())]
        return DashboardSnapshot(
            seq=self.seq,
            time=time.time(),
            engine=self.engine_info | {"text": self.text},
            counters=self._counters(now, steps),
            steps=steps,
            running=[self._running(req, now) for req in s.reqs.values()],
            waiting=[self._waiting(p, now) for p in list(s.prefill.pending)[:WAITING]],
            finished=list(self.finished),
            pool=pool_view(s),
            tree=self._tree(now),
            graphs=graphs,
        )

    def _counters(self, now: float, steps: dict[str, list[Any]]) -> dict[str, Any]:
        s, window = self.s, min(WINDOW_S, now - self.outputs[0][0]) if self.outputs else 0.0
        out = sum(n for t, n in self.outputs if t >= now - window)
        since = time.time() - window
        prefill = sum(
            n for t, k, n in zip(steps["time"], steps["kind"], steps["tokens"])
            if k == "prefill" and t >= since
        )  # fmt: skip
        ttfts = sorted(self.ttfts)
        return {
            "tokens_per_s": round(out / window, 1) if window > 0 else 0.0,
            "prefill_tokens_per_s": round(prefill / window, 1) if window > 0 else 0.0,
            "ttft_ms_p50": statistics.median(ttfts) if ttfts else None,
            "ttft_ms_p90": ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None,
            "running": len(s.reqs),
            "waiting": len(s.prefill.pending),
            "preemptions_total": s.num_preemptions,
            "cached_tokens_total": s.prefill.cached_tokens_total,
            "steps_total": self.log.count,
            **window_counters(s.cache),  # a sliding window's own pages (chapter 29)
            **state_counters(len(s.reqs), s.cache, s.engine.state_pool),  # [ch31]
        }

    def _running(self, req: Any, now: float) -> dict[str, Any]:
        ps, s = self.s.cache.page_size, self.s
        info = self.reqs.get(req.uid) or _req_info(None, req.prompt_len, 0, [], [])
        view = {
            "id": req.uid,
            "state": "prefilling" if req is s.prefill.chunked else "decoding",
            "prompt_tokens": req.prompt_len,
            "computed_tokens": min(req.cached_len, req.seq_len),
            "cached_tokens": req.cached_tokens,
            "output_tokens": req.seq_len - req.prompt_len,
            "max_tokens": req.max_device_len - req.prompt_len,
            "pages": cdiv(req.alloc_len, ps),
            "shared_pages": req.shared_len // ps,
            "ttft_ms": info["ttft_ms"],
            "age_s": round(now - info["arrived"], 2) if info["arrived"] is not None else None,
        }
        if s.spec.enabled:
            view["spec_acceptance"] = round(s.spec.rate(req.uid), 3)
        if self.text:
            view["prompt_ids"] = req.input_ids[: req.prompt_len][-PROMPT_IDS:].tolist()
            view["output_ids"] = req.input_ids[req.prompt_len :][-OUTPUT_IDS:].tolist()
        return view

    def _waiting(self, p: Any, now: float) -> dict[str, Any]:
        info = self.reqs.get(p.uid)
        arrived = info["arrived"] if info is not None else None
        view = {
            "id": p.uid,
            "state": "queued" if p.cached_tokens is None else "preempted",
            "prompt_tokens": p.prompt_len,
            "output_tokens": len(p.input_ids) - p.prompt_len,
            "max_tokens": p.max_device_len - p.prompt_len,
            "age_s": round(now - arrived, 2) if arrived is not None else None,
        }
        if self.text:
            view["prompt_ids"] = p.input_ids[: p.prompt_len][-PROMPT_IDS:].tolist()
            view["output_ids"] = p.input_ids[p.prompt_len :][-OUTPUT_IDS:].tolist()
        return view

    def _tree(self, now: float) -> dict[str, Any]:
        cache = self.s.cache.cache
        if not isinstance(cache, RadixCache):
            return {"nodes": [], "total_nodes": 0, "total_tokens": 0}
        ticks = [t for t, _ in self.ticks]

        def last_used(node: RadixNode) -> float | None:
            i = bisect.bisect_left(ticks, node.last_access)
            if i == 0 or i == len(ticks):  # before the page looked, or just now
                return None if i == 0 else 0.0
            return round(now - self.ticks[i][1], 2)

        view = tree_view(cache.root, last_used, self.text)
        view["clock_span_s"] = round(now - self.ticks[0][1], 1) if self.ticks else 0.0
        return view


def _req_info(
    arrived: float | None, prompt: int, output: int, prompt_ids: list[int], out_ids: list[int]
) -> dict[str, Any]:
    return {
        "arrived": arrived,
        "ttft_ms": None,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "prompt_ids": prompt_ids,
        "output_ids": out_ids,
    }


def engine_info(s: Scheduler) -> dict[str, Any]:
    e = s.engine
    return {
        "model": e.config.model_path.rstrip("/").rsplit("/", 1)[-1],
        "device": str(e.device),
        "dtype": str(e.dtype).removeprefix("torch."),
        "attention": e.attn_backend.name,
        "num_pages": s.cache.num_pages,
        "page_size": s.cache.page_size,
        "max_running_requests": s.limits.max_running_req,
        "max_prefill_length": s.prefill.max_prefill_length,
        "decode_graphs": sorted(e.graph_runner.graph_map),
        "overlap": s.overlap,
        "speculative": s.spec.enabled,
    }
