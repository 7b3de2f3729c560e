"""The OpenAI-compatible HTTP API, on FastAPI.

Each request is sent to the tokenizer worker; its tokens come back as text deltas on one
socket that a background task reads and routes to the waiting handler by request id.

Every refusal, ours or the framework's (a body that is not JSON, an unknown path), has
OpenAI's error shape, so that clients written for OpenAI show the message.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from minisgl.core import SamplingParams
from minisgl.message.backend import AbortMsg, SchedulerStats
from minisgl.message.codec import encode
from minisgl.message.frontend import (
    AcceptedMsg,
    DeltaMsg,
    RejectedMsg,
    TokenizeMsg,
    TokenLogprob,  # [ch25]
)
from minisgl.message.transport import AsyncReader, AsyncWriter, address
from minisgl.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from minisgl.server.metrics import Metrics
from minisgl.server.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (
            status,
            _printable(message),
            None if param is None else _printable(param),
            kind,
            code,
        )

    def body(self) -> dict[str, Any]:
        err = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return {"error": err}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _printable(text: str) -> str:
    # A message may quote the client's input; a lone surrogate in it could not be sent as UTF-8.
    return text.encode("utf-8", "backslashreplace").decode()


@dataclass
class Choice:
    """One of a request's n completions, as it streams in."""

    uid: int
    index: int
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)  # for logprobs
    finish_reason: str | None = None
    started: float | None = None  # its arrival, then its first token's time
    arrived: float | None = None
    # >>> ch25
    details: list[TokenLogprob] = field(default_factory=list)  # per logprob: bytes, alternatives
    offsets: list[int] = field(default_factory=list)  # per logprob: where its text starts
    text_end: int = 0  # the length of the text so far, echo included
    echo: str | None = None  # the prompt, sent back before the completion
    prompt: list[TokenLogprob] = field(default_factory=list)  # and its tokens' logprobs
    hidden: bool = False  # max_tokens 0 with echo: the one token generated is not shown
    # <<< ch25


