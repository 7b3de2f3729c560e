"""`POST /v1/responses`, for text: the newer OpenAI API that its official client leads with.

A Responses request is a chat in other words: `input` is the user's text or a list of
messages, `instructions` the system message, `max_output_tokens` the limit. So the route
turns it into a `ChatCompletionRequest` and runs it as one, and only the answer's shape is
its own: a `response` object whose `output` holds one assistant message of `output_text`,
or, streamed, typed events (`response.created`, `response.output_text.delta`, ...,
`response.completed`), each an SSE `event:` line and its `data:`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from minisgl.core import SamplingParams
from minisgl.message.frontend import DeltaMsg, RejectedMsg, TokenizeMsg
from minisgl.server.frontend import Choice, Frontend
from minisgl.server.protocol import INT64_END, APIError, ChatCompletionRequest, Text


class InputText(BaseModel):
    type: Literal["input_text", "output_text", "text"]
    text: Text


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[InputText]

    def text(self) -> str:
        parts = self.content
        return parts if isinstance(parts, str) else "".join(p.text for p in parts)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    input: Text | list[InputMessage] = Field(min_length=1)
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1, lt=INT64_END)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False

    def as_chat(self) -> ChatCompletionRequest:
        messages = [] if self.instructions is None else [("system", self.instructions)]
        if isinstance(self.input, str):
            messages.append(("user", self.input))
        else:
            messages += [(m.role, m.text()) for m in self.input]
        return ChatCompletionRequest(
            model=self.model,
            messages=[{"role": r, "content": c} for r, c in messages],
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
        )


class Answer:
    """One response as it grows: its id, its text, and the response object at any time."""

    def __init__(self, body: ResponsesRequest, model: str, uid: int, prompt_tokens: int) -> None:
        self.body, self.model, self.prompt_tokens = body, model, prompt_tokens
        self.id, self.item_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        now = time.perf_counter()
        self.choice = Choice(uid, 0, started=now, arrived=now)
        self.events = 0  # each streamed event's sequence_number

    def part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": "".join(self.choice.text), "annotations": []}

    def item(self, status: str) -> dict[str, Any]:
        content = [] if status == "in_progress" else [self.part()]
        return {
            "type": "message",
            "id": self.item_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def response(self) -> dict[str, Any]:
        reason = self.choice.finish_reason
        status = (
            "in_progress" if reason is None else "incomplete" if reason == "length" else "completed"
        )
        done = status != "in_progress"
        tokens = self.choice.tokens
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": [self.item(status)] if done else [],
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "error": None,
            "instructions": self.body.instructions,
            "max_output_tokens": self.body.max_output_tokens,
            "temperature": self.body.temperature,
            "top_p": self.body.top_p,
            "parallel_tool_calls": False,
            "tool_choice": "none",
            "tools": [],
            "text": {"format": {"type": "text"}},
            "usage": {
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + tokens,
            }
            if done
            else None,
        }

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.events, **fields}
        self.events += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


def add_responses_route(
    app: FastAPI,
    frontend: Frontend,
    model_name: str,
    sampling: Callable[[ChatCompletionRequest, int | None], list[SamplingParams]],
) -> None:
    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest) -> Response:
        try:
            chat = body.as_chat()
        except ValidationError as e:  # the chat request's own checks, past ours
            raise APIError(400, str(e.errors()[0]["msg"])) from None
        msg = TokenizeMsg(
            next(frontend.uids),
            sampling(chat, chat.max_new_tokens())[0],
            messages=chat.plain_messages(),
        )
        queue, prompt_tokens = await frontend.open([msg])
        answer = Answer(body, model_name, msg.uid, prompt_tokens)
        if body.stream:
            events = stream(frontend, queue, answer)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            async for _ in deltas(frontend, queue, answer):
                pass
        finally:
            await close(frontend, answer)
        return JSONResponse(answer.response())


async def deltas(frontend: Frontend, queue: asyncio.Queue, answer: Answer) -> AsyncIterator[str]:
    """The answer's new text, delta by delta, until it finishes."""
    while answer.choice.finish_reason is None:
        delta: DeltaMsg | RejectedMsg | APIError = await queue.get()
        if isinstance(delta, APIError):  # the server failed or stops
            frontend.metrics.failed_requests.inc()
            raise delta
        if isinstance(delta, RejectedMsg):
            frontend.metrics.failed_requests.inc()
            raise APIError(delta.status, delta.message, code=delta.code)
        frontend.record(answer.choice, delta)
        answer.choice.text.append(delta.text)
        yield delta.text


async def close(frontend: Frontend, answer: Answer) -> None:
    unfinished = answer.choice.finish_reason is None
    await frontend.close([answer.choice.uid], abort=unfinished)


async def stream(frontend: Frontend, queue: asyncio.Queue, answer: Answer) -> AsyncIterator[str]:
    where = {"item_id": answer.item_id, "output_index": 0, "content_index": 0}
    empty = {"type": "output_text", "text": "", "annotations": []}
    try:
        yield answer.event("response.created", response=answer.response())
        yield answer.event("response.in_progress", response=answer.response())
        yield answer.event(
            "response.output_item.added", output_index=0, item=answer.item("in_progress")
        )
        yield answer.event("response.content_part.added", **where, part=empty)
        try:
            async for text in deltas(frontend, queue, answer):
                if text:
                    yield answer.event(
                        "response.output_text.delta", **where, delta=text, logprobs=[]
                    )
        except APIError as e:  # too late for a status: an error event
            yield answer.event("error", message=e.message, code=e.code, param=e.param)
            return
        text = "".join(answer.choice.text)
        yield answer.event("response.output_text.done", **where, text=text, logprobs=[])
        yield answer.event("response.content_part.done", **where, part=answer.part())
        status = answer.response()["status"]
        yield answer.event("response.output_item.done", output_index=0, item=answer.item(status))
        final = "response.incomplete" if status == "incomplete" else "response.completed"
        yield answer.event(final, response=answer.response())
    finally:  # a client that hangs up cancels this generator: abort what is left
        await close(frontend, answer)
