"""A streamed answer: server-sent events, one per delta worth sending, then `[DONE]`.

Streaming is an async generator that Starlette drains into the HTTP response; the deltas
come from the frontend's one results loop. When the client hangs up, Starlette cancels
it; a `finally` (the loop's, or the stream's own before the first delta) then aborts the
choices that are still running, with `send_nowait`, because code that is being cancelled
must not wait.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

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
        async for choice, delta in frontend.results(queue, list(choices.values())):
            if delta.prompt_text is not None:  # echo: the prompt first, alone  # [ch25]
                yield shape.event([echo_choice(choice, shape.logprobs)])  # [ch25]
            if delta.text or delta.finished or delta.logprob is not None:
                lp = [delta.logprob] if delta.logprob is not None else []
                yield shape.event([shape.delta_choice(choice, delta.text, lp)])
    except APIError as e:  # too late for a status: an error event
        yield f"data: {json.dumps(e.body())}\n\n"
    else:
        if usage:
            yield shape.event([], shape.usage(list(choices.values()), prompt_tokens))
        yield "data: [DONE]\n\n"
    finally:  # a client that hangs up cancels this generator, maybe before the loop began
        await frontend.end(list(choices.values()))
