"""Chapter 25's rest of the API, through the official openai client on a live server.

Tool calling in chat: the parsers on model outputs, calls forced by the grammar whose
arguments follow the schema, the client's round trip (whole and streamed), and a
conversation that sends a tool's result back. Then `POST /v1/responses`: the same answer
as the chat endpoint's, whole and as typed events.

SmolLM2's chat template knows no tools, so the tokenizer worker writes them in the Hermes
form (`tokenizer/tools.py`); the 135M model does not call a tool on its own, so the calls
here are forced ("required" or a named function), and the free ("auto") path is tested on
recorded outputs and on SmolLM2's own answer that opens a `<tool_call>` and writes prose.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from helpers import MODEL, SMOL, TOOLS_CPU, check_error, httpx, serving

from minisgl.server.tool_parsers import ToolCall, find_calls
from minisgl.server.tools import ToolOutput
from minisgl.tokenizer.tokenizer import Tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city for the next days",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string"}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    with serving(tmp_path_factory.mktemp("ch25"), *TOOLS_CPU) as srv:
        yield srv.base


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="none", timeout=300, max_retries=0)


def follows_weather_schema(arguments: str) -> bool:
    args = json.loads(arguments)
    return (
        set(args) == {"city", "unit", "days"}
        and isinstance(args["city"], str)
        and args["unit"] in ("celsius", "fahrenheit")
        and type(args["days"]) is int
        and 1 <= args["days"] <= 7
    )


# ---- parsers ------------------------------------------------------------------------------

RECORDED: list[tuple[str, str, tuple[str, list[ToolCall]] | None]] = [
    (  # Qwen 2.5 and Qwen 3, as their templates teach: Hermes blocks, two calls
        "qwen-two-calls",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
        (
            "",
            [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("get_time", '{"zone": "CET"}')],
        ),
    ),
    (  # text before the call, and a call cut at EOS before its closing tag
        "hermes-text-then-unclosed",
        'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}',
        ("Let me look.\n", [ToolCall("get_time", '{"zone": "UTC"}')]),
    ),
    (  # Llama 3.1-3.3's JSON form (<|python_tag|> is dropped when detokenized), two calls
        "llama3-json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {"zone": "CET"}}',
        (
            "",
            [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("get_time", '{"zone": "CET"}')],
        ),
    ),
    (  # SmolLM2-135M, greedy, asked '<tool_call>' with a tool: it opens a block, writes prose
        "smollm2-prose-in-a-block",
        "<tool_call>\n\nThe function is a simple function that takes a function as an argument",
        None,
    ),
    (  # SmolLM2-135M, greedy, asked for the weather with a tool: it answers in text
        "smollm2-text",
        "The weather in Paris is described as a mix of warm and cool.",
        None,
    ),
    (  # Qwen3.5 and Qwen3-Coder, as their templates teach: XML blocks, values as text (no
        # schema here: strings)
        "qwen3.5-xml-two-calls",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n"
        "</tool_call>",
        (
            "",
            [
                ToolCall("get_weather", '{"city": "Paris", "days": "3"}'),
                ToolCall("get_time", '{"zone": "CET"}'),
            ],
        ),
    ),
    (  # text before the call; the text ends after a closed parameter: the call closes there
        "xml-text-then-unclosed",
        "Let me look.\n<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n",
        ("Let me look.\n", [ToolCall("get_time", '{"zone": "UTC"}')]),
    ),
    (  # Gemma 4, as its template teaches: bare keys, <|"|> quote marks, calls back to back
        "gemma4-two-calls",
        'Sure.<|tool_call>call:get_weather{city:<|"|>Paris, "FR"<|"|>,days:3,'
        'opts:{metric:true,tags:[<|"|>a<|"|>,2],none:null}}<tool_call|>'
        '<|tool_call>call:get_time{zone:<|"|>CET<|"|>}<tool_call|>',
        (
            "Sure.",
            [
                ToolCall(
                    "get_weather",
                    '{"city": "Paris, \\"FR\\"", "days": 3, '
                    '"opts": {"metric": true, "tags": ["a", 2], "none": null}}',
                ),
                ToolCall("get_time", '{"zone": "CET"}'),
            ],
        ),
    ),
    ("gemma4-not-a-value", "<|tool_call>call:f{a:<b}<tool_call|>", None),
    ("json-but-no-call", '{"city": "Paris"}', None),
    ("arguments-not-an-object", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', None),
]


@pytest.mark.parametrize("text,expected", [r[1:] for r in RECORDED], ids=[r[0] for r in RECORDED])
def test_parsers_on_recorded_outputs(text, expected):
    assert find_calls(text) == expected


XML_WEATHER = {  # the parameters' schema, as a request's tools give it
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
        "ratio": {"type": ["number", "null"]},
        "where": {"type": "object"},
        "tags": {"type": "array"},
        "zip": {"type": "string"},
    },
}


def test_xml_values_are_read_as_their_schema_types():
    """Qwen3.5's values are text: each is read as its parameter's type, and stays a string
    where the schema says so (a zip code of digits) or where it does not parse."""
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan José\nCA\n</parameter>\n"
        "<parameter=days>\n 3 \n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
        "<parameter=ratio>\nnull\n</parameter>\n<parameter=where>\n"
        '{"lat": 1.5}\n</parameter>\n<parameter=tags>\n[1, "a"]\n</parameter>\n'
        "<parameter=zip>\n02139\n</parameter>\n<parameter=extra>\n7\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    content, calls = find_calls(text, {"get_weather": XML_WEATHER})
    assert content == "" and [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {
        "city": "San José\nCA",  # a value of two lines
        "days": 3,
        "metric": True,
        "ratio": None,
        "where": {"lat": 1.5},
        "tags": [1, "a"],
        "zip": "02139",
        "extra": "7",  # not in the schema: a string
    }
    bad = text.replace("\n 3 \n", "\nthree\n")  # not an integer: the text as it is
    found = find_calls(bad, {"get_weather": XML_WEATHER})
    assert found is not None and json.loads(found[1][0].arguments)["days"] == "three"


def test_an_xml_call_streams_a_parameter_at_a_time():
    """Its name goes out once read, then the arguments' JSON grows as each parameter closes;
    the pieces add up to the whole answer's arguments."""
    out = ToolOutput("text", schemas={"get_weather": XML_WEATHER})
    pieces = ["Checking", ".\n<tool", "_call>\n<function=get_", "weather>\n<parameter=ci",
              "ty>\nParis\n</param", "eter>\n<parameter=days>\n2", "\n</parameter>\n</fun",
              "ction>\n</tool_call>"]  # fmt: skip
    sent = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        body = {"index": 0, "delta": {"content": piece}, "finish_reason": "stop" if last else None}
        out.delta(0, body)
        sent.append(body)
    assert "".join(b["delta"]["content"] or "" for b in sent) == "Checking.\n"
    deltas = [c for b in sent for c in b["delta"].get("tool_calls", [])]
    assert deltas[0]["function"]["name"] == "get_weather" and deltas[0]["id"].startswith("call_")
    grown = [d["function"]["arguments"] for d in deltas]
    assert grown == ["{", '"city": "Paris"', ', "days": 2', "}"]
    assert sent[-1]["finish_reason"] == "tool_calls"
    whole = ToolOutput("text", schemas={"get_weather": XML_WEATHER}).split("".join(pieces))
    assert whole is not None and whole[1][0].arguments == "".join(grown)


