"""Tool calling in chat: `tools` and `tool_choice` in, `tool_calls` out, whole or streamed.

The tools go to the model's own chat template, which tells the model how to call them
(the tokenizer worker falls back to the Hermes form for a template that knows no tools).
With `tool_choice` "auto" the model decides, and its answer is searched for calls by the
parsers of `tool_parsers.py`. With "required" or a named function it has no choice: its
output is held by the grammar of chapter 25 (`tool_schema.py`) to calls whose arguments
follow their function's schema. With "auto" and a `response_format`, the grammar lets it
choose between calls and a document of the format.

A stream sends text as it comes, holding back what may be the start of a call; a call goes
out as soon as its name is known, as `tool_calls[i]` with an id, the name and the first of
its arguments, and then its arguments' JSON text in pieces as they are generated. A choice
that ends with calls has the finish_reason "tool_calls" (or "length", cut short).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter

from minisgl.server.response_format import ResponseFormat, format_schema
from minisgl.server.tool_parsers import (
    PARSERS,
    Scan,
    Schemas,
    ToolCall,
    is_object,
    json_end,
    scan_any,
    scan_call_array,
)
from minisgl.server.tool_schema import answer_schema


class Function(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for the name
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    strict: bool | None = None  # a forced call always follows the schema


class Tool(BaseModel):
    type: Literal["function"]
    function: Function


class NamedFunction(BaseModel):
    name: str


class NamedChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedChoice
TOOLS = TypeAdapter(list[Tool])


def _json_text(v: str) -> str:
    try:
        json.loads(v)
    except json.JSONDecodeError as e:
        raise ValueError(f"the arguments are not JSON text ({e}): {v[:80]!r}") from None
    return v


JsonText = Annotated[str, AfterValidator(_json_text)]


class CalledFunction(BaseModel):
    name: str
    arguments: JsonText


class AssistantCall(BaseModel):
    """A call in an assistant message the client sends back with the tool's result."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


def check_tools(which: str, value: Any, before: dict[str, Any]) -> Any:
    """The `tools` and `tool_choice` fields, typed and checked against each other."""
    if which == "tools":
        return None if value is None else TOOLS.validate_python(value)
    if value is None:
        return None
    choice = NamedChoice.model_validate(value) if isinstance(value, dict) else value
    if choice not in ("none", "auto", "required") and not isinstance(choice, NamedChoice):
        raise ValueError('tool_choice is "none", "auto", "required" or a named function')
    tools: list[Tool] = before.get("tools") or []
    if choice != "none" and not tools:
        raise ValueError("tool_choice needs tools to choose from")
    if isinstance(choice, NamedChoice) and choice.function.name not in names(tools):
        raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
    return choice


def names(tools: list[Tool]) -> list[str]:
    return [t.function.name for t in tools]


def active(tools: list[Tool] | None, choice: ToolChoice | None) -> bool:
    return bool(tools) and choice != "none"


def chosen(choice: ToolChoice | None) -> str:
    """ "none", "auto", "required", or the name of the function to call."""
    if isinstance(choice, NamedChoice):
        return choice.function.name
    return choice or "auto"


def answer_grammar(
    tools: list[Tool] | None,
    choice: ToolChoice | None,
    parallel: bool,
    fmt: ResponseFormat | None,
) -> str | None:
    """The JSON schema the answer must follow, as text; None: any text."""
    functions = [(t.function.name, t.function.parameters) for t in tools or []]
    schema = answer_schema(functions, chosen(choice), parallel, format_schema(fmt))
    return None if schema is None else json.dumps(schema)


def template_tools(tools: list[Tool] | None, choice: ToolChoice | None) -> list[dict] | None:
    """The tools as chat templates read them; with "none" the model is not told of them."""
    if not active(tools, choice):
        return None
    return [t.model_dump(exclude_none=True) for t in tools or []]


