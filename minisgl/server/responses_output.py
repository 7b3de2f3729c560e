"""The Responses API's answer: a `response` object whose `output` is a list of items.

An assistant `message` item holds the text (one `output_text` part); each call the model
makes is a `function_call` item of its own (`call_id`, `name`, `arguments` as JSON text),
after the message if there is text before the calls. A thinking model's reasoning, split
off as chat's `reasoning_content` is (reasoning.py), comes first: a `reasoning` item with
one `reasoning_text` part, its tokens counted in `usage`. Streamed, the answer is OpenAI's
typed events, each an SSE `event:` line and its `data:` with a `sequence_number`:
`response.created` and `.in_progress`; per item `response.output_item.added`, then for a
message `response.content_part.added`, an `output_text.delta` per piece of text (for the
reasoning, `reasoning_text.delta`), and their `.done` events, for a call
`function_call_arguments.delta` per piece of its arguments and `.done`; then
`response.output_item.done`; at last `response.completed` (or `response.incomplete`, cut by
`max_output_tokens`), with the whole response.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

from minisgl.server.frontend import Choice, Frontend
from minisgl.server.protocol import APIError
from minisgl.server.reasoning import Reasoning
from minisgl.server.tools import CallDelta, ToolOutput, new_call_id

if TYPE_CHECKING:
    from minisgl.server.responses_api import ResponsesRequest


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Answer:
    """One response as it grows: its items, and the response object at any time."""

    def __init__(
        self,
        body: ResponsesRequest,
        model: str,
        uid: int,
        prompt_tokens: int,
        tools: ToolOutput | None,
        reasoning: Reasoning | None = None,
    ) -> None:
        self.body, self.model, self.prompt_tokens, self.tools = body, model, prompt_tokens, tools
        self.reasoning = reasoning  # where the template writes think blocks
        self.thought, self.content = "", ""  # the answer's text, split
        self.id, self.created = _id("resp"), int(time.time())
        now = time.perf_counter()
        self.choice = Choice(uid, 0, started=now, arrived=now)
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item a stream is writing
        self.blank = ""  # blank text that opens no message unless more text follows
        self.events = 0  # each streamed event's sequence_number

    @property
    def status(self) -> str:
        reason = self.choice.finish_reason
        if reason is None:
            return "in_progress"
        return "incomplete" if reason == "length" else "completed"

    def response(self) -> dict[str, Any]:
        status, body, tokens = self.status, self.body, self.choice.tokens
        done = status != "in_progress"
        choice = body.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "model": self.model,
            "output": self.items if done else [],
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "error": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": None,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "parallel_tool_calls": body.parallel_tool_calls,
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump() for t in body.tools],
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)},
            "previous_response_id": body.previous_response_id,
            "store": body.store,
            "metadata": body.metadata or {},
            "reasoning": body.reasoning.model_dump(),
            "truncation": "disabled",
            "usage": {
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": self.prompt_tokens + tokens,
            }
            if done
            else None,
        }

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.events, **fields}
        self.events += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """A piece of the answer's text as (reasoning, content); whole answers are split the
        same way, a piece at a time, so that the tokens of the reasoning are counted."""
        if self.reasoning is None:
            self.content += text
            return "", text
        thought, content = self.reasoning.stream(0, text, final, self.choice.tokens)
        self.thought, self.content = self.thought + thought, self.content + content
        return thought, content

    @property
    def reasoning_tokens(self) -> int:
        return self.reasoning.tokens.get(0, 0) if self.reasoning is not None else 0

    # ---- the items, whole --------------------------------------------------------------

    def finish(self) -> None:
        """The items of a whole answer, from its text, split."""
        text = self.content
        found = self.tools.split(text) if self.tools is not None else None
        content, calls = (text, []) if found is None else found
        if self.thought:
            self.items.append(self.thinking_item(self.thought))
        if content.strip() or not (calls or self.thought):
            self.items.append(self.message(content))
        for call in calls:
            self.items.append(self.call(new_call_id(), call.name, call.arguments))
        for item in self.items:
            item["status"] = self.status

    def message(self, text: str) -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": []}
        item = {"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant"}
        return {**item, "content": [part]}

    def thinking_item(self, text: str) -> dict[str, Any]:
        part = {"type": "reasoning_text", "text": text}
        item = {"type": "reasoning", "id": _id("rs"), "summary": [], "status": "in_progress"}
        return {**item, "content": [part]}

    def call(self, call_id: str, name: str, arguments: str) -> dict[str, Any]:
        item = {"type": "function_call", "id": _id("fc"), "call_id": call_id, "name": name}
        return {**item, "arguments": arguments, "status": "in_progress"}

    # ---- the items, streamed -----------------------------------------------------------

    def add(self, item: dict[str, Any]) -> Iterator[str]:
        yield from self.close("completed")
        self.items.append(item)
        self.open = item
        where = len(self.items) - 1
        if item["type"] == "function_call":
            yield self.event("response.output_item.added", output_index=where, item=item)
            return
        part = item["content"][0]
        text, part["text"] = part["text"], ""
        item["content"] = []
        yield self.event("response.output_item.added", output_index=where, item=item)
        item["content"] = [part]
        yield self.event("response.content_part.added", **self.where(), part=part)
        yield from (self.text if item["type"] == "message" else self.thinking)(text)

    def where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1, "content_index": 0}

    def text(self, text: str) -> Iterator[str]:
        """A piece of the message's text; it opens the message if none is open."""
        if self.open is None or self.open["type"] != "message":
            if not (text := self.blank + text).strip():
                self.blank = text
                return
            self.blank = ""
            yield from self.add(self.message(text))
        elif text:
            self.open["content"][0]["text"] += text
            yield self.event("response.output_text.delta", **self.where(), delta=text, logprobs=[])

    def thinking(self, text: str) -> Iterator[str]:
        """A piece of the reasoning; the first opens its item."""
        if self.open is None or self.open["type"] != "reasoning":
            if text:
                yield from self.add(self.thinking_item(text))
        elif text:
            self.open["content"][0]["text"] += text
            yield self.event("response.reasoning_text.delta", **self.where(), delta=text)

    def arguments(self, piece: CallDelta) -> Iterator[str]:
        """A piece of a call: the first opens its item, the others extend its arguments."""
        if piece.id is not None:
            self.blank = ""
            yield from self.add(self.call(piece.id, piece.name or "", ""))
        assert self.open is not None
        if piece.arguments:
            self.open["arguments"] += piece.arguments
            where = {"item_id": self.open["id"], "output_index": len(self.items) - 1}
            kind = "response.function_call_arguments.delta"
            yield self.event(kind, **where, delta=piece.arguments)

    def close(self, status: str) -> Iterator[str]:
        """The `.done` events of the item being written, if any."""
        item, self.open = self.open, None
        if item is None:
            return
        item["status"] = status
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "function_call":
            done = {"name": item["name"], "arguments": item["arguments"]}
            yield self.event("response.function_call_arguments.done", **where, **done)
        elif item["type"] == "reasoning":
            part, at = item["content"][0], {**where, "content_index": 0}
            yield self.event("response.reasoning_text.done", **at, text=part["text"])
            yield self.event("response.content_part.done", **at, part=part)
        else:
            part, at = item["content"][0], {**where, "content_index": 0}
            yield self.event("response.output_text.done", **at, text=part["text"], logprobs=[])
            yield self.event("response.content_part.done", **at, part=part)
        yield self.event("response.output_item.done", output_index=where["output_index"], item=item)


