"""`python -m minisgl --model M --shell`: chat with the model in the terminal.

It drives the same worker processes as the HTTP server, through the same frontend, so
what you see here is what an API client would get: streamed, incrementally decoded text.
"""

from __future__ import annotations

import asyncio
import sys
import threading

from minisgl.core import SamplingParams
from minisgl.message.frontend import DeltaMsg, TokenizeMsg
from minisgl.server.api_server import APIError, Frontend
from minisgl.server.processes import ProcessTree
from minisgl.server.protocol import UNLIMITED

HELP = "Type a message. /reset forgets the conversation, /exit (or Ctrl-D) quits."


def _read_lines(
    loop: asyncio.AbstractEventLoop, lines: asyncio.Queue, wanted: threading.Event
) -> None:
    # A daemon thread: a read blocked on the terminal must not keep the process alive.
    while True:
        wanted.wait()  # prompt only once the previous reply is printed
        wanted.clear()
        try:
            line = input("> ")
        except EOFError:
            line = None
        loop.call_soon_threadsafe(lines.put_nowait, line)
        if line is None:
            return


async def run_shell(frontend: Frontend, tree: ProcessTree) -> int:
    receiver = asyncio.create_task(frontend.receive_forever())
    lines: asyncio.Queue[str | None] = asyncio.Queue()
    history: list[dict[str, str]] = []
    print(HELP, flush=True)
    wanted = threading.Event()
    reader_args = (asyncio.get_running_loop(), lines, wanted)
    threading.Thread(target=_read_lines, args=reader_args, daemon=True).start()
    try:
        while True:
            wanted.set()
            line = await lines.get()
            if line is None:  # Ctrl-D
                print()
                return 0
            line = line.strip()
            if line == "/exit":
                return 0
            if line == "/reset":
                history.clear()
                print("(conversation cleared)", flush=True)
                continue
            if not line:
                continue
            if tree.dead() is not None:
                print("a worker process died; exiting", file=sys.stderr)
                return 1
            history.append({"role": "user", "content": line})
            reply = await _stream_reply(frontend, history)
            if reply is None:
                history.pop()
            else:
                history.append({"role": "assistant", "content": reply})
    finally:
        receiver.cancel()


async def _stream_reply(frontend: Frontend, history: list[dict[str, str]]) -> str | None:
    msg = TokenizeMsg(
        next(frontend.uids),
        SamplingParams(temperature=0.0, max_tokens=UNLIMITED),
        messages=list(history),
    )
    try:
        queue, _ = await frontend.open([msg])
    except APIError as e:
        print(f"error: {e.message}", flush=True)
        return None
    parts: list[str] = []
    try:
        while True:
            delta: DeltaMsg = await queue.get()
            parts.append(delta.text)
            print(delta.text, end="", flush=True)
            if delta.finished:
                print(flush=True)
                return "".join(parts)
    finally:
        await frontend.close([msg.uid], abort=not parts or not delta.finished)
