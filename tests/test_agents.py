"""What agent frameworks ask of chapter 25's API, through the official openai client.

pydantic writes a nested model's schema with `$defs` and `$ref`; frameworks send it as a
tool's parameters with a forced choice, together with a `response_format`, or through the
Responses API with function tools, `text.format` and `previous_response_id`, and stream
the calls' arguments as they come. Each answer is checked by the schema's own pydantic
model. SmolLM2-135M decides by itself to call nothing, so where a test needs the model to
choose a call in "auto", a `logit_bias` on "[" (the calls' first character) makes it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from helpers import MODEL, SMOL, TOOLS_CPU, check_error, serving
from pydantic import BaseModel, Field

from minisgl.server.protocol import ChatCompletionRequest
from minisgl.server.tools import ToolOutput
from minisgl.tokenizer.tokenizer import Tokenizer

try:
    import httpx
except ModuleNotFoundError:  # the openai client may come with the httpx2 fork instead
    import httpx2 as httpx


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    with serving(tmp_path_factory.mktemp("agents"), *TOOLS_CPU) as srv:
        yield srv.base


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="none", timeout=300, max_retries=0)


class User(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


class Users(BaseModel):
    users: list[User] = Field(min_length=1, max_length=2)


class Node(BaseModel):  # recursive: its schema refers to itself
    value: int = Field(ge=0, le=9)
    children: list[Node] = Field(max_length=1)


class Level(BaseModel):  # no free text: "[" and "{" can only open the answer
    level: int = Field(ge=1, le=5)


def tool(model: type[BaseModel], name: str | None = None) -> dict[str, Any]:
    schema = model.model_json_schema()
    return {"type": "function", "function": {"name": name or model.__name__, "parameters": schema}}


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


USERS, TREE, LEVEL = tool(Users), tool(Node, "tree"), tool(Level, "set_level")
ASK = [{"role": "user", "content": "Alice is 30 and Bob is 25. List the users."}]


def open_call() -> dict[str, int]:
    """A logit_bias that makes the answer open with "[": a list of calls."""
    (bracket,) = Tokenizer(SMOL).encode("[", add_special_tokens=False)
    return {str(bracket): 100}


def streamed(client: openai.OpenAI, **kw: Any) -> tuple[list[Any], dict[int, dict], str | None]:
    """A chat stream's tool-call deltas, the calls they assemble, and the finish reason."""
    deltas, calls, finish = [], {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                deltas.append(d)
                slot = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                slot["name"] += d.function.name or ""
                slot["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return deltas, calls, finish


# ---- chat --------------------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["named", "required"])
def test_nested_schemas_whole_and_streamed(client, choice):
    assert "$defs" in USERS["function"]["parameters"]  # what the test is about
    kw = {
        "model": MODEL,
        "messages": ASK,
        "tools": [TREE, USERS],
        "tool_choice": named("Users") if choice == "named" else "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 60,
    }
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    (call,) = whole.message.tool_calls
    if choice == "named":
        assert call.function.name == "Users"
    model = Users if call.function.name == "Users" else Node
    model.model_validate_json(call.function.arguments)

    deltas, calls, finish = streamed(client, **kw)
    assert finish == "tool_calls" and list(calls) == [0]
    assert deltas[0].id == calls[0]["id"] and deltas[0].function.name == call.function.name
    assert all(d.id is None and d.function.name is None for d in deltas[1:])  # then arguments
    assert len(deltas) > 5, "the arguments come in pieces, as they are generated"
    assert calls[0]["arguments"] == call.function.arguments


CHAIN = {  # written by hand: the root refers to itself with "#"
    "type": "object",
    "properties": {
        "value": {"type": "integer"},
        "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
    },
    "required": ["value", "next"],
}
PICK = {  # the older `definitions`, and a pointer into the schema's own properties
    "definitions": {"Color": {"enum": ["red", "blue"]}},
    "type": "object",
    "properties": {"a": {"$ref": "#/definitions/Color"}, "b": {"$ref": "#/properties/a"}},
    "required": ["a", "b"],
}
NESTED = [
    (
        "Users",
        Users.model_json_schema(),
        '{"users": [{"name": "Al", "age": 3}]}',
        '{"users": [{"name": 3}]}',
    ),
    (
        "chain",
        CHAIN,
        '{"value": 1, "next": {"value": 2, "next": null}}',
        '{"value": 1, "next": {"next": null}}',
    ),
    ("pick", PICK, '{"a": "red", "b": "blue"}', '{"a": "red", "b": "green"}'),
]


@pytest.fixture(scope="module")
def grammar():
    """A function: the JSON schema's grammar, compiled against SmolLM2's vocabulary, to match."""
    xgrammar = pytest.importorskip("xgrammar")
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(SMOL / "tokenizer.json"))
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, stop_token_ids=[2])
    compiler = xgrammar.GrammarCompiler(info)

    def matches(schema: str, text: str) -> bool:
        matcher = xgrammar.GrammarMatcher(
            compiler.compile_json_schema(schema, any_whitespace=False)
        )
        return matcher.accept_string(text) and matcher.accept_token(2) and matcher.is_terminated()

    return matches


