"""The live page of chapter 30: GET /dashboard, its state as JSON, and a stream of it (SSE).

The page (static/dashboard.html, .js, .css: plain HTML, JavaScript and SVG, no library, so it
works offline) draws snapshots of the scheduler. The scheduler takes them only while it
holds a watch lease (scheduler/observe.py); this module keeps a lease alive while a page
is connected to /dashboard/events, or for a few seconds after a GET /dashboard/state, by
sending a `WatchMsg` straight to the scheduler, as /flush_cache sends its message. The
snapshots come back through the tokenizer worker with the scheduler's stats, and the
front end keeps the latest; every page reads that one, so ten open pages cost the
scheduler what one does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import zmq.asyncio
from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response, StreamingResponse

from minisgl.message.dashboard import DashboardSnapshot, WatchMsg
from minisgl.message.transport import AsyncWriter, address
from minisgl.server.frontend import Frontend
from minisgl.server.protocol import APIError

STATIC = Path(__file__).with_name("static")
LEASE_S = 3.0  # each WatchMsg asks for this much recording
RENEW_S = 1.0  # and is sent again this often while someone watches
FRESH_S = 1.0  # /dashboard/state answers with a snapshot at most this old, if one comes
WAIT_S = 3.0  # for a fresh one; then the latest, however old, or a 503 if there is none
POLL_S = 0.05  # how often a stream looks for a new snapshot
KEEPALIVE_S = 15.0  # a comment line on a quiet stream, so that proxies keep it open


class Watch:
    """Holds the scheduler's lease while a stream is open or a state request is recent."""

    def __init__(self, ipc_dir: str, text: bool) -> None:
        ctx = zmq.asyncio.Context.instance()
        self.to_scheduler = AsyncWriter(ctx, address(ipc_dir, "scheduler"))
        self.text = text
        self.streams = 0
        self.wanted_until = 0.0
        self.task: asyncio.Task | None = None

    def want(self, seconds: float = 0.0) -> None:
        self.wanted_until = max(self.wanted_until, time.monotonic() + seconds)
        if self.task is None:
            self.task = asyncio.ensure_future(self._renew())

    async def _renew(self) -> None:
        try:
            while self.streams or time.monotonic() < self.wanted_until:
                await self.to_scheduler.send(WatchMsg(LEASE_S, self.text))
                await asyncio.sleep(RENEW_S)
        finally:
            self.task = None


def state_json(snapshot: DashboardSnapshot) -> dict[str, Any]:
    """A snapshot as /dashboard/state answers it: the grid's bytes as a string of letters."""
    state = dataclasses.asdict(snapshot)
    state["pool"]["grid"] = snapshot.pool["grid"].decode("ascii")
    return state


def dashboard_page() -> str:
    """The page, its stylesheet and script inlined: one response holds all of it."""
    css, js = ((STATIC / f"dashboard.{ext}").read_text() for ext in ("css", "js"))
    page = (STATIC / "dashboard.html").read_text()
    page = page.replace('<link rel="stylesheet" href="dashboard.css">', f"<style>\n{css}</style>")
    return page.replace('<script src="dashboard.js"></script>', f"<script>\n{js}</script>")


def add_dashboard_routes(app: FastAPI, frontend: Frontend, ipc_dir: str, text: bool) -> None:
    watch = Watch(ipc_dir, text)
    page = dashboard_page()

    async def snapshot_after(seq: int, timeout: float) -> DashboardSnapshot | None:
        """The first snapshot newer than `seq` (and fresh), or None after `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            snap = frontend.dashboard
            if snap is not None and snap.seq != seq and time.time() - snap.time <= FRESH_S:
                return snap
            await asyncio.sleep(POLL_S)
        return None

    @app.get("/dashboard")
    async def dashboard() -> Response:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/state")
    async def state() -> Response:
        if frontend.failed and frontend.refusal is not None:
            raise frontend.refusal
        watch.want(LEASE_S)
        snap = frontend.dashboard
        if snap is None or time.time() - snap.time > FRESH_S:
            snap = await snapshot_after(-1, WAIT_S) or frontend.dashboard
        if snap is None:
            raise APIError(503, f"the scheduler sent no snapshot within {WAIT_S:.0f} s; retry")
        return Response(encoded(snap), media_type="application/json")

    @app.get("/dashboard/events")
    async def events() -> StreamingResponse:
        if frontend.failed and frontend.refusal is not None:
            raise frontend.refusal
        return StreamingResponse(
            stream(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    last: list[Any] = [None, ""]  # the latest snapshot and its JSON, encoded once for all

    def encoded(snap: DashboardSnapshot) -> str:
        if last[0] is not snap:
            last[:] = [snap, json.dumps(state_json(snap))]
        return last[1]

    async def stream() -> AsyncIterator[str]:
        watch.streams += 1
        watch.want()
        try:
            yield "retry: 2000\n\n"  # the browser reconnects after 2 s if the stream breaks
            seq, quiet_since = 0, time.monotonic()
            while frontend.refusal is None:
                snap = frontend.dashboard
                if snap is not None and snap.seq != seq:
                    seq, quiet_since = snap.seq, time.monotonic()
                    yield f"id: {seq}\ndata: {encoded(snap)}\n\n"
                elif time.monotonic() - quiet_since > KEEPALIVE_S:
                    quiet_since = time.monotonic()
                    yield ": still here\n\n"
                await asyncio.sleep(POLL_S)
            yield f"event: end\ndata: {json.dumps(frontend.refusal.body())}\n\n"
        finally:
            watch.streams -= 1
