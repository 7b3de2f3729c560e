"""Fail fast, drain gently: what the HTTP server does when a worker dies or a signal comes.

A dead worker (killed, crashed, or exited, whichever one) is fatal: the engine's state went
with it, so no request in flight can finish and none should wait for it. Every client gets
a 503 at once (a stream gets an error event and ends), /health turns 503, and the server
exits 1, so that whoever runs it (systemd, Docker, Kubernetes) starts a fresh one. A stuck
worker is treated alike: the scheduler reports after every step, so requests that hear
nothing for `worker_timeout` seconds mean a worker that will not answer again.

SIGTERM or SIGINT asks the server to stop: it admits nothing more (503, and /ready says
so), lets the running requests finish for up to `shutdown_timeout` seconds, ends the rest
with a 503, and exits 0. A second signal skips the wait. uvicorn's own handlers would stop
listening at once and wait for every connection without a bound; these replace them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from types import FrameType

import uvicorn

from minisgl.server.frontend import Frontend
from minisgl.server.protocol import APIError

logger = logging.getLogger("minisgl")
POLL_S = 0.1  # how often the workers are looked at, and a drain looks for the last request
UNHEALTHY_GRACE_S = 1.0  # /health answers 503 this long before a server with a dead worker exits
CONNECTIONS_TIMEOUT_S = 3  # after the last request has its answer, for connections to close


class Supervisor(uvicorn.Server):
    """uvicorn's server, with a watch on the workers and a bounded drain on signals."""

    def __init__(
        self,
        config: uvicorn.Config,
        frontend: Frontend,
        dead: Callable[[], BaseProcess | None],
        shutdown_timeout: float,
        worker_timeout: float,
    ) -> None:
        config.timeout_graceful_shutdown = CONNECTIONS_TIMEOUT_S
        super().__init__(config)
        self.frontend = frontend
        self.dead = dead  # the first worker found dead, or None
        self.shutdown_timeout = shutdown_timeout
        self.worker_timeout = worker_timeout
        self.draining: asyncio.Task | None = None  # the drain, once a signal came
        self.exit_code = 0

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:  # listening: the last step of the server's start-up
            logger.info(
                "start-up: HTTP server listening on %s:%d", self.config.host, self.config.port
            )

    def live(self) -> bool:
        return self.dead() is None and self.exit_code == 0

    def ready(self) -> bool:
        return self.live() and self.draining is None

    async def watch(self) -> None:
        """Look at the workers until the server stops; a dead or stuck one ends everything."""
        while not self.should_exit:
            silent = time.monotonic() - self.frontend.heard
            if (proc := self.dead()) is not None:
                fault = f"lost its {proc.name} worker (exit code {proc.exitcode})"
            elif self.frontend.queues and silent > self.worker_timeout:
                fault = f"heard nothing from its workers for {silent:.0f} s (--worker-timeout)"
            else:
                await asyncio.sleep(POLL_S)
                continue
            logger.error("the server %s: failing every request; exiting", fault)
            self.exit_code = 1
            message = f"the server {fault} and is shutting down; retry when it is back"
            self.frontend.fail(APIError(503, message, retry_after=5))
            await asyncio.sleep(UNHEALTHY_GRACE_S)  # so that monitors see why we go
            self.should_exit = True
            return

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()

        def handler(sig: int, frame: FrameType | None) -> None:
            loop.call_soon_threadsafe(self.on_signal, signal.Signals(sig))

        before = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, old in before.items():
                signal.signal(sig, old)

    def on_signal(self, sig: signal.Signals) -> None:
        if self.draining is not None:
            logger.warning("%s again: ending every request now", sig.name)
            self.stop()
            return
        message = "the server is shutting down and admits no more requests; retry elsewhere"
        self.frontend.refusal = APIError(503, message, retry_after=5)
        logger.info(
            "%s: admitting no more requests; waiting up to %s s for %d running",
            sig.name,
            self.shutdown_timeout,
            len(self.frontend.queues),
        )
        self.draining = asyncio.ensure_future(self.drain())  # held: a task is weakly referenced

    async def drain(self) -> None:
        deadline = time.monotonic() + self.shutdown_timeout
        while self.frontend.queues and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        if self.frontend.queues:
            logger.warning("%d requests still running: ending them", len(self.frontend.queues))
        self.stop()

    def stop(self) -> None:
        message = "the server is shutting down; retry on another replica or when it is back"
        self.frontend.fail(APIError(503, message, retry_after=5))
        self.should_exit = True