@pytest.mark.parametrize("name,schema,good,bad", NESTED, ids=[n[0] for n in NESTED])
def test_references_resolve_where_the_schema_moved(grammar, name, schema, good, bad):
    """Each choice's grammar, built as a request builds it: a tool's `$ref`s resolve in
    the tool's own parameters, however deep they now sit in the wrapper."""
    tools = [
        tool(Level, "set_level"),
        {"type": "function", "function": {"name": name, "parameters": schema}},
    ]
    fmt = {"type": "json_schema", "json_schema": {"name": "same", "schema": schema}}
    request = {"model": MODEL, "messages": ASK, "tools": tools}

    def answer(**kw: Any) -> str:
        return ChatCompletionRequest(**request, **kw).output_schema() or ""

    assert grammar(answer(tool_choice=named(name)), good)
    assert not grammar(answer(tool_choice=named(name)), bad)
    call = '[{{"name": "{}", "arguments": {}}}]'
    for kw in ({"tool_choice": "required"}, {"response_format": fmt}):
        assert grammar(answer(**kw), call.format(name, good))
        assert not grammar(answer(**kw), call.format(name, bad))
    assert grammar(answer(response_format=fmt), good)  # or a document of the format
    assert not grammar(answer(response_format=fmt), bad)


def test_parallel_tool_calls(client):
    kw = {"model": MODEL, "messages": ASK, "tools": [USERS], "tool_choice": "required"}
    kw |= {"temperature": 0, "max_tokens": 64}
    several = client.chat.completions.create(**kw).choices[0]  # this model repeats its call
    assert len(several.message.tool_calls) > 1
    for c in several.message.tool_calls[:-1]:  # the last one may be cut by max_tokens
        Users.model_validate_json(c.function.arguments)
    one = client.chat.completions.create(**kw, parallel_tool_calls=False).choices[0]
    assert len(one.message.tool_calls) == 1 and one.finish_reason == "tool_calls"
    assert (
        one.message.tool_calls[0].function.arguments
        == several.message.tool_calls[0].function.arguments
    )

    # The model's own text with two calls: one goes out without parallel calls.
    text = (
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
    )
    assert [c.name for c in ToolOutput("text").split(text)[1]] == ["a", "b"]
    assert [c.name for c in ToolOutput("text", parallel=False).split(text)[1]] == ["a"]


FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "Level", "schema": Level.model_json_schema()},
}


def test_tools_with_a_response_format(client):
    kw = {"model": MODEL, "messages": ASK, "tools": [USERS, LEVEL], "response_format": FORMAT}
    kw |= {"temperature": 0, "max_tokens": 60}
    # Left to itself, the model answers in the format.
    free = client.chat.completions.create(**kw).choices[0]
    assert free.message.tool_calls is None and free.finish_reason == "stop"
    Level.model_validate_json(free.message.content)
    # Pushed to open with "[", it calls a tool: the same grammar holds both.
    kw["messages"] = [{"role": "user", "content": "Set the level to 3."}]
    call = client.chat.completions.create(**kw, logit_bias=open_call()).choices[0]
    assert call.finish_reason == "tool_calls" and call.message.content is None
    assert call.message.tool_calls[0].function.name == "set_level"
    Level.model_validate_json(call.message.tool_calls[0].function.arguments)
    deltas, calls, finish = streamed(client, **kw, logit_bias=open_call())
    assert (
        finish == "tool_calls"
        and calls[0]["arguments"] == call.message.tool_calls[0].function.arguments
    )


BAD_SCHEMA = {"type": "objekt"}