class Frontend:
    """The API server's end of the pipes to the workers."""

    def __init__(self, ipc_dir: str, kv_pages_total: int = 0) -> None:
        ctx = zmq.asyncio.Context()
        self.to_tokenizer = AsyncWriter(ctx, address(ipc_dir, "tokenizer"))
        self.inbox = AsyncReader(ctx, address(ipc_dir, "api"))
        self.queues: dict[int, asyncio.Queue] = {}
        self.uids = itertools.count()
        self.metrics = Metrics(kv_pages_total)

    async def receive_forever(self) -> None:
        while True:
            msg = await self.inbox.recv()
            if isinstance(msg, SchedulerStats):
                self.metrics.stats = msg
            elif (queue := self.queues.get(msg.uid)) is not None:
                queue.put_nowait(msg)

    async def open(self, msgs: list[TokenizeMsg]) -> tuple[asyncio.Queue, int]:
        """Submit the requests; returns their shared queue and their total prompt tokens."""
        for msg in msgs:
            try:  # the request models let through only what msgpack carries; a last check
                encode(msg)
            except (OverflowError, UnicodeEncodeError) as e:
                raise APIError(400, f"the request cannot be passed on: {e}") from None
        queue: asyncio.Queue = asyncio.Queue()
        uids = [m.uid for m in msgs]
        for msg in msgs:
            self.queues[msg.uid] = queue
            await self.to_tokenizer.send(msg)
        prompt_tokens, refusal, early = 0, None, []
        waiting = set(uids)
        try:
            while waiting:
                reply = await queue.get()
                if isinstance(reply, AcceptedMsg):
                    prompt_tokens = reply.prompt_tokens
                elif isinstance(reply, RejectedMsg):
                    refusal = reply
                else:  # a choice already accepted may produce tokens before the others are
                    early.append(reply)
                    continue
                waiting.discard(reply.uid)
        except asyncio.CancelledError:
            await self.close(uids, abort=True)
            raise
        if refusal is not None:
            await self.close(uids, abort=True)
            param = "messages" if msgs[0].messages else "prompt"
            raise APIError(400, refusal.message, param, code=refusal.code)
        for reply in early + [queue.get_nowait() for _ in range(queue.qsize())]:
            queue.put_nowait(reply)  # back in their order, ahead of what came after
        self.metrics.requests.inc(len(msgs))
        self.metrics.prompt_tokens.inc(prompt_tokens)  # n choices share one prompt
        return queue, prompt_tokens

    async def close(self, uids: list[int], abort: bool) -> None:
        """Stop routing results for these requests; with `abort`, stop computing them too."""
        for uid in uids:
            self.queues.pop(uid, None)
            if abort:
                self.to_tokenizer.send_nowait(AbortMsg(uid))

    def record(self, choice: Choice, delta: DeltaMsg) -> None:
        now = time.perf_counter()
        # >>> ch25
        self.record_echo(choice, delta)
        # <<< ch25
        if delta.token is not None:
            self.metrics.generation_tokens.inc()
            choice.tokens += 1
            choice.token_ids.append(delta.token)
            if delta.logprob is not None:
                choice.logprobs.append(delta.logprob)
                choice.token_texts.append(delta.token_text or "")
                # >>> ch25
                token = delta.token_text or ""
                top = delta.top_logprobs or []
                raw = delta.token_bytes if delta.token_bytes is not None else list(token.encode())
                choice.details.append(TokenLogprob(token, delta.logprob, raw, top))
                choice.offsets.append(choice.text_end)
                choice.text_end += len(token)
                # <<< ch25
            if choice.tokens == 1:
                self.metrics.ttft.observe(now - choice.started)
                choice.started = now
        if delta.finished:
            choice.finish_reason = delta.finish_reason or "stop"
            if choice.tokens > 1:
                self.metrics.tpot.observe((now - choice.started) / (choice.tokens - 1))
            if choice.arrived is not None:
                self.metrics.e2e.observe(now - choice.arrived)

    # >>> ch25
    def record_echo(self, choice: Choice, delta: DeltaMsg) -> None:
        """The prompt, on a choice's first delta; and hide what max_tokens 0 must not show."""
        if delta.prompt_text is not None:
            choice.echo, choice.text_end = delta.prompt_text, len(delta.prompt_text)
        if delta.prompt_logprobs is not None:
            choice.prompt = delta.prompt_logprobs
        if choice.hidden:
            delta.text, delta.token, delta.logprob = "", None, None
            delta.finish_reason = "length"

    # <<< ch25


