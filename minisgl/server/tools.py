"""Tool calling in chat: `tools` and `tool_choice` in, `tool_calls` out, whole or streamed.

The tools go to the model's own chat template, which tells the model how to call them
(the tokenizer worker falls back to the Hermes form for a template that knows no tools).
The answer is searched for calls by the parsers of `tool_parsers.py`. With `tool_choice`
"required" or a named function, the model has no choice: its output is held by the
grammar of chapter 25 to `{"name": ..., "arguments": ...}` for one of the tools, so the
arguments are valid JSON for that function's schema.

A stream sends text as it comes, holding back what may be the start of a call; the calls
go out when the choice finishes, each whole in one delta, as `tool_calls[i]` with an id, a
name and the arguments' JSON text, and the choice's finish_reason is "tool_calls".
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

from minisgl.server.tool_parsers import ToolCall, find_calls, held


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


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON text

    @field_validator("arguments")
    @classmethod
    def _json(cls, v: str) -> str:
        try:
            json.loads(v)
        except json.JSONDecodeError as e:
            raise ValueError(f"the arguments are not JSON text ({e}): {v[:80]!r}") from None
        return v


class AssistantCall(BaseModel):
    """A call in an assistant message the client sends back with the tool's result."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


def check_tools(field: str, value: Any, before: dict[str, Any]) -> Any:
    """The `tools` and `tool_choice` fields, typed and checked against each other."""
    if field == "tools":
        if value is not None and before.get("response_format") is not None:
            raise ValueError("tools and response_format cannot be used together")
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


def call_schema(tools: list[Tool] | None, choice: ToolChoice | None) -> str | None:
    """The JSON schema a forced call must follow ("required" or named); None: not forced."""
    if not tools or choice is None or choice in ("none", "auto"):
        return None
    chosen = [
        t for t in tools if isinstance(choice, str) or t.function.name == choice.function.name
    ]
    forms = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "arguments": t.function.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    return json.dumps(forms[0] if len(forms) == 1 else {"anyOf": forms})


def template_tools(tools: list[Tool] | None, choice: ToolChoice | None) -> list[dict] | None:
    """The tools as chat templates read them; with "none" the model is not told of them."""
    if not active(tools, choice):
        return None
    return [t.model_dump(exclude_none=True) for t in tools or []]


def add_tool_fields(plain: list[dict[str, Any]], messages: list[Any]) -> None:
    """An assistant's calls and a tool result's call id, as chat templates read them: the
    arguments as an object, not JSON text."""
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


def tool_output(tools: list[Tool] | None, choice: ToolChoice | None) -> ToolOutput | None:
    """What finds a request's calls in its answer; None where it cannot call tools."""
    if not active(tools, choice):
        return None
    return ToolOutput(forced=call_schema(tools, choice) is not None)


class ToolOutput:
    """One request's tool calls: found in each choice's text, whole or as it streams."""

    def __init__(self, forced: bool) -> None:
        self.forced = forced  # the output is one JSON call, and nothing else
        self.text: dict[int, str] = {}  # a streamed choice's text so far, by index
        self.sent: dict[int, int] = {}  # and how much of it went out as content

    def calls(self, text: str) -> tuple[str, list[ToolCall]] | None:
        if self.forced:
            try:
                obj = json.loads(text)
                return "", [ToolCall(obj["name"], json.dumps(obj["arguments"]))]
            except (json.JSONDecodeError, KeyError, TypeError):
                return None  # cut short by max_tokens: the text goes out as it is
        return find_calls(text)

    def whole(self, body: dict[str, Any]) -> None:
        """A whole chat choice: its message gets the calls found in its content."""
        message = body["message"]
        if (found := self.calls(message["content"])) is None:
            return
        content, calls = found
        message["content"] = content.strip() or None
        message["tool_calls"] = [_openai(c) for c in calls]
        body["finish_reason"] = "tool_calls"

    def delta(self, index: int, body: dict[str, Any]) -> None:
        """A streamed chat delta: text that cannot be a call goes out; at the end, the calls."""
        delta = body["delta"]
        text = self.text[index] = self.text.get(index, "") + delta.get("content", "")
        sent = self.sent.get(index, 0)
        if body["finish_reason"] is None:
            end = max(sent, 0 if self.forced else held(text))
            delta["content"], self.sent[index] = text[sent:end], end
            return
        if (found := self.calls(text)) is None:
            delta["content"] = text[sent:]
            return
        content = found[0][sent:]
        delta["content"] = content or None
        delta["tool_calls"] = [{"index": i, **_openai(c)} for i, c in enumerate(found[1])]
        body["finish_reason"] = "tool_calls"


def _openai(call: ToolCall) -> dict[str, Any]:
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}