@pytest.mark.parametrize("where", ["tool", "response_format"])
def test_a_bad_schema_in_a_stream_is_a_400(client, where):
    if where == "tool":
        bad = {"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}
        kw: dict[str, Any] = {"tools": [bad], "tool_choice": named("f")}
    else:
        kw = {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": BAD_SCHEMA},
            }
        }
    with pytest.raises(openai.BadRequestError, match="the JSON schema cannot be used"):
        client.chat.completions.create(model=MODEL, messages=ASK, stream=True, max_tokens=4, **kw)


# ---- the Responses API -------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
QUESTION = "What is the weather in Paris?"


def test_responses_function_call_and_its_result(client, server):
    first = client.responses.create(
        model=MODEL,
        input=QUESTION,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
    )
    assert first.status == "completed" and first.tool_choice == "required"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and set(json.loads(call.arguments)) == {"city"}
    assert [t.name for t in first.tools] == ["get_weather"]

    # Going on from the stored response, or sending its items back: the same prompt.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}
    kw = {"model": MODEL, "tools": [WEATHER], "temperature": 0, "max_output_tokens": 12}
    stored = client.responses.create(**kw, previous_response_id=first.id, input=[result])
    resent = client.responses.create(
        **kw,
        input=[
            {"role": "user", "content": QUESTION},
            call.model_dump(include={"type", "call_id", "name", "arguments"}),
            result,
        ],
    )
    assert stored.previous_response_id == first.id
    assert stored.usage.input_tokens == resent.usage.input_tokens
    assert stored.output_text == resent.output_text and stored.output[0].type == "message"

    # Stored responses come back by id, and go when deleted.
    got = httpx.get(f"{server}/v1/responses/{first.id}", timeout=30).json()
    assert got["output"][0]["call_id"] == call.call_id
    assert httpx.delete(f"{server}/v1/responses/{first.id}", timeout=30).json()["deleted"]
    body = {"model": MODEL, "input": [result], "previous_response_id": first.id}
    err = check_error(httpx.post(f"{server}/v1/responses", json=body, timeout=30), 400)
    assert err["param"] == "previous_response_id"


def test_responses_streamed_call_events(client):
    kw = {"model": MODEL, "input": QUESTION, "tools": [WEATHER], "temperature": 0}
    kw |= {"tool_choice": {"type": "function", "name": "get_weather"}}
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[2].item.type == "function_call" and events[2].item.name == "get_weather"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 3 and "".join(deltas) == events[-3].arguments == whole.output[0].arguments
    assert events[-1].response.output[0].arguments == whole.output[0].arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_text_format(client):
    out = client.responses.parse(
        model=MODEL, input=ASK[0]["content"], text_format=Users, temperature=0, max_output_tokens=60
    )
    assert out.text.format.type == "json_schema"
    assert isinstance(out.output_parsed, Users)
    with client.responses.stream(
        model=MODEL,
        input="Give a JSON object with one key.",
        text={"format": {"type": "json_object"}},
        temperature=0,
        max_output_tokens=40,
    ) as events:
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        final = events.get_final_response()
    assert isinstance(json.loads(text), dict) and final.output_text == text


UNSUPPORTED = [
    ("empty-input", {"input": ""}, "input"),
    ("hosted-tool", {"tools": [{"type": "web_search"}]}, "tools.0"),
    ("background", {"background": True}, "background"),
    ("effort-no-knob", {"reasoning": {"effort": "high"}}, "reads no reasoning effort"),
    ("effort-unknown", {"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ("conversation", {"conversation": "conv_1"}, "conversation"),
    ("truncation-auto", {"truncation": "auto"}, "truncation"),
    ("include", {"include": ["message.output_text.logprobs"]}, "include"),
    ("unknown-previous", {"previous_response_id": "resp_none"}, "previous_response_id"),
    ("item-reference", {"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
    ("image", {"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "only text"),
    ("hosted-choice", {"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
]


@pytest.mark.parametrize(
    "extra,param", [u[1:] for u in UNSUPPORTED], ids=[u[0] for u in UNSUPPORTED]
)
def test_responses_refuse_what_they_cannot_honour(server, extra, param):
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 1, **extra}
    err = check_error(httpx.post(f"{server}/v1/responses", json=body, timeout=30), 400)
    assert err["param"] == param or param in err["message"], err


def test_responses_bad_schema_in_a_stream_is_a_400(client):
    fmt = {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}
    with pytest.raises(openai.BadRequestError, match="the JSON schema cannot be used"):
        client.responses.create(model=MODEL, input=QUESTION, text={"format": fmt}, stream=True)