async def whole(frontend: Frontend, queue: asyncio.Queue, answer: Answer) -> dict[str, Any]:
    async for choice, delta in frontend.results(queue, [answer.choice]):
        answer.split(delta.text, choice.finish_reason is not None)
    answer.finish()
    return answer.response()


async def stream(
    frontend: Frontend,
    queue: asyncio.Queue,
    answer: Answer,
    keep: Callable[[dict[str, Any]], None],
) -> AsyncIterator[str]:
    try:
        yield answer.event("response.created", response=answer.response())
        yield answer.event("response.in_progress", response=answer.response())
        async for choice, delta in frontend.results(queue, [answer.choice]):
            finished = choice.finish_reason is not None
            thought, text = answer.split(delta.text, finished)
            for event in answer.thinking(thought):
                yield event
            content, calls = (
                (text, []) if answer.tools is None else answer.tools.stream(0, text, finished)
            )
            for event in answer.text(content):
                yield event
            for piece in calls:
                for event in answer.arguments(piece):
                    yield event
    except APIError as e:  # too late for a status: an error event
        yield answer.event("error", message=e.message, code=e.code, param=e.param)
        return
    finally:  # a client that hangs up cancels this generator, maybe before the loop began
        await frontend.end([answer.choice])
    if not answer.items:  # no text, no call: an empty message still
        for event in answer.add(answer.message(answer.blank)):
            yield event
    for event in answer.close(answer.status):
        yield event
    response = answer.response()
    keep(response)
    final = "response.incomplete" if answer.status == "incomplete" else "response.completed"
    yield answer.event(final, response=response)