def create_app(
    frontend: Frontend,
    model_name: str,
    healthy: Callable[[], bool],
    vocab_size: int,
    aliases: tuple[str, ...] = (),
) -> FastAPI:
    app = FastAPI(title="minisgl")

    def refuse(error: APIError, headers: dict[str, str] | None = None) -> Response:
        frontend.metrics.failed_requests.inc()
        return error.response(headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return refuse(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        err = errors[0]
        if err.get("type") == "json_invalid":
            why = err.get("ctx", {}).get("error", err.get("msg"))
            return refuse(APIError(400, f"malformed JSON: {why}"))
        # A union (a prompt is text or token ids) fails once per branch: the branch that took
        # the value's type, but not the value, says best what is wrong.
        wrong_type = ("_type", "_parsing")
        err = next((e for e in errors if not str(e.get("type")).endswith(wrong_type)), err)
        # The path to the bad value, without the names pydantic gives a union's branches.
        loc = [str(x) for x in err.get("loc", []) if isinstance(x, int) or x.isidentifier()]
        param = ".".join(loc[1:] if loc[:1] == ["body"] else loc) or None
        msg = str(err.get("msg")).removeprefix("Value error, ")
        return refuse(APIError(400, f"{param or 'body'}: {msg}", param))

    @app.exception_handler(HTTPException)
    async def _framework_error(request: Request, exc: HTTPException) -> Response:
        # Refusals from FastAPI itself: a body it cannot parse, an unknown path, a wrong method.
        where = f"{request.method} {request.url.path}"
        message = {404: f"no such endpoint: {where}", 405: f"method not allowed: {where}"}.get(
            exc.status_code, str(exc.detail)
        )
        if exc.__cause__ is not None:  # the body is not UTF-8, or is nested too deep, ...
            message = f"{message}: {exc.__cause__}"
        return refuse(APIError(exc.status_code, message), exc.headers)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> Response:
        # Still an error body a client can read; the traceback goes to the log as well.
        message = f"internal error ({type(exc).__name__}); the server log has the details"
        return APIError(500, message, kind="server_error").response()

    @app.get("/health")
    async def health() -> Response:
        if healthy():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "a worker process died"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(frontend.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "minisgl"}
        return {"object": "list", "data": [card]}

    def sampling(
        body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None, logprobs: bool
    ) -> list[SamplingParams]:
        """One SamplingParams per choice, after the checks the request models cannot make."""
        if body.model != model_name and body.model not in aliases:
            raise APIError(
                404,
                f"model {body.model!r} does not exist; this server has {model_name!r}",
                "model",
                code="model_not_found",
            )
        for param, ids in body.token_ids().items():
            if outside := [t for t in ids if t >= vocab_size]:
                message = f"token id {outside[0]} is outside the vocabulary [0, {vocab_size})"
                raise APIError(400, f"{param}: {message}", param)
        try:
            return [body.sampling_params(max_tokens, logprobs, i) for i in range(body.n)]
        except ValueError as e:  # the request models check these ranges first; a last line
            raise APIError(400, str(e)) from None

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prompt = body.prompt
        msgs = [
            TokenizeMsg(
                next(frontend.uids),
                params,
                prompt=prompt if isinstance(prompt, str) else None,
                input_ids=None if isinstance(prompt, str) else list(prompt),
                stop=body.stop_strings(),
                skip_special_tokens=body.skip_special_tokens,
                echo=body.echo,  # [ch25]
            )
            for params in sampling(body, body.max_new_tokens(), body.logprobs is not None)
        ]
        return await respond(request, body, msgs, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        msgs = [
            TokenizeMsg(
                next(frontend.uids),
                params,
                messages=body.plain_messages(),
                stop=body.stop_strings(),
                skip_special_tokens=body.skip_special_tokens,
            )
            for params in sampling(body, body.max_new_tokens(), body.logprobs)
        ]
        return await respond(request, body, msgs, chat=True)

    async def respond(request: Request, body: Any, msgs: list[TokenizeMsg], chat: bool) -> Response:
        queue, prompt_tokens = await frontend.open(msgs)
        started = time.perf_counter()
        choices = {
            m.uid: Choice(m.uid, i, started=started, arrived=started) for i, m in enumerate(msgs)
        }
        for c in choices.values():  # [ch25]
            c.hidden = body.max_tokens == 0  # [ch25]
        shape = _Shape(chat, model_name, body.logprobs)
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            events = stream(queue, choices, shape, prompt_tokens, usage)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            while any(c.finish_reason is None for c in choices.values()):
                delta: DeltaMsg | RejectedMsg = await queue.get()
                if isinstance(delta, RejectedMsg):  # the scheduler's refusal, after ours
                    raise APIError(400, delta.message, code=delta.code)
                choice = choices[delta.uid]
                frontend.record(choice, delta)
                choice.text.append(delta.text)
        finally:
            unfinished = [c.uid for c in choices.values() if c.finish_reason is None]
            await frontend.close(list(choices), abort=False)
            await frontend.close(unfinished, abort=True)
        return JSONResponse(shape.full(list(choices.values()), prompt_tokens))

    async def stream(
        queue: asyncio.Queue,
        choices: dict[int, Choice],
        shape: _Shape,
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
                delta: DeltaMsg | RejectedMsg = await queue.get()
                if isinstance(delta, RejectedMsg):  # too late for a status: an error event
                    frontend.metrics.failed_requests.inc()
                    error = APIError(400, delta.message, code=delta.code)
                    yield f"data: {json.dumps(error.body())}\n\n"
                    return
                choice = choices[delta.uid]
                frontend.record(choice, delta)
                choice.text.append(delta.text)
                # >>> ch25 echo: the prompt first, in a chunk of its own
                if delta.prompt_text is not None:
                    yield shape.event([shape.echo_choice(choice)])
                # <<< ch25
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

    return app


class _Shape:
    """How responses look: completions or chat, whole or streamed."""

    def __init__(self, chat: bool, model: str, logprobs: Any) -> None:
        # Chat asks with `true`; completions with a number, 0 meaning the chosen token's only.
        self.chat, self.model = chat, model
        self.logprobs = logprobs is not None and logprobs is not False
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def usage(self, choices: list[Choice], prompt_tokens: int) -> dict[str, int]:
        completion = sum(c.tokens for c in choices)
        # The n choices share one prompt, counted once (as OpenAI does).
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }

    def _logprobs(self, c: Choice, start: int) -> Any:
        """The logprobs of the choice's tokens from `start` on, in the endpoint's shape."""
        if not self.logprobs:
            return None
        values, tokens = c.logprobs[start:], c.token_texts[start:]
        if self.chat:
            content = [
                {"token": t, "logprob": v, "bytes": list(t.encode()), "top_logprobs": []}
                for t, v in zip(tokens, values)
            ]
            # >>> ch25 each token's own bytes, and the likeliest tokens in its place
            for entry, d in zip(content, c.details[start:]):
                entry["bytes"] = d.bytes
                entry["top_logprobs"] = [
                    {"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in d.top
                ]
            # <<< ch25
            return {"content": content}
        out: dict[str, Any] = {
            "token_logprobs": values,
            "tokens": tokens,
            "top_logprobs": None,
            "text_offset": None,
        }
        # >>> ch25
        out["top_logprobs"] = [_top_dict(d) for d in c.details[start:]]
        out["text_offset"] = c.offsets[start:]
        # <<< ch25
        return out

    # >>> ch25
    def _echo_logprobs(self, c: Choice) -> dict[str, Any]:
        offsets = itertools.accumulate((len(p.token) for p in c.prompt), initial=0)
        return {
            "token_logprobs": [p.logprob for p in c.prompt],
            "tokens": [p.token for p in c.prompt],
            "top_logprobs": [None if p.logprob is None else _top_dict(p) for p in c.prompt],
            "text_offset": list(offsets)[: len(c.prompt)],
        }

    def echo_choice(self, c: Choice) -> dict[str, Any]:
        logprobs = self._echo_logprobs(c) if self.logprobs else None
        return {"index": c.index, "text": c.echo, "finish_reason": None, "logprobs": logprobs}

    # <<< ch25

    def full(self, choices: list[Choice], prompt_tokens: int) -> dict[str, Any]:
        out = []
        for c in sorted(choices, key=lambda c: c.index):
            text = "".join(c.text)
            body: dict[str, Any] = {
                "index": c.index,
                "finish_reason": c.finish_reason,
                "logprobs": self._logprobs(c, 0),
            }
            if self.chat:
                body["message"] = {"role": "assistant", "content": text}
            else:
                body["text"] = text
            # >>> ch25 echo: the prompt first
            if c.echo is not None:
                body["text"] = c.echo + text
                if self.logprobs:
                    echoed = self._echo_logprobs(c)
                    body["logprobs"] = {k: v + body["logprobs"][k] for k, v in echoed.items()}
            # <<< ch25
            out.append(body)
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": out,
            "usage": self.usage(choices, prompt_tokens),
        }

    def chunk_choice(self, index: int, delta: dict[str, Any], finish: str | None) -> dict:
        return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}

    def delta_choice(self, c: Choice, text: str, logprobs: list[float]) -> dict[str, Any]:
        if self.chat:
            body = self.chunk_choice(c.index, {"content": text}, c.finish_reason)
        else:
            body = {"index": c.index, "text": text, "finish_reason": c.finish_reason}
        body["logprobs"] = self._logprobs(c, len(c.logprobs) - len(logprobs))
        return body

    def event(self, choices: list[dict], usage: dict[str, int] | None = None) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        return f"data: {json.dumps(chunk)}\n\n"


# >>> ch25
def _top_dict(t: TokenLogprob) -> dict[str, float | None]:
    """Completions' shape of the alternatives: text -> logprob, the chosen token's included."""
    top: dict[str, float | None] = {alt.token: alt.logprob for alt in t.top}
    top.setdefault(t.token, t.logprob)
    return top


# <<< ch25