def add_tool_fields(plain: list[dict[str, Any]], messages: list[Any]) -> None:
    """An assistant's calls, reasoning, and a tool result's call id, as chat templates read
    them: the arguments as an object, not JSON text."""
    for out, m in zip(plain, messages):
        if m.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": json.loads(c.function.arguments),
                    },
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            out["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:  # the template may write it, or leave it out
            out["reasoning_content"] = m.reasoning_content


def tool_output(
    tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool, formatted: bool
) -> ToolOutput | None:
    """What finds a request's calls in its answer; None where it cannot call tools."""
    if not active(tools, choice):
        return None
    if isinstance(choice, NamedChoice):
        return ToolOutput("named", parallel, choice.function.name)
    if choice == "required":
        return ToolOutput("calls", parallel)
    schemas = {t.function.name: t.function.parameters for t in tools or []}
    return ToolOutput("calls_or_json" if formatted else "text", parallel, schemas=schemas)


@dataclass
class CallDelta:
    """A piece of a streamed call: the first has its id and name, the rest only arguments."""

    index: int
    id: str | None
    name: str | None
    arguments: str

    def chat(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclass
class Streamed:
    """What one streamed choice has sent: its text so far, as content and as calls."""

    text: str = ""
    content: int = 0  # characters of the text sent as content
    parser: str | None = None  # the format its calls are in, once one is seen
    calls: list[int] = field(default_factory=list)  # characters of each call's arguments


Form = Literal["text", "named", "calls", "calls_or_json"]


class ToolOutput:
    """One request's tool calls: found in each choice's text, whole or as it streams.

    The answer's form: "text" (the model's own, read by the parsers), "named" (the
    arguments of that function, alone), "calls" (a JSON array of calls), "calls_or_json"
    (that array or a JSON document of the response format)."""

    def __init__(
        self,
        form: Form,
        parallel: bool = True,
        name: str | None = None,
        schemas: Schemas | None = None,
    ) -> None:
        self.form, self.parallel, self.name = form, parallel, name
        self.schemas = schemas or {}  # each function's parameters: how to read text values
        self.streams: dict[int, Streamed] = {}  # by choice index

    def scan(self, text: str, final: bool, sent: Streamed) -> Scan:
        if self.form == "named":
            start = len(text) - len(text.lstrip())
            end = json_end(text, start) if text[start : start + 1] == "{" else None
            return 0, [ToolCall(self.name or "", text[start : end or len(text)], end is not None)]
        if self.form != "text":
            return scan_call_array(text, final)
        if sent.parser is None:
            sent.parser, found = scan_any(text, final, self.schemas)
            return found
        return PARSERS[sent.parser].scan(text, final, self.schemas)

    def split(self, text: str) -> tuple[str, list[ToolCall]] | None:
        """A whole answer's content (the text before the calls) and calls; None: no call."""
        end, calls = self.scan(text, True, Streamed())
        calls = calls if self.parallel else calls[:1]
        if not calls or not all(is_object(c.arguments) for c in calls if c.done):
            return None
        return text[:end], calls

    def stream(self, index: int, text: str, finished: bool) -> tuple[str, list[CallDelta]]:
        """A choice's next piece of text, as content to send and pieces of calls."""
        sent = self.streams.setdefault(index, Streamed())
        sent.text += text
        end, calls = self.scan(sent.text, finished, sent)
        content = sent.text[sent.content : end]
        sent.content = max(sent.content, end)
        pieces = []
        for i, call in enumerate(calls if self.parallel else calls[:1]):
            if i == len(sent.calls):
                sent.calls.append(0)
                pieces.append(CallDelta(i, new_call_id(), call.name, call.arguments))
            elif len(call.arguments) > sent.calls[i]:
                pieces.append(CallDelta(i, None, None, call.arguments[sent.calls[i] :]))
            sent.calls[i] = max(sent.calls[i], len(call.arguments))
        return content, pieces

    def called(self, index: int) -> bool:
        """Whether the streamed choice has sent a call."""
        return bool(self.streams.get(index, Streamed()).calls)

    def whole(self, body: dict[str, Any]) -> None:
        """A whole chat choice: its message gets the calls found in its content."""
        message = body["message"]
        if (found := self.split(message["content"])) is None:
            return
        content, calls = found
        message["content"] = content.strip() or None
        message["tool_calls"] = [openai_call(new_call_id(), c) for c in calls]
        if body["finish_reason"] == "stop":
            body["finish_reason"] = "tool_calls"

    def delta(self, index: int, body: dict[str, Any]) -> None:
        """A streamed chat delta: text that cannot be a call, and the pieces of calls."""
        delta, finished = body["delta"], body["finish_reason"] is not None
        content, calls = self.stream(index, delta.get("content", ""), finished)
        delta["content"] = content or (None if calls else "")
        if calls:
            delta["tool_calls"] = [c.chat() for c in calls]
        if body["finish_reason"] == "stop" and self.called(index):
            body["finish_reason"] = "tool_calls"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_call(call_id: str, call: ToolCall) -> dict[str, Any]:
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": call_id, "type": "function", "function": function}