def test_a_gemma4_call_streams_alike_however_the_text_is_cut():
    """Its name goes out once read, its arguments when its braces close; cut into pieces of
    1 to 7 characters (tags and quote marks split), the stream sends the same."""
    text = RECORDED[[r[0] for r in RECORDED].index("gemma4-two-calls")][1]
    want = find_calls(text)
    assert want is not None
    for size in (1, 3, 7):
        out, sent = ToolOutput("text"), []
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            body = {
                "index": 0,
                "delta": {"content": piece},
                "finish_reason": "stop" if last else None,
            }
            out.delta(0, body)
            sent.append(body)
        assert "".join(b["delta"]["content"] or "" for b in sent) == want[0]
        deltas = [c for b in sent for c in b["delta"].get("tool_calls", [])]
        names = [d["function"]["name"] for d in deltas if "id" in d]
        assert names == [c.name for c in want[1]]
        for i, call in enumerate(want[1]):
            assert (
                "".join(d["function"]["arguments"] for d in deltas if d["index"] == i)
                == call.arguments
            )
        assert sent[-1]["finish_reason"] == "tool_calls"


def test_gemma4_call_markers_stay_in_the_text(tmp_path):
    """Gemma 4's call markers, quote marks and thought channel are special tokens: where the
    chat template writes them, decoding keeps them (and only them) for the parsers to read."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Rust

    from minisgl.core import SamplingParams
    from minisgl.message.frontend import TokenizeMsg
    from minisgl.tokenizer.detokenizer import IncrementalDetokenizer
    from minisgl.tokenizer.worker import thinking_of

    marks = ["<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>", "<channel|>"]
    rust = Rust.from_file(str(SMOL / "tokenizer.json"))
    rust.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in marks])
    rust.save(str(tmp_path / "tokenizer.json"))
    config = json.loads((SMOL / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        config["chat_template"]
        + "{# <|channel>thought ... <channel|> #}"
        + '{# answers call tools as <|tool_call>call:NAME{key:<|"|>text<|"|>}<tool_call|> #}'
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(str(tmp_path))
    answer = (
        '<|channel>thought\nhm<channel|><|tool_call>call:get_time{zone:<|"|>CET<|"|>}'
        "<tool_call|><|im_end|>"
    )
    ids = tok.encode(answer, add_special_tokens=False)
    assert tok.decode(ids) == answer.removesuffix("<|im_end|>")  # other specials still go
    detok = IncrementalDetokenizer(tok, [], [])
    assert "".join(detok.add(i) for i in ids) + detok.finish() == answer.removesuffix("<|im_end|>")
    plain = Tokenizer(str(SMOL))  # a template without them: every special token skipped
    assert not plain.kept_ids
    # and a chat's answer is split at the thought channel (server/reasoning.py)
    chat = TokenizeMsg(0, SamplingParams(), messages=[{"role": "user", "content": "Hi"}])
    ids = tok.encode(tok.apply_chat_template(chat.messages), add_special_tokens=False)
    assert thinking_of(tok, chat, ids) == ("may", "channel")
    assert thinking_of(plain, chat, ids) == (None, "think")


def test_a_stream_holds_back_what_may_be_a_call():
    out = ToolOutput("text")
    sent = []
    pieces = [
        "Sure",
        ", <tool",
        '_call>\n{"name": "get_time", ',
        '"arguments": {"zo',
        'ne": "UTC"}}',
    ]
    for piece in pieces + ["\n</tool_call>"]:
        last = piece == "\n</tool_call>"
        body = {"index": 0, "delta": {"content": piece}, "finish_reason": "stop" if last else None}
        out.delta(0, body)
        sent.append(body)
    assert "".join(b["delta"]["content"] or "" for b in sent) == "Sure, "
    assert sent[1]["delta"]["content"] == ", "  # "<tool" waits: it may be the tag's start
    assert "tool_calls" not in sent[2]["delta"]  # the name is there, its arguments are not
    first, rest = sent[3]["delta"]["tool_calls"], sent[4]["delta"]["tool_calls"]
    assert first == [
        {
            "index": 0,
            "id": first[0]["id"],
            "type": "function",
            "function": {"name": "get_time", "arguments": '{"zo'},
        }
    ]
    assert first[0]["id"].startswith("call_")
    assert rest == [{"index": 0, "function": {"arguments": 'ne": "UTC"}'}}]  # as generated
    assert sent[-1]["finish_reason"] == "tool_calls"


# ---- a live server ------------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_follow_the_schema(client, choice):
    # Sampled at temperature 1, so that the grammar, not luck, keeps the arguments valid.
    out = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[TIME, WEATHER] if choice == "named" else [WEATHER],
        tool_choice=NAMED if choice == "named" else "required",
        parallel_tool_calls=False,  # one call: left free, this small model repeats its call
        n=3,
        seed=7,
        max_tokens=48,
    )
    for c in out.choices:
        assert c.finish_reason == "tool_calls", c
        assert c.message.content is None
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"
        assert follows_weather_schema(call.function.arguments), call.function.arguments


def test_openai_client_round_trip_whole_and_streamed(client):
    ask = {"model": MODEL, "messages": ASK, "tools": [WEATHER, TIME], "temperature": 0}
    whole = client.chat.completions.create(**ask, tool_choice=NAMED, max_tokens=60)
    (call,) = whole.choices[0].message.tool_calls
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in client.chat.completions.create(
        **ask, tool_choice=NAMED, max_tokens=60, stream=True
    ):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:  # the way clients assemble streamed calls
                slot = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = d.id or slot["id"]
                slot["name"] += d.function.name or ""
                slot["arguments"] += d.function.arguments or ""
            assert not c.delta.content, "a forced call sends no text"
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["id"].startswith("call_")
    assert (calls[0]["name"], calls[0]["arguments"]) == (
        call.function.name,
        call.function.arguments,
    )
    assert follows_weather_schema(call.function.arguments)


def test_a_conversation_with_a_tool_result(client, server):
    first = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
    )
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),  # as the client sends it back
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=24
    )
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].message.content

    # The prompt holds the call and the result, as the worker renders them.
    tok = Tokenizer(SMOL)
    plain = [
        ASK[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": json.loads(call.function.arguments),
                    },
                }
            ],
        },  # fmt: skip
        {"role": "tool", "content": "18 degrees and sunny", "tool_call_id": call.id},
    ]
    prompt = tok.apply_chat_template(plain, tools=[WEATHER])
    assert '<tool_call>\n{"name": "get_weather"' in prompt
    assert "<tool_response>\n18 degrees and sunny\n</tool_response>" in prompt
    assert out.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))


def test_auto_gives_text_when_there_is_no_call(client):
    # The recorded answer above: a block opens, the stream holds it back, no call comes.
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    ask = [{"role": "user", "content": "<tool_call>"}]
    kw = {"model": MODEL, "messages": ask, "tools": [tool], "temperature": 0, "max_tokens": 16}
    whole = client.chat.completions.create(**kw)
    text = whole.choices[0].message.content
    assert text.startswith("<tool_call>") and whole.choices[0].message.tool_calls is None
    assert whole.choices[0].finish_reason == "length"
    streamed = "".join(
        c.delta.content or ""
        for chunk in client.chat.completions.create(**kw, stream=True)
        for c in chunk.choices
    )
    assert streamed == text


BAD_TOOLS = [
    ("named-not-in-tools", {"tools": [TIME], "tool_choice": NAMED}, "tool_choice"),
    ("choice-without-tools", {"tool_choice": "required"}, "tool_choice"),
    ("no-name", {"tools": [{"type": "function", "function": {}}]}, "tools.0.function.name"),
    ("functions", {"functions": [TIME["function"]]}, "functions"),
    (
        "arguments-not-json",
        {
            "messages": [
                *ASK,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}
                    ],
                },  # fmt: skip
            ]
        },
        "messages.1.tool_calls.0.function.arguments",
    ),
]


@pytest.mark.parametrize("extra,param", [b[1:] for b in BAD_TOOLS], ids=[b[0] for b in BAD_TOOLS])
def test_bad_tool_requests_are_400s(server, extra, param):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 1, **extra}
    err = check_error(httpx.post(server + "/v1/chat/completions", json=body, timeout=60), 400)
    assert err["param"] == param, err


# ---- /v1/responses ------------------------------------------------------------------------

QUESTION = "What is the capital of France?"


def test_responses_match_chat(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=12
    )
    out = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=12)
    assert out.object == "response" and out.id.startswith("resp_")
    assert out.output_text == chat.choices[0].message.content
    assert out.status == "completed" and chat.choices[0].finish_reason == "stop"
    assert out.usage.input_tokens == chat.usage.prompt_tokens
    assert out.usage.output_tokens == chat.usage.completion_tokens
    (item,) = out.output
    assert item.type == "message" and item.role == "assistant"
    assert item.content[0].type == "output_text"


def test_responses_stream_with_instructions(client):
    ask = [{"role": "user", "content": QUESTION}]
    system = "Answer in one sentence."
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, *ask],
        temperature=0,
        max_tokens=12,
    )
    kw = {"model": MODEL, "input": ask, "instructions": system, "temperature": 0}
    with client.responses.stream(**kw, max_output_tokens=12) as events:
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        final = events.get_final_response()
    assert "".join(deltas) == final.output_text == chat.choices[0].message.content
    assert final.usage.input_tokens == chat.usage.prompt_tokens

    # Cut by max_output_tokens: the last event says the response is incomplete, and why.
    kinds = [e for e in client.responses.create(**kw, max_output_tokens=2, stream=True)]
    assert [e.sequence_number for e in kinds] == list(range(len(kinds)))
    assert kinds[0].type == "response.created" and kinds[-1].type == "response.incomplete"
    assert kinds[-1].response.incomplete_details.reason == "max_output_tokens"
    assert kinds[-1].response.usage.output_tokens == 2


def test_responses_unknown_model_is_a_404(server):
    body = {"model": "no-such-model", "input": QUESTION}
    err = check_error(httpx.post(server + "/v1/responses", json=body, timeout=60), 404)
    assert err["code"] == "model_not_found"


# ---- a call cut by the token limit: the model's answer, incomplete, never a server error ----

CUT = 3  # tokens: the forced call stops inside its arguments, at about '{"city'


def test_a_chat_call_cut_by_max_tokens_ends_with_length(client):
    kw = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "tool_choice": NAMED}
    whole = client.chat.completions.create(**kw, temperature=0, max_tokens=CUT)
    (choice,) = whole.choices
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == CUT
    for call in choice.message.tool_calls or []:  # the partial call, or none
        assert call.function.name == "get_weather" and not is_json(call.function.arguments)

    arguments, finish = "", None
    for chunk in client.chat.completions.create(**kw, temperature=0, max_tokens=CUT, stream=True):
        for c in chunk.choices:
            arguments += "".join(d.function.arguments or "" for d in c.delta.tool_calls or [])
            finish = c.finish_reason or finish
    assert finish == "length"
    assert arguments == "".join(c.function.arguments for c in choice.message.tool_calls or [])


def test_a_response_cut_inside_a_call_is_incomplete(client, server):
    kw = {"model": MODEL, "input": QUESTION, "tools": [WEATHER["function"] | {"type": "function"}]}
    kw |= {"tool_choice": {"type": "function", "name": "get_weather"}, "temperature": 0}
    out = client.responses.create(**kw, max_output_tokens=CUT)
    assert out.status == "incomplete", out
    assert out.incomplete_details.reason == "max_output_tokens"
    (call,) = out.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.arguments and not is_json(call.arguments)
    stored = httpx.get(f"{server}/v1/responses/{out.id}", timeout=30).json()
    assert stored["status"] == "incomplete" and stored["output"][0]["arguments"] == call.arguments

    events = list(client.responses.create(**kw, max_output_tokens=CUT, stream=True))
    assert events[-1].type == "response.incomplete", events[-1]
    final = events[-1].response
    assert final.incomplete_details.reason == "max_output_tokens"
    assert [i.arguments for i in final.output] == [call.arguments]
    assert final.output[0].status == "incomplete"


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


# ---- lists of prompts, scored ---------------------------------------------------------------


def test_a_list_with_logprobs_and_echo_scores_each_prompt(server):
    # lm-eval's loglikelihood with --batch_size > 1: echo, logprobs, max_tokens 0, a batch.
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 0}
    batch = httpx.post(server + "/v1/completions", json=body, timeout=120).json()
    for i, prompt in enumerate(prompts):
        one = {**body, "prompt": prompt}
        single = httpx.post(server + "/v1/completions", json=one, timeout=120).json()
        got, want = batch["choices"][i], single["choices"][0]
        assert got["index"] == i and got["text"] == want["text"] == prompt
        assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        lp, ref = got["logprobs"]["token_logprobs"][1:], want["logprobs"]["token_logprobs"][1:]
        assert max(abs(a - b) for a, b in zip(lp, ref)) < 1e-4


# ---- a thinking model's reasoning, apart ----------------------------------------------------

# ChatML whose generation prompt opens a think block, as Qwen3.5's does, unless the request
# says `enable_thinking: false` (Qwen3.5's then writes an empty block, after which SmolLM2
# ends at once; here the block is left to the model, which never opens one).
THINK_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if not (enable_thinking is defined and enable_thinking is false) %}<think>\n{% endif %}"
    "{%- endif %}{# </think> closes it #}"
)


def test_reasoning_splits_alike_whole_and_streamed():
    """Qwen3's form (the model opens the block) and Qwen3.5's (the prompt did), tags cut
    between pieces, an answer without a block, and one cut short inside it."""
    from minisgl.server.reasoning import Reasoning

    cases = [
        (False, ["<thi", "nk>\nLet me", " think.</th", "ink>\n\n", "Paris", "."],
         ("Let me think.", "Paris.")),
        (True, ["Let me", " think.\n</th", "ink>", "\n\nParis."], ("Let me think.\n", "Paris.")),
        (False, ["Paris", " is."], ("", "Paris is.")),
        (False, ["<", "b>bold"], ("", "<b>bold")),
        (True, ["cut short </thi"], ("cut short </thi", "")),
    ]  # fmt: skip
    gemma = (["<|chan", "nel>thought\nI see", ".<chan", "nel|>Paris"], ("I see.", "Paris"))
    styles = ["think"] * len(cases) + ["channel"]  # Gemma 4's thought channel
    cases.append((False, *gemma))
    thinking = [4, 3, 0, 0, 1, 4]  # the pieces up to the one that closes the block
    for (opened, pieces, want), style, count in zip(cases, styles, thinking):
        split = Reasoning(opened, style)
        got = [split.stream(0, p, i == len(pieces) - 1, i + 1) for i, p in enumerate(pieces)]
        assert ("".join(r for r, _ in got), "".join(c for _, c in got)) == want, pieces
        assert Reasoning(opened, style).whole("".join(pieces)) == want
        whole = Reasoning(opened, style)
        assert whole.whole(pieces, 0, len(pieces)) == want
        assert split.tokens.get(0, 0) == whole.tokens.get(0, 0) == count, pieces


@pytest.fixture(scope="module")
def thinking(tmp_path_factory) -> Iterator[openai.OpenAI]:
    """SmolLM2's weights with a chat template that writes think blocks."""
    folder = tmp_path_factory.mktemp("think_model")
    for f in SMOL.iterdir():
        if f.name != "tokenizer_config.json":
            (folder / f.name).symlink_to(f.resolve())
    config = json.loads((SMOL / "tokenizer_config.json").read_text())
    config = {**config, "chat_template": THINK_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    args = (*TOOLS_CPU, "--served-model-name", "m")
    with serving(tmp_path_factory.mktemp("think"), *args, model=folder) as srv:
        yield openai.OpenAI(base_url=srv.base + "/v1", api_key="none", timeout=300, max_retries=0)


def test_a_thinking_answer_has_its_reasoning_apart(thinking):
    """The template opened a think block and the 135M model never closes it: its whole
    answer is reasoning, whole or streamed alike; with `enable_thinking: false` in
    `chat_template_kwargs` the prompt opens none and the answer is content."""
    ask = {"model": "m", "messages": ASK, "temperature": 0, "max_tokens": 12}
    answer = thinking.chat.completions.create(**ask)
    whole = answer.choices[0].message
    reasoning = whole.model_extra.get("reasoning_content")
    assert reasoning and whole.content == ""
    tokens = answer.usage.completion_tokens
    assert answer.usage.completion_tokens_details.reasoning_tokens == tokens
    usage = {"stream_options": {"include_usage": True}}
    chunks = list(thinking.chat.completions.create(**ask, stream=True, **usage))
    pieces = [c.choices[0].delta for c in chunks if c.choices]
    streamed = "".join(d.model_extra.get("reasoning_content") or "" for d in pieces)
    assert streamed == reasoning and not "".join(d.content or "" for d in pieces)
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == tokens
    off = {**ask, "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    plain = thinking.chat.completions.create(**off).choices[0].message
    assert plain.content and plain.model_extra.get("reasoning_content") is None
    with pytest.raises(openai.BadRequestError, match="set by the server"):
        thinking.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"tools": []}})


