"""`POST /v1/responses`: the newer OpenAI API that its official client and agent frameworks
lead with.

A Responses request is a chat in other words: `input` is the user's text or a list of items
(messages, the model's earlier reasoning and function calls, and their results: a reasoning
item goes to the template as its assistant message's `reasoning_content`), `instructions` the
system message, `tools` the functions (flat: `name` and `parameters` beside `type`),
`text.format` the response format, `max_output_tokens` the limit. So the route turns it
into a `ChatCompletionRequest` and runs it as one, with chat's grammars and tool parsing;
only the answer has a shape of its own (`responses_output.py`).

With `store` (the default) the server keeps the latest responses in memory (STORED of them),
so that a request can go on from one by its `previous_response_id` (that response's input
and output come before the new input, its instructions do not), and `GET
/v1/responses/{id}` returns it. A field of the API that the server cannot honour (hosted
tools, background runs, conversations) is a 400 naming it, never dropped. A reasoning effort
goes to the template as chat's `reasoning_effort` does; the reasoning comes back whole, as
`reasoning_text`, whatever summary was asked for.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from minisgl.message.frontend import TokenizeMsg
from minisgl.sampling_params import SamplingParams
from minisgl.server.frontend import Frontend
from minisgl.server.protocol import INT64_END, APIError, ChatCompletionRequest, Effort, Text
from minisgl.server.reasoning import Reasoning
from minisgl.server.responses_output import Answer, stream, whole
from minisgl.server.tool_parsers import is_object
from minisgl.server.tools import Function, JsonText

STORED = 1024  # responses kept for previous_response_id, the oldest dropped first


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: Text

    @field_validator("type")
    @classmethod
    def _text_only(cls, v: str) -> str:
        if v not in ("input_text", "output_text", "text"):
            raise ValueError(f"only text content is supported (input_text, output_text), not {v!r}")
        return v


def text_of(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]


class FunctionCallItem(BaseModel):
    """A call the model made, sent back with its result."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: JsonText


class ReasoningText(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["reasoning_text", "summary_text"]
    text: Text


class ReasoningItem(BaseModel):
    """The model's reasoning, sent back before the answer it led to."""

    model_config = ConfigDict(extra="ignore")  # encrypted_content: none is made here

    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None

    def text(self) -> str:
        """The reasoning's text, or its summary's where a client kept only that."""
        return "".join(p.text for p in (self.summary if self.content is None else self.content))


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: str
    output: Text | list[TextPart]


def _item_type(item: Any) -> str:
    return item.get("type", "message") if isinstance(item, dict) else item.type


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(
        _item_type,
        custom_error_type="unsupported_item",
        custom_error_message="input items are messages, reasoning, function_call and"
        " function_call_output; other item types (item_reference, ...) are not supported",
    ),
]


class FunctionTool(Function):
    type: Literal["function"]

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, v: Any) -> Any:
        if isinstance(v, dict) and v.get("type") != "function":
            raise ValueError(f"only function tools are supported, not {v.get('type')!r} tools")
        if isinstance(v, dict) and v.get("parameters", {}) is None:  # null: no arguments
            v = {k: x for k, x in v.items() if k != "parameters"}
        return v


class NamedTool(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError('a format of type "json_schema" needs its schema')
        return self

    def chat(self) -> dict[str, Any] | None:
        """The format as chat's response_format."""
        if self.type != "json_schema":
            return None if self.type == "text" else {"type": self.type}
        named = {"name": self.name or "response", "schema": self.schema_}
        return {"type": "json_schema", "json_schema": named}


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat = TextFormat(type="text")
    verbosity: Literal["low", "medium", "high"] | None = None


# The API's fields that this server cannot honour, with the values that ask for nothing.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "background": (None, False),
    "conversation": (None,),
    "prompt": (None,),
    "include": (None, []),
    "truncation": (None, "disabled"),
    "top_logprobs": (None, 0),
    "max_tool_calls": (None,),
}


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    effort: Effort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # the text comes whole


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    input: Annotated[Text, Field(min_length=1)] | Annotated[list[Item], Field(min_length=1)]
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1, lt=INT64_END)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[FunctionTool] = []
    tool_choice: Literal["none", "auto", "required"] | NamedTool = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = TextConfig()
    reasoning: ReasoningConfig = ReasoningConfig()
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice(cls, v: Any) -> Any:
        if isinstance(v, dict) and v.get("type") != "function":
            allowed = '"none", "auto", "required" or {"type": "function", "name": ...}'
            raise ValueError(f"only {allowed} is supported, not {v.get('type')!r}")
        return v

    def refuse_unsupported(self) -> None:
        for name, fine in UNSUPPORTED.items():
            value = (self.model_extra or {}).get(name)
            if isinstance(value, dict) and all(v is None for v in value.values()):
                continue
            if value not in fine:
                message = f"{name} {value!r} is not supported by this server; leave it out"
                raise APIError(400, message, name)
        if self.text.verbosity not in (None, "medium"):
            raise APIError(400, "text.verbosity is not supported by this server", "text.verbosity")

    def items(self) -> list[Item]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def as_chat(self, history: list[Item]) -> ChatCompletionRequest:
        """The chat request this is: instructions, then the stored turns, then the input."""
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        for item in history + self.items():
            last = messages[-1] if messages else {}
            if isinstance(item, ReasoningItem):  # opens the assistant message it led to
                messages.append({"role": "assistant", "content": "", "reasoning_content": ""})
                messages[-1]["reasoning_content"] = item.text()
            elif isinstance(item, MessageItem) and item.role == "assistant" and thought_only(last):
                last["content"] = text_of(item.content)
            elif isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": text_of(item.content)})
            elif isinstance(item, FunctionCallOutputItem):
                content = text_of(item.output)
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": content})
            else:  # the model's calls, in the assistant message they belong to
                if not messages or messages[-1]["role"] != "assistant":
                    messages.append({"role": "assistant", "content": None})
                function = {"name": item.name, "arguments": item.arguments}
                call = {"id": item.call_id, "type": "function", "function": function}
                messages[-1].setdefault("tool_calls", []).append(call)
        return ChatCompletionRequest(
            model=self.model,
            messages=messages,
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            tools=[{"type": "function", "function": t.model_dump()} for t in self.tools] or None,
            tool_choice=self.chat_tool_choice(),
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=self.text.format.chat(),
            reasoning_effort=self.reasoning.effort,
        )

    def chat_tool_choice(self) -> Any:
        choice = self.tool_choice
        if isinstance(choice, NamedTool):
            return {"type": "function", "function": {"name": choice.name}}
        return None if choice == "auto" and not self.tools else choice


