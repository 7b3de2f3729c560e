"""A streamed answer: server-sent events, one per delta worth sending, then `[DONE]`.

Streaming is an async generator that Starlette drains into the HTTP response. When the
client hangs up, Starlette cancels it; its `finally` then aborts the choices that are
still running, with `send_nowait`, because code that is being cancelled must not wait.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from minisgl.message.frontend import DeltaMsg, RejectedMsg
from minisgl.server.frontend import Choice, Frontend
from minisgl.server.logprobs import echo_choice  # [ch25]
from minisgl.server.protocol import APIError
from minisgl.server.responses import ResponseShape


async def stream(
    frontend: Frontend,
    queue: asyncio.Queue,
    choices: dict[int, Choice],
    shape: ResponseShape,
    prompt_tokens: int,
    usage: bool,
) -> AsyncIterator[str]:
    try:
        if shape.chat:
            for c in choices.values():
                yield shape.event(
                    [shape.chunk_choice(c.index, {"role": "assistant", "content": ""}, None)]
                )
        while any(c.finish_reason is None for c in choices.values()):
            delta: DeltaMsg | RejectedMsg | APIError = await queue.get()
            if isinstance(delta, APIError):  # the server failed or stops: see supervisor.py
                frontend.metrics.failed_requests.inc()
                yield f"data: {json.dumps(delta.body())}\n\n"
                return
            if isinstance(delta, RejectedMsg):  # too late for a status: an error event
                frontend.metrics.failed_requests.inc()
                error = APIError(delta.status, delta.message, code=delta.code)
                yield f"data: {json.dumps(error.body())}\n\n"
                return
            choice = choices[delta.uid]
            frontend.record(choice, delta)
            choice.text.append(delta.text)
            if delta.prompt_text is not None:  # echo: the prompt first, alone  # [ch25]
                yield shape.event([echo_choice(choice, shape.logprobs)])  # [ch25]
            if delta.text or delta.finished or delta.logprob is not None:
                lp = [delta.logprob] if delta.logprob is not None else []
                yield shape.event([shape.delta_choice(choice, delta.text, lp)])
        if usage:
            yield shape.event([], shape.usage(list(choices.values()), prompt_tokens))
        yield "data: [DONE]\n\n"
    finally:  # a client that hangs up cancels this generator: abort what is left
        unfinished = [c.uid for c in choices.values() if c.finish_reason is None]
        await frontend.close(list(choices), abort=False)
        await frontend.close(unfinished, abort=True)