def test_a_reasoning_effort_is_the_templates_switch(thinking):
    """A template that reads `enable_thinking` takes effort "none" as thinking off and any
    other as on, in chat and Responses alike; one that reads `reasoning_effort` gets it as
    sent; a contradiction, or the effort in chat_template_kwargs, is a 400."""
    from minisgl.tokenizer.tokenizer import with_effort

    ask = {"model": "m", "messages": ASK, "temperature": 0, "max_tokens": 12}
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    plain = thinking.chat.completions.create(**ask, extra_body=off).choices[0].message
    none = thinking.chat.completions.create(**ask, reasoning_effort="none").choices[0].message
    assert none.content == plain.content and none.model_extra.get("reasoning_content") is None
    low = thinking.chat.completions.create(**ask, reasoning_effort="low").choices[0].message
    assert low.model_extra.get("reasoning_content") and low.content == ""
    on = {"chat_template_kwargs": {"enable_thinking": True}}
    with pytest.raises(openai.BadRequestError, match="contradicts enable_thinking"):
        thinking.chat.completions.create(**ask, reasoning_effort="none", extra_body=on)
    sneaked = {"chat_template_kwargs": {"reasoning_effort": "high"}}
    with pytest.raises(openai.BadRequestError, match="set by the server"):
        thinking.chat.completions.create(**ask, extra_body=sneaked)

    asked = {"model": "m", "input": ASK, "temperature": 0, "max_output_tokens": 12}
    quiet = thinking.responses.create(**asked, reasoning={"effort": "none"})
    assert [o.type for o in quiet.output] == ["message"] and quiet.output_text == plain.content
    assert quiet.reasoning.effort == "none"
    deep = thinking.responses.create(**asked, reasoning={"effort": "high", "summary": "auto"})
    assert [o.type for o in deep.output] == ["reasoning"]
    assert deep.output[0].content[0].text == low.model_extra["reasoning_content"]

    gpt_oss = "Reasoning: {{ reasoning_effort | default('medium') }}"
    assert with_effort(gpt_oss, {"reasoning_effort": "low"}) == {"reasoning_effort": "low"}
    with pytest.raises(ValueError, match="reads no reasoning effort"):
        with_effort("{{ messages }}", {"reasoning_effort": "low"})


