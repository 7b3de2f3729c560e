"""ZMQ sockets between our processes: one-way PUSH/PULL pipes over ipc:// files.

Every pipe has one binding end (the reader) and connecting ends (the writers); the ipc
files live in a private directory made by the launcher, readable by its user only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from minisgl.message.codec import decode, encode


def address(ipc_dir: str | Path, name: str) -> str:
    return f"ipc://{Path(ipc_dir) / name}"


class Reader:
    def __init__(self, ctx: zmq.Context, addr: str) -> None:
        self.socket = ctx.socket(zmq.PULL)
        self.socket.bind(addr)

    def recv(self, timeout_ms: int | None = None) -> Any | None:
        """One message, or None if none arrives within the timeout."""
        if timeout_ms is not None and not self.socket.poll(timeout_ms):
            return None
        return decode(self.socket.recv())

    def recv_all(self) -> list[Any]:
        """Every message already waiting, without blocking."""
        out = []
        while self.socket.poll(0):
            out.append(decode(self.socket.recv()))
        return out


class Writer:
    def __init__(self, ctx: zmq.Context, addr: str) -> None:
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(addr)

    def send(self, msg: Any) -> None:
        self.socket.send(encode(msg))


class AsyncReader:
    def __init__(self, ctx: zmq.asyncio.Context, addr: str) -> None:
        self.socket = ctx.socket(zmq.PULL)
        self.socket.bind(addr)

    async def recv(self) -> Any:
        return decode(await self.socket.recv())


class AsyncWriter:
    def __init__(self, ctx: zmq.asyncio.Context, addr: str) -> None:
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(addr)

    async def send(self, msg: Any) -> None:
        await self.socket.send(encode(msg))

    def send_nowait(self, msg: Any) -> None:
        """For cleanup code that must not wait (it may run while being cancelled)."""
        self.socket.send(encode(msg), zmq.NOBLOCK)