ITEM: TypeAdapter[Item] = TypeAdapter(Item)


def thought_only(message: dict[str, Any]) -> bool:
    """Whether a message is an assistant's reasoning with no answer yet."""
    return "reasoning_content" in message and not message["content"] and "tool_calls" not in message


def resendable(item: dict[str, Any]) -> bool:
    """Whether an output item can go on as input: not a call whose arguments the token limit
    cut short. That call is still the model's answer (in a response "incomplete"); only a
    conversation that goes on from it leaves it out, for no template can render it."""
    return item["type"] != "function_call" or is_object(item["arguments"])


class Store:
    """The latest responses, by id: each with its input and output items, to go on from."""

    def __init__(self, size: int = STORED) -> None:
        self.size = size
        self.responses: OrderedDict[str, tuple[dict[str, Any], list[Item]]] = OrderedDict()

    def put(self, response: dict[str, Any], items: list[Item]) -> None:
        self.responses[response["id"]] = (response, items)
        while len(self.responses) > self.size:
            self.responses.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> tuple[dict[str, Any], list[Item]]:
        if (found := self.responses.get(response_id)) is None:
            message = f"no stored response has the id {response_id!r} (the server keeps"
            message += f" the latest {self.size}, in memory, and only those sent with store)"
            raise APIError(404 if param is None else 400, message, param)
        return found


def add_responses_route(
    app: FastAPI,
    frontend: Frontend,
    model_name: str,
    sampling: Callable[[ChatCompletionRequest, int | None], list[SamplingParams]],
) -> None:
    store = Store()

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest) -> Response:
        body.refuse_unsupported()
        history: list[Item] = []
        if body.previous_response_id is not None:
            history = store.get(body.previous_response_id, "previous_response_id")[1]
        try:
            chat = body.as_chat(history)
        except ValidationError as e:  # the chat request's own checks, past ours
            raise APIError(400, str(e.errors()[0]["msg"]).removeprefix("Value error, ")) from None
        params = sampling(chat, chat.max_new_tokens())[0]
        msg = TokenizeMsg(
            next(frontend.uids),
            params,
            messages=chat.plain_messages(),
            template_vars=chat.template_vars(),
        )
        queue, prompt_tokens = await frontend.open([msg])
        reasoning = None
        if (thinking := frontend.thinking.get(msg.uid)) is not None:  # the template's blocks
            reasoning = Reasoning(opened=thinking[0] == "open", style=thinking[1])
        answer = Answer(body, model_name, msg.uid, prompt_tokens, chat.tool_output(), reasoning)
        if body.stream and params.json_schema is not None:  # a 400 is still possible
            await frontend.started(queue, [msg.uid])

        def keep(response: dict[str, Any]) -> None:
            if body.store:
                output = [
                    ITEM.validate_python(item) for item in response["output"] if resendable(item)
                ]
                store.put(response, history + body.items() + output)

        if body.stream:
            events = stream(frontend, queue, answer, keep)
            return StreamingResponse(events, media_type="text/event-stream")
        response = await whole(frontend, queue, answer)
        keep(response)
        return JSONResponse(response)

    @app.get("/v1/responses/{response_id}")
    async def stored(response_id: str) -> Response:
        return JSONResponse(store.get(response_id)[0])

    @app.delete("/v1/responses/{response_id}")
    async def forget(response_id: str) -> Response:
        store.get(response_id)
        del store.responses[response_id]
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