def test_a_responses_answer_has_its_reasoning_first_whole_and_streamed():
    """Qwen3's form (the model opens and closes the block), then the answer: a reasoning item
    and a message, alike whole and streamed; the events are the ones OpenAI's client knows;
    the reasoning's tokens are those up to the one that closed the block."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    from minisgl.server.reasoning import Reasoning
    from minisgl.server.responses_api import ResponsesRequest
    from minisgl.server.responses_output import Answer

    pieces = ["<think>\n", "Let me", " see.</th", "ink>\n\n", "Paris", "."]
    event = TypeAdapter(ResponseStreamEvent)

    def answer(streamed: bool) -> tuple[Answer, list[Any]]:
        out = Answer(ResponsesRequest(model="m", input="hi"), "m", 0, 5, None, Reasoning(False))
        events = []
        for i, piece in enumerate(pieces):
            out.choice.tokens, final = i + 1, i == len(pieces) - 1
            out.choice.finish_reason = "stop" if final else None
            thought, text = out.split(piece, final)
            if streamed:
                events += [*out.thinking(thought), *out.text(text)]
        events += out.close(out.status) if streamed else out.finish() or []
        data = [json.loads(e.split("data: ", 1)[1]) for e in events]
        return out, [event.validate_python(d) for d in data]

    (whole, _), (streamed, events) = answer(False), answer(True)
    for out in whole, streamed:
        assert [i["type"] for i in out.items] == ["reasoning", "message"]
        assert out.items[0]["content"] == [{"type": "reasoning_text", "text": "Let me see."}]
        assert out.items[1]["content"][0]["text"] == "Paris."
        assert out.reasoning_tokens == 4
        assert out.response()["usage"]["output_tokens_details"]["reasoning_tokens"] == 4
    kinds = [e.type.removeprefix("response.") for e in events]
    thinking = ["reasoning_text.delta"] * 2 + ["reasoning_text.done", "content_part.done"]
    text = ["output_text.delta"] * 2 + ["output_text.done", "content_part.done"]
    opened = ["output_item.added", "content_part.added"]
    assert kinds == [*opened, *thinking, "output_item.done", *opened, *text, "output_item.done"]


def test_responses_carry_reasoning_out_and_back(thinking):
    """The 135M model never closes the block the template opened: the whole answer is one
    reasoning item, chat's `reasoning_content`, streamed alike. Sent back (by
    previous_response_id, or as input items), it reaches the template as the assistant
    message's `reasoning_content`, as a chat message's does."""
    ask = {"model": "m", "temperature": 0, "max_output_tokens": 12}
    question = [{"role": "user", "content": QUESTION}]
    first = thinking.responses.create(**ask, input=question)
    (item,) = first.output
    chat = thinking.chat.completions.create(
        model="m", messages=question, temperature=0, max_tokens=12
    )
    thought = chat.choices[0].message.model_extra["reasoning_content"]
    assert item.type == "reasoning" and item.content[0].text == thought
    assert first.usage.output_tokens_details.reasoning_tokens == first.usage.output_tokens > 0
    with thinking.responses.stream(**ask, input=question) as events:
        deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
        final = events.get_final_response()
    assert "".join(deltas) == final.output[0].content[0].text == thought

    more = [{"role": "user", "content": "And of Spain?"}]
    on = thinking.responses.create(**ask, input=more, previous_response_id=first.id)
    sent = [o.model_dump(exclude_none=True) for o in first.output]
    back = thinking.responses.create(**ask, input=[*question, *sent, *more])
    turn = {"role": "assistant", "content": "", "reasoning_content": thought}
    messages = [*question, turn, *more]
    as_chat = thinking.chat.completions.create(model="m", messages=messages, max_tokens=1)
    without = thinking.chat.completions.create(
        model="m", messages=[*question, {"role": "assistant", "content": ""}, *more], max_tokens=1
    )
    assert on.usage.input_tokens == back.usage.input_tokens == as_chat.usage.prompt_tokens
    assert as_chat.usage.prompt_tokens > without.usage.prompt_tokens + 8
    assert on.output[0].content[0].text == back.output[0].content[0].text


def test_reasoning_items_go_back_as_the_assistant_messages_they_led_to():
    from minisgl.server.responses_api import ResponsesRequest

    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Ask the tool."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Sun."}]},
        {"role": "assistant", "content": "It is sunny."},
    ]  # fmt: skip
    plain = ResponsesRequest(model="m", input=items).as_chat([]).plain_messages()
    assert [(m["role"], m["content"], m.get("reasoning_content")) for m in plain] == [
        ("user", "Weather in Paris?", None),
        ("assistant", "", "Ask the tool."),
        ("tool", "sunny", None),
        ("assistant", "It is sunny.", "Sun."),
    ]
    assert plain[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
