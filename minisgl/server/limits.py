"""Request limits: how large one request may be, so that no request can hold up the others.

A request's cost grows with every part a client chooses: the bytes of its body, its prompts
times `n`, its stop strings (each is searched for in every new piece of text), its tools
and schemas (rendered into the prompt, compiled into grammars), its logit bias (one entry
per token on the device). Each has a bound, and going past one is a 400 that names it (a
413 for the body, which is refused before it is read), before the request costs the
workers anything. The bounds are OpenAI's where it states one (`n`, stop strings, tools);
the others are far beyond any real client's use. `max_tokens` is held to the context by the
tokenizer worker, which alone knows the prompt's length (engine/limits.py).

The body is counted here, around the whole app, for the same reason as the API key
(auth.py): a route added later is covered too.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the command line reads this module before the web framework loads
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_REQUEST_BYTES = 8 << 20  # --max-request-bytes: a 128k-token prompt is under 1 MiB of JSON
CLIENT_TIMEOUT_S = 30.0  # --client-timeout: to send a request, or to take a byte of its answer
MAX_PROMPTS = 256  # prompts in one /v1/completions request, and their choices (times n)
MAX_N = 128  # choices of one prompt (OpenAI's)
MAX_STOPS = 4  # stop strings (OpenAI's)
MAX_STOP_CHARS = 256  # in each stop string
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_TOOLS = 128  # tools in one request (OpenAI's)
MAX_SCHEMA_BYTES = 256 << 10  # a response_format's schema, and the tools, as JSON

LIMITS_HELP = (
    f"Each request may have at most {MAX_PROMPTS} prompts (and prompts x n choices),"
    f" n <= {MAX_N}, {MAX_STOPS} stop strings of {MAX_STOP_CHARS} characters,"
    f" {MAX_LOGIT_BIAS} logit_bias entries, {MAX_TOOLS} tools, {MAX_SCHEMA_BYTES >> 10} KiB"
    " of schema (response_format, and the tools together), and max_tokens that fits the"
    " context with the prompt; beyond any of them, a 400 (docs/failures.md)."
)


def add_limit_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=MAX_REQUEST_BYTES,
        help=f"a larger request body is refused with a 413 (default {MAX_REQUEST_BYTES >> 20} MiB)",
    )
    p.add_argument(
        "--client-timeout",
        type=float,
        default=CLIENT_TIMEOUT_S,
        help="seconds a client may take to send its request, or stall reading its answer,"
        " before its connection is cut and its request ended (default %(default)s)",
    )


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets a 413 and is read no further."""

    def __init__(
        self, app: ASGIApp, limit: int, on_refusal: Callable[[], None] = lambda: None
    ) -> None:
        self.app, self.limit, self.on_refusal = app, limit, on_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.limit:
            return await self.refuse(scope, receive, send)
        # Without a length (a chunked body), read it all here, to the limit, and hand it on.
        body, more = [], True
        size = 0
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            body.append(message.get("body", b""))
            size += len(body[-1])
            if size > self.limit:
                return await self.refuse(scope, receive, send)
            more = message.get("more_body", False)
        whole: list[Message] = [
            {"type": "http.request", "body": b"".join(body), "more_body": False}
        ]

        async def replay() -> Message:
            return whole.pop() if whole else await receive()

        await self.app(scope, replay, send)

    async def refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        from starlette.responses import JSONResponse

        from minisgl.server.protocol import APIError  # protocol.py imports this module

        self.on_refusal()
        message = (
            f"the request body is over {self.limit} bytes (--max-request-bytes); send less,"
            " or split it into several requests"
        )
        error = APIError(413, message, code="request_too_large")
        headers = {"Connection": "close"}  # the rest of the body is not read
        await JSONResponse(error.body(), 413, headers)(scope, receive, send)


# >>> ch25 tools and schemas
def check_tools(tools: Any) -> Any:
    """The `tools` of a chat request, as sent: not too many, nor too large together."""
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise ValueError(f"{len(tools)} tools; send at most {MAX_TOOLS}")
    return check_schema_size(tools, "the tools")


def check_schema_size(value: Any, what: str = "the schema") -> Any:
    if value is not None and (size := len(json.dumps(value))) > MAX_SCHEMA_BYTES:
        raise ValueError(f"{what}: {size} bytes as JSON, more than the {MAX_SCHEMA_BYTES} allowed")
    return value


# <<< ch25
