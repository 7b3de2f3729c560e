"""Slow and vanished clients: no connection holds a request, or its KV pages, without end.

Three ways a client can hold the server's resources while giving nothing back:

- It hangs up before its answer is done. A stream notices at once (Starlette listens for
  the disconnect while it streams), but a route that answers in one piece would compute
  its whole answer for no one. `WatchClients` ends the route, whatever it is, as soon as
  its client is gone; a route's `finally` then aborts its requests (api_server.py).
- It stops reading a stream. Once the socket's buffers are full, each write waits for the
  client, the request holds its place in the server forever, and the server, hearing
  nothing more from the scheduler for that request, would in the end take the scheduler
  for stuck. `ClientTimeouts` cuts a connection that has not taken a byte for
  `--client-timeout` seconds; that is a hang-up, and the first case ends the request.
- It sends its request a byte at a time (or opens a connection and sends nothing), to keep
  connections open. `ClientTimeouts` cuts a connection whose request is not all in
  within `--client-timeout` seconds of its first byte (or of the connection). Between
  requests, an idle connection is closed after uvicorn's keep-alive timeout.

`ClientTimeouts` is uvicorn's h11 protocol with the timers added: uvicorn itself bounds
only the idle time between requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from minisgl.server.limits import CLIENT_TIMEOUT_S

logger = logging.getLogger("minisgl")
KEEP_ALIVE_S = 5  # an idle connection between requests is closed after this (uvicorn's)


class WatchClients:
    """ASGI middleware: the route is cancelled as soon as its client disconnects.

    Once the route has read its body, this middleware alone reads from the connection: a
    route that asks for more (a stream waiting for the disconnect) hears of it from here.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        gone = asyncio.Event()
        body_read = asyncio.Event()

        async def route_receive() -> Message:
            if body_read.is_set():
                await gone.wait()
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
            elif not message.get("more_body", False):
                body_read.set()
            return message

        async def listen() -> None:
            await body_read.wait()
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        route = asyncio.ensure_future(self.app(scope, route_receive, send))
        listener = asyncio.ensure_future(listen())
        try:
            await asyncio.wait([route, listener], return_when=asyncio.FIRST_COMPLETED)
            if not route.done():  # the client is gone: nobody reads the answer
                route.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await route
        finally:
            listener.cancel()
            route.cancel()


class ClientTimeouts(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, bounding how long a client may take to send or to read."""

    timeout = CLIENT_TIMEOUT_S  # --client-timeout: see `with_timeout`

    @classmethod
    def with_timeout(cls, seconds: float) -> type[ClientTimeouts]:
        """The protocol class for uvicorn, which makes one per connection, with this bound."""
        return type(cls.__name__, (cls,), {"timeout": seconds})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._reading: asyncio.TimerHandle | None = None  # the request is not all in
        self._writing: asyncio.TimerHandle | None = None  # the client takes no bytes
        super().connection_made(transport)
        self._arm_reading()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):  # part of a request is in
            if self._reading is None:
                self._arm_reading()
        else:
            self._disarm()

    def _arm_reading(self) -> None:
        self._reading = self.loop.call_later(self.timeout, self._cut, "sending its request")

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._writing is None:
            self._writing = self.loop.call_later(self.timeout, self._cut, "reading its answer")

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._writing is not None:
            self._writing.cancel()
            self._writing = None

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._disarm()  # the WebSocket protocol takes the connection over
        super().handle_websocket_upgrade(event)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._writing is not None:
            self._writing.cancel()
        super().connection_lost(exc)

    def _disarm(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
            self._reading = None

    def _cut(self, doing: str) -> None:
        where = "{}:{}".format(*self.client) if self.client else "a client"
        logger.warning("%s took over %g s %s: closing its connection", where, self.timeout, doing)
        self.transport.abort()  # what is unsent is dropped: the client reads nothing anyway
