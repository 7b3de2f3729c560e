"""The OpenAI-compatible HTTP API, on FastAPI: the app, its error handlers and its routes.

A route validates the body (`protocol.py`), submits one request per choice through the
`Frontend` (`frontend.py`), and answers with the whole completion or a stream of events
(`streaming.py`), in the shapes of `responses.py`.

Every refusal, ours or the framework's (a body that is not JSON, an unknown path), has
OpenAI's error shape, so that clients written for OpenAI show the message.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from minisgl.message.frontend import TokenizeMsg
from minisgl.sampling_params import SamplingParams
from minisgl.server.frontend import Choice, Frontend
from minisgl.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from minisgl.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    check_model,
)
from minisgl.server.reasoning import Reasoning  # [ch25]
from minisgl.server.responses import ResponseShape
from minisgl.server.responses_api import add_responses_route  # [ch25]
from minisgl.server.streaming import stream


def error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def create_app(
    frontend: Frontend,
    model_name: str,
    healthy: Callable[[], bool],
    vocab_size: int,
    aliases: tuple[str, ...] = (),
    ready: Callable[[], bool] | None = None,  # healthy, and admitting requests
) -> FastAPI:
    app = FastAPI(title="minisgl")

    def refuse(error: APIError, headers: dict[str, str] | None = None) -> Response:
        frontend.metrics.error_responses.labels(str(error.status)).inc()
        return error_response(error, headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return refuse(exc, exc.headers)

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
        return refuse(APIError(500, message, kind="server_error"))

    @app.get("/health")
    async def health() -> Response:
        if healthy():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "a worker process died"}, status_code=503)

    @app.get("/ready")
    async def is_ready() -> Response:
        if (ready or healthy)():
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not admitting requests"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(frontend.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    def card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "minisgl"}

    names = (model_name, *aliases)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card(model_name)]}

    @app.get("/v1/models/{name:path}")  # a model's name may hold slashes: org/model
    async def model(name: str) -> dict[str, Any]:
        check_model(name, names)
        return card(name)

    def sampling(
        body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None
    ) -> list[SamplingParams]:
        """One SamplingParams per choice, after the checks the request models cannot make."""
        check_model(body.model, names)
        for param, ids in body.token_ids().items():
            if outside := [t for t in ids if t >= vocab_size]:
                message = f"token id {outside[0]} is outside the vocabulary [0, {vocab_size})"
                raise APIError(400, f"{param}: {message}", param)
        try:
            return [body.sampling_params(max_tokens, i) for i in range(body.n)]
        except ValueError as e:  # the request models check these ranges first; a last line
            raise APIError(400, str(e)) from None

    add_responses_route(app, frontend, model_name, sampling)  # [ch25]

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Response:
        # A list of prompts is a batch: each prompt's n choices are requests of their own, and
        # choice i*n + j is prompt i's j-th, as OpenAI numbers them.
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
            for prompt in body.prompts()
            for params in sampling(body, body.max_new_tokens())
        ]
        return await respond(body, msgs, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest) -> Response:
        msgs = [
            TokenizeMsg(
                next(frontend.uids),
                params,
                messages=body.plain_messages(),
                template_vars=body.template_vars(),  # [ch25]
                stop=body.stop_strings(),
                skip_special_tokens=body.skip_special_tokens,
            )
            for params in sampling(body, body.max_new_tokens())
        ]
        return await respond(body, msgs, chat=True)

    async def respond(body: Any, msgs: list[TokenizeMsg], chat: bool) -> Response:
        queue, prompt_tokens = await frontend.open(msgs, per_prompt=body.n)
        started = time.perf_counter()
        choices = {
            m.uid: Choice(m.uid, i, started=started, arrived=started) for i, m in enumerate(msgs)
        }
        if body.stream and any(m.sampling_params.json_schema for m in msgs):  # [ch25]
            await frontend.started(queue, list(choices))  # [ch25]
        for c in choices.values():  # [ch25]
            c.full.hidden = body.max_tokens == 0  # [ch25]
        shape = ResponseShape(chat, model_name, body.logprobs)
        shape.tools = body.tool_output() if chat else None  # [ch25]
        thinking = {frontend.thinking.get(m.uid) for m in msgs} - {None}  # [ch25]
        if chat and thinking:  # the template writes think blocks  # [ch25]
            (state, style), *_ = thinking  # [ch25]
            shape.reasoning = Reasoning(opened=state == "open", style=style)  # [ch25]
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            events = stream(frontend, queue, choices, shape, prompt_tokens, usage)
            return StreamingResponse(events, media_type="text/event-stream")
        async for _ in frontend.results(queue, list(choices.values())):
            pass
        return JSONResponse(shape.full(list(choices.values()), prompt_tokens))

    return app
