"""`python -m minisgl --model M --shell`: chat with the model in the terminal.

It drives the same worker processes as the HTTP server, through the same frontend, so
what you see here is what an API client would get: streamed, incrementally decoded text.
Ctrl-C while a reply streams stops that reply (its request is aborted) and the chat goes
on; at the prompt, Ctrl-C quits, as it does in any program.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time

from minisgl.message.frontend import TokenizeMsg
from minisgl.sampling_params import SamplingParams
from minisgl.server.frontend import Choice, Frontend
from minisgl.server.processes import ProcessTree
from minisgl.server.protocol import UNLIMITED, APIError

HELP = (
    "Type a message. Ctrl-C stops a reply, /reset forgets the conversation, "
    "/exit (or Ctrl-D) quits."
)


def _read_lines(
    loop: asyncio.AbstractEventLoop, lines: asyncio.Queue, wanted: threading.Event
) -> None:
    # A daemon thread: a read blocked on the terminal must not keep the process alive. It
    # reads stdin unbuffered: blocked in input(), it would hold the buffer's lock, and the
    # interpreter, exiting on a Ctrl-C at the prompt, would abort for want of that lock.
    stdin = sys.stdin.buffer.raw
    while True:
        wanted.wait()  # prompt only once the previous reply is printed
        wanted.clear()
        print("> ", end="", flush=True)
        data = stdin.readline()
        line = data.decode(errors="replace") if data else None  # b"": end of input
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
            parts: list[str] = []  # the reply as far as it got
            reply = asyncio.create_task(_stream_reply(frontend, history, parts))
            await _unless_ctrl_c(reply)
            if reply.cancelled():
                print("\n(stopped)", flush=True)
                # What was shown stays in the conversation; if nothing was, nor does the line.
                answered = any(parts)
            else:
                answered = reply.result()
            if answered:
                history.append({"role": "assistant", "content": "".join(parts)})
            else:
                history.pop()
    finally:
        receiver.cancel()


async def _unless_ctrl_c(task: asyncio.Task) -> None:
    """Wait for `task`; a Ctrl-C meanwhile cancels it instead of ending the shell."""
    loop = asyncio.get_running_loop()
    previous = signal.getsignal(signal.SIGINT)
    loop.add_signal_handler(signal.SIGINT, task.cancel)
    try:
        await asyncio.wait([task])
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        signal.signal(signal.SIGINT, previous)  # at the prompt, Ctrl-C quits again


async def _stream_reply(
    frontend: Frontend, history: list[dict[str, str]], parts: list[str]
) -> bool:
    """Print the reply as it streams, collecting it in `parts`; False if it failed."""
    msg = TokenizeMsg(
        next(frontend.uids),
        SamplingParams(temperature=0.0, max_tokens=UNLIMITED),
        messages=list(history),
    )
    now = time.perf_counter()
    choice = Choice(msg.uid, 0, started=now, arrived=now)
    try:  # whatever ends the reply early (an error, Ctrl-C) aborts its request
        queue, _ = await frontend.open([msg])
        async for _, delta in frontend.results(queue, [choice]):
            parts.append(delta.text)
            print(delta.text, end="", flush=True)
    except APIError as e:  # a refusal, or a worker's error midway
        if any(parts):
            print()  # the error on a line of its own
        print(f"error: {e.message}", flush=True)
        return False
    print(flush=True)
    return True
