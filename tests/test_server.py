"""The OpenAI-compatible server end to end: a live `python -m minisgl` on CPU, the official
`openai` client, and raw HTTP where the bytes matter.

The reference for every greedy or seeded answer is the offline `LLM` in this process, on the
same weights in fp32 with the same sampling parameters; chat prompts are rendered with the
model's chat template and tokenized without added special tokens, as the tokenizer worker
does. One server serves the API tests, a bounded fuzz of hostile requests among them; the
shutdown tests start their own, in parallel.

Every process runs torch on one thread: the test machine has two cores shared with other
jobs, and oversubscribed threads make a decode step several times slower.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from helpers import (
    CONTEXT,
    MODEL,
    SMOL,
    SMOL_CPU,
    Server,
    check_error,
    descendants,
    httpx,
    ipc_dir,
    launch,
    metrics,
    need,
    serving,
    socket_paths,
    stop,
    wait_gone,
    wait_idle,
    wait_ready,
)

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from minisgl.tokenizer.tokenizer import Tokenizer

PROMPT = "The capital of France is"  # greedy: " Paris.\n\nThe answer ..."
MAX = 6
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_MAX = 8  # greedy: "The capital of France is Paris." and <|im_end|>


# ---- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    with serving(tmp_path_factory.mktemp("server"), *SMOL_CPU) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(need(SMOL))


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    engine = LLM(
        str(need(SMOL)),
        dtype=torch.float32,
        device="cpu",
        max_seq_len_override=CONTEXT,
        num_page_override=2048,
        max_running_req=32,
    )
    yield engine
    engine.shutdown()


_offline: dict[tuple, dict[str, Any]] = {}


def offline(llm: LLM, prompt: str | list[int], max_tokens: int, **params: Any) -> dict[str, Any]:
    """The offline LLM's answer for one prompt (memoised: several tests share a reference)."""
    ids = prompt if isinstance(prompt, str) else tuple(prompt)
    key = (ids, max_tokens, *sorted(params.items()))
    if key not in _offline:
        sp = SamplingParams(max_tokens=max_tokens, **params)
        _offline[key] = llm.generate([prompt], sp, use_tqdm=False)[0]
    return _offline[key]


def chat_ids(tok: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)


# ---- completions and chat: the same tokens as offline -------------------------------------


def test_completion_matches_offline(client, llm, tok):
    ref = offline(llm, PROMPT, MAX)
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX, temperature=0, logprobs=1
    )
    (choice,) = out.choices
    assert choice.text == ref["text"]
    assert choice.finish_reason == ref["finish_reason"] == "length"
    assert out.usage.prompt_tokens == len(tok.encode(PROMPT))
    assert out.usage.completion_tokens == len(ref["token_ids"]) == MAX
    assert out.usage.total_tokens == out.usage.prompt_tokens + MAX
    assert out.model == MODEL and out.object == "text_completion"
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == MAX
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs)
    assert "".join(lp.tokens) == choice.text  # no special token among these six


def test_completion_stream_matches_offline(client, llm, tok):
    ref = offline(llm, PROMPT, MAX)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=MAX,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *body, last = chunks
    assert last.choices == [] and last.usage is not None, "include_usage: a final usage chunk"
    assert last.usage.prompt_tokens == len(tok.encode(PROMPT))
    assert last.usage.completion_tokens == MAX
    assert all(c.usage is None for c in body)
    assert "".join(c.choices[0].text for c in body) == ref["text"]
    assert [c.choices[0].finish_reason for c in body][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in body[:-1])


def test_completion_token_id_prompt(client, llm, tok):
    ids = tok.encode(PROMPT)
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX, temperature=0)
    assert out.choices[0].text == offline(llm, PROMPT, MAX)["text"]
    assert out.usage.prompt_tokens == len(ids)


def test_chat_matches_offline(client, llm, tok):
    ids = chat_ids(tok, CHAT)
    ref = offline(llm, ids, CHAT_MAX)
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=CHAT_MAX, temperature=0, logprobs=True
    )
    (choice,) = out.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == ref["text"]
    assert choice.finish_reason == ref["finish_reason"]
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == len(ref["token_ids"])
    assert out.object == "chat.completion"
    content = choice.logprobs.content
    assert len(content) == len(ref["token_ids"])
    assert all(t.logprob <= 0 for t in content)


def test_chat_stream_matches_offline(client, llm, tok):
    ids = chat_ids(tok, CHAT)
    ref = offline(llm, ids, CHAT_MAX)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_completion_tokens=CHAT_MAX,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *body, last = chunks
    assert body[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in body) == ref["text"]
    assert body[-1].choices[0].finish_reason == ref["finish_reason"]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert last.choices == []
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        len(ids),
        len(ref["token_ids"]),
    )


def test_stream_is_server_sent_events(server, llm):
    """The raw bytes: `data: {json}` events, each ended by a blank line, then [DONE]."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_raw())
    assert raw.endswith(b"\n\ndata: [DONE]\n\n"), raw[-200:]
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    text = ""
    for event in events[:-2]:
        assert event.startswith(b"data: ") and b"\n" not in event, event
        chunk = json.loads(event[len(b"data: ") :])
        assert chunk["object"] == "text_completion" and chunk["model"] == MODEL
        text += chunk["choices"][0]["text"]
    assert text == offline(llm, PROMPT, MAX)["text"]


# ---- stop strings, logprobs, n, seeds, penalties ------------------------------------------


def split_stop(llm: LLM, tok: Tokenizer) -> tuple[str, str]:
    """A stop string across the first two tokens' boundary, and the text before it."""
    ref = offline(llm, PROMPT, MAX)
    first = tok.decode(ref["token_ids"][:1])
    assert len(first) >= 2, first
    stop = ref["text"][len(first) - 2 : len(first) + 1]  # " Paris" + "." -> "is."
    assert ref["text"].find(stop) == len(first) - 2, (ref["text"], stop)
    return stop, ref["text"][: len(first) - 2]


def test_stop_string_across_tokens(client, llm, tok):
    stop, before = split_stop(llm, tok)
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX, temperature=0, stop=[stop, "never seen"]
    )
    assert out.choices[0].text == before
    assert stop not in out.choices[0].text
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == 2  # generation ended at the token completing it

    chunks = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=CHAT_MAX, temperature=0, stream=True, stop="Paris"
    )
    chunks = list(chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    ref = offline(llm, chat_ids(tok, CHAT), CHAT_MAX)["text"]
    assert "Paris" in ref, ref
    assert text == ref[: ref.find("Paris")]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_string_on_the_last_allowed_token(client, llm, tok):
    ref = offline(llm, PROMPT, MAX)
    first = tok.decode(ref["token_ids"][:1])
    stop = ref["text"][len(first)]  # the second token's first character: "."
    assert stop not in first
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, stop=[stop]
    )
    assert out.choices[0].text == first
    assert out.choices[0].finish_reason == "stop", (
        "BUG: a stop string matched on the request's last allowed token reports finish_reason "
        f"{out.choices[0].finish_reason!r}; the text was cut at the stop string, so it is 'stop' "
        "(tokenizer/worker.py handle_token keeps the scheduler's 'length' when `finished`)"
    )


def test_streamed_logprobs_cover_every_token(client):
    # " Paris!" never matches, but " Paris" could begin it, so that token's text is held back
    # and sent with the next one; its log-probability must not be lost on the way.
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        logprobs=1,
        stream=True,
        stop=[" Paris!"],
        stream_options={"include_usage": True},
    )
    values, usage = [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            if c.logprobs is not None:
                values += c.logprobs.token_logprobs
    assert usage is not None and usage.completion_tokens == 3
    assert all(v <= 0 for v in values)
    assert len(values) == usage.completion_tokens, (
        f"BUG: a stream of {usage.completion_tokens} tokens carried {len(values)} logprobs: "
        "streaming.py stream() only yields an event when the delta has text, so a token "
        "whose text is held back (stop-string prefix, partial UTF-8) loses its logprob"
    )


def test_n_and_seed(client, llm, tok):
    params = dict(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=1234, n=2)
    first = client.completions.create(**params)
    again = client.completions.create(**params)
    assert [c.index for c in first.choices] == [0, 1]
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices], "same seed, same text"
    assert all(c.finish_reason == "length" for c in first.choices)
    assert first.usage.completion_tokens == 10
    # Choice i is sampled with seed + i; the offline LLM with those seeds agrees.
    for i, text in enumerate(texts):
        assert text == offline(llm, PROMPT, 5, temperature=1.0, seed=1234 + i)["text"]


def test_usage_counts_the_prompt_once_with_n(client, tok):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, n=2)
    assert len(out.choices) == 2
    assert out.usage.completion_tokens == 2
    assert out.usage.prompt_tokens == len(tok.encode(PROMPT)), (
        f"BUG: usage.prompt_tokens is {out.usage.prompt_tokens} for a "
        f"{len(tok.encode(PROMPT))}-token prompt with n=2; OpenAI (and vLLM, SGLang) count the "
        "prompt once (responses.py ResponseShape.usage multiplies it by the number of choices)"
    )


@pytest.mark.parametrize(
    "penalty",
    [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 1.5}],
    ids=lambda p: next(iter(p)),
)
def test_penalties_change_greedy_output(client, llm, penalty):
    plain = offline(llm, PROMPT, MAX)["text"]
    ref = offline(llm, PROMPT, MAX, **penalty)["text"]
    openai_args = {k: v for k, v in penalty.items() if k != "repetition_penalty"}
    extra = {k: v for k, v in penalty.items() if k == "repetition_penalty"}
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=MAX,
        temperature=0,
        extra_body=extra,
        **openai_args,
    )
    assert out.choices[0].text == ref
    assert ref != plain, "the penalty must change this prompt's greedy output"


# >>> ch25 the rest of the API: logit_bias, top and prompt logprobs, structured output
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
ASK_PERSON = [
    {"role": "user", "content": "Describe a person as JSON: name, age, favourite colour."}
]
ASK_OBJECT = [{"role": "user", "content": "Give me a JSON object with the keys a and b."}]


def is_person(text: str) -> bool:
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    return (
        isinstance(doc, dict)
        and set(doc) == {"name", "age", "color"}
        and isinstance(doc["name"], str)
        and len(doc["name"]) <= 20
        and type(doc["age"]) is int
        and 18 <= doc["age"] <= 99
        and doc["color"] in ("red", "green", "blue")
    )


def test_logit_bias_forces_and_forbids(client, llm, tok):
    forced = tok.encode(" banana")[0]
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={str(forced): 100}
    )
    assert out.choices[0].text == " banana" * 3
    greedy = offline(llm, PROMPT, MAX)["token_ids"][0]
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logit_bias={str(greedy): -100}
    )
    assert out.choices[0].text != tok.decode([greedy])


def test_chat_top_logprobs(client, llm, tok):
    ref = offline(llm, chat_ids(tok, CHAT), CHAT_MAX, logprobs=True, top_logprobs=3)
    out = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=CHAT_MAX,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == len(ref["token_ids"]) == len(ref["logprobs"])
    for entry, token, want in zip(content, ref["token_ids"], ref["logprobs"]):
        assert [t.token for t in entry.top_logprobs] == [
            tok.decode([t], skip_special_tokens=False) for t in want["top"]
        ]
        got = [t.logprob for t in entry.top_logprobs]
        assert max(abs(a - b) for a, b in zip(got, want["top"].values())) < 1e-4
        assert (
            entry.top_logprobs[0].token
            == entry.token
            == tok.decode([token], skip_special_tokens=False)
        )
        assert all(bytes(t.bytes) == t.token.encode() for t in entry.top_logprobs)
    raw = b"".join(bytes(e.bytes) for e in content)
    assert raw.decode().startswith(out.choices[0].message.content)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_top_logprobs_and_text_offsets(client, stream):
    params = dict(model=MODEL, prompt=PROMPT, max_tokens=MAX, temperature=0, logprobs=2)
    if not stream:
        choice = client.completions.create(**params).choices[0]
        text, lp = choice.text, choice.logprobs
        tokens, values, tops, offsets = (
            lp.tokens,
            lp.token_logprobs,
            lp.top_logprobs,
            lp.text_offset,
        )
    else:
        text, tokens, values, tops, offsets = "", [], [], [], []
        for chunk in client.completions.create(**params, stream=True):
            choice = chunk.choices[0]
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                values += choice.logprobs.token_logprobs
                tops += choice.logprobs.top_logprobs
                offsets += choice.logprobs.text_offset
    assert len(tokens) == len(values) == len(tops) == len(offsets) == MAX
    for token, value, top, offset in zip(tokens, values, tops, offsets):
        assert text[offset : offset + len(token)] == token
        assert len(top) == 2 and top[token] == value == max(top.values())  # greedy


def test_echo_scores_the_prompt_as_lm_eval_asks(server, tok):
    """lm-evaluation-harness's local-completions: echo, logprobs=1, max_tokens 0 (or 1)."""
    from helpers import hf_logits

    text = "Paris is the capital and largest city of France, on the river Seine."
    ids = tok.encode(text)
    ref = torch.log_softmax(hf_logits(SMOL, ids), dim=-1)
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    body = {"model": MODEL, "prompt": text, "echo": True, "logprobs": 1, "temperature": 0}
    r = httpx.post(server.base + "/v1/completions", json={**body, "max_tokens": 0}, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    (choice,) = out["choices"]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert lp["tokens"] == [tok.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], want)) < 1e-4
    assert all(text[o:].startswith(t) for o, t in zip(lp["text_offset"], lp["tokens"]))
    # As lm-eval reads it today: max_tokens 1, the continuation is [ctxlen:-1].
    ctxlen = 5
    r = httpx.post(server.base + "/v1/completions", json={**body, "max_tokens": 1}, timeout=300)
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1
    score = sum(lp["token_logprobs"][ctxlen:-1])
    assert abs(score - sum(want[ctxlen - 1 :])) < 1e-3
    is_greedy = all(
        v == max(top.values())
        for v, top in zip(lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1])
    )
    assert is_greedy == all(ref[i - 1].argmax().item() == ids[i] for i in range(ctxlen, len(ids)))


def test_echo_streams_the_prompt_first(client):
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True, stream=True
        )
    )
    assert chunks[0].choices[0].text == PROMPT
    whole = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert whole.choices[0].text.startswith(PROMPT) and len(whole.choices[0].text) > len(PROMPT)


def test_json_schema_twenty_of_twenty(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=ASK_PERSON,
        max_tokens=64,
        temperature=1.0,
        seed=7,
        n=20,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    texts = [c.message.content for c in out.choices]
    assert sum(is_person(t) for t in texts) == 20, texts


def test_json_object(client):
    kw = dict(model=MODEL, messages=ASK_OBJECT, max_tokens=48, temperature=0)
    free = client.chat.completions.create(**kw).choices[0].message.content
    with pytest.raises(ValueError):
        json.loads(free)  # left alone, the model wraps it in a markdown fence
    out = client.chat.completions.create(**kw, response_format={"type": "json_object"})
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such"}}},
        {"type": "json_schema"},
        {"type": "xml"},
    ],
    ids=["unknown-type", "no-schema", "no-such-format"],
)
def test_bad_response_format_is_a_400(server, response_format):
    body = {"model": MODEL, "messages": CHAT, "response_format": response_format}
    r = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=60)
    err = check_error(r, 400)
    assert "schema" in err["message"] or "response_format" in err["message"], err


# <<< ch25
# ---- many clients at once -----------------------------------------------------------------

TOPICS = [
    "sun",
    "moon",
    "ocean",
    "forest",
    "river",
    "mountain",
    "desert",
    "city",
    "village",
    "garden",
    "library",
    "kitchen",
    "winter",
    "summer",
    "train",
    "bridge",
    "castle",
    "island",
    "school",
    "market",
    "museum",
    "harbor",
    "storm",
    "rainbow",
    "piano",
    "guitar",
    "doctor",
    "farmer",
    "teacher",
    "robot",
    "planet",
    "volcano",
]


def test_32_concurrent_streams(server, llm):
    prompts = [f"The {topic} is" for topic in TOPICS]
    refs = llm.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)
    aclient = openai.AsyncOpenAI(
        base_url=server.base + "/v1", api_key="none", timeout=600, max_retries=0
    )

    async def one(prompt: str) -> tuple[str, str | None]:
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        parts, reason = [], None
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        return "".join(parts), reason

    async def all_of_them() -> list[tuple[str, str | None]]:
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()

    results = asyncio.run(all_of_them())
    for prompt, ref, (text, reason) in zip(prompts, refs, results):
        assert (text, reason) == (ref["text"], ref["finish_reason"]), prompt


# ---- bad input: a 400 (or 404) with an OpenAI error body, and the server keeps serving ---

BAD = [
    ("completions", "malformed-json", b'{"model": "m", "prompt": ', None),
    ("chat/completions", "malformed-json", b'{"model": "m", "messages": [}', None),
    ("completions", "no-prompt", {"model": MODEL}, "prompt"),
    ("chat/completions", "no-messages", {"model": MODEL}, "messages"),
    ("completions", "no-model", {"prompt": "Hi"}, "model"),
    ("chat/completions", "no-model", {"messages": CHAT}, "model"),
    (
        "completions",
        "max-tokens-abc",
        {"model": MODEL, "prompt": "Hi", "max_tokens": "abc"},
        "max_tokens",
    ),
    ("chat/completions", "messages-string", {"model": MODEL, "messages": "Hi"}, "messages"),
    ("chat/completions", "messages-empty", {"model": MODEL, "messages": []}, "messages"),
    (
        "completions",
        "max-tokens-0",
        {"model": MODEL, "prompt": "Hi", "max_tokens": 0},
        "max_tokens",
    ),
    (
        "chat/completions",
        "max-tokens-neg",
        {"model": MODEL, "messages": CHAT, "max_tokens": -1},
        "max_tokens",
    ),
    (
        "completions",
        "temperature-neg",
        {"model": MODEL, "prompt": "Hi", "temperature": -0.5},
        "temperature",
    ),
    ("completions", "top-p-0", {"model": MODEL, "prompt": "Hi", "top_p": 0}, "top_p"),
    ("chat/completions", "top-p-1.5", {"model": MODEL, "messages": CHAT, "top_p": 1.5}, "top_p"),
    ("completions", "n-0", {"model": MODEL, "prompt": "Hi", "n": 0}, "n"),
    ("completions", "empty-prompt", {"model": MODEL, "prompt": ""}, "prompt"),
    ("completions", "empty-ids", {"model": MODEL, "prompt": []}, "prompt"),
    ("completions", "ids-outside-vocab", {"model": MODEL, "prompt": [1, 10**9]}, "prompt"),
    (
        "completions",
        "repetition-penalty-0",
        {"model": MODEL, "prompt": "Hi", "repetition_penalty": 0},
        "repetition_penalty",
    ),
    (
        "chat/completions",
        "repetition-penalty-neg",
        {"model": MODEL, "messages": CHAT, "repetition_penalty": -1.0},
        "repetition_penalty",
    ),
]


@pytest.mark.parametrize(
    "path,payload,param", [(p, b, q) for p, _, b, q in BAD], ids=[f"{p}-{i}" for p, i, *_ in BAD]
)
def test_bad_input_is_a_400(server, path, payload, param):
    url = f"{server.base}/v1/{path}"
    if isinstance(payload, bytes):
        r = httpx.post(url, content=payload, headers={"content-type": "application/json"})
    else:
        r = httpx.post(url, json=payload, timeout=60)
    err = check_error(r, 400)
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_prompt_longer_than_the_context(server, tok, stream):
    prompt = "hello " * 300
    n = len(tok.encode(prompt))
    assert n > CONTEXT
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": stream}
    err = check_error(httpx.post(server.base + "/v1/completions", json=body, timeout=60), 400)
    assert str(n) in err["message"] and str(CONTEXT) in err["message"], err
    assert err["code"] == "context_length_exceeded", err


def test_unknown_model_is_a_404(server):
    r = httpx.post(
        server.base + "/v1/chat/completions",
        json={"model": "no-such-model", "messages": CHAT},
        timeout=60,
    )
    err = check_error(r, 404)
    assert err["param"] == "model" and err["code"] == "model_not_found"
    assert "no-such-model" in err["message"]


def test_openai_client_raises_on_bad_input(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", temperature=-1)
    assert e.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="Hi")


def test_a_prompt_too_long_is_refused_in_the_same_words_online_and_offline(client, llm):
    ids = [42] * (CONTEXT + 10)
    with pytest.raises(openai.BadRequestError) as online:
        client.completions.create(model=MODEL, prompt=ids, max_tokens=4)
    assert online.value.status_code == 400 and online.value.code == "context_length_exceeded"
    with pytest.raises(ValueError) as offline:
        llm.generate([ids], SamplingParams(max_tokens=4), use_tqdm=False)
    message = (
        f"the prompt has {CONTEXT + 10} tokens; this model's context is {CONTEXT} tokens, "
        "including at least one generated token"
    )
    assert online.value.body["message"] == message
    assert str(offline.value) == f"prompt 0: {message}"


# ---- hostile input: a bounded fuzz -------------------------------------------------------

BIG = 2**64  # one past what msgpack can carry
VOCAB = 49152  # SmolLM2's

# Values that each field refuses, sent on the endpoints that have the field.
NEVER_VALID: dict[str, list[Any]] = {
    "max_tokens": [0, -3, BIG, -BIG, 10**30, 1.5, "eight"],
    "temperature": [-0.1, 2.5, 1e308, math.inf, math.nan, "hot"],
    "top_p": [0, 1.5, -1, math.nan],
    "top_k": [0, -2, BIG, -BIG],
    "n": [0, 129, BIG],
    "seed": [-1, BIG],
    "presence_penalty": [2.5, -3, math.inf],
    "frequency_penalty": [3, -2.5],
    "repetition_penalty": [0, -1, math.inf],
    "stop": [["a", "b", "c", "d", "e"], "\ud800", ["ok", "\udfff"], 5],
    "stop_token_ids": [[BIG], [-1], [VOCAB], "1"],
    "logit_bias": [{"42": 101}, {"42": -100.5}, {"abc": 1}, {str(BIG): 1}, {str(VOCAB): 1}, [1]],
    "stream": ["maybe", [True]],
    "stream_options": ["x"],
    "model": [5, None, "no-such-model", "\ud800"],
    "prompt": ["Hi \ud800 there", [1, BIG], [[1, BIG]], [], "", ["a", ""], {"a": 1}, [-1]],
    "logprobs": [21, -1, BIG],
    "messages": [
        [],
        "Hi",
        [{"role": "user", "content": "Hi \ud800 there"}],
        [{"role": "robot", "content": "Hi"}],
        [{"role": "user"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    ],
    "top_logprobs": [21, -1, 3],  # 3 without logprobs: true
    "tools": [[{"type": "function", "function": {"parameters": {}}}]],  # no name
    "tool_choice": ["auto", "none"],
}
ONLY_ON = {
    "prompt": "completions",
    "logprobs": "completions",
    "messages": "chat/completions",
    "top_logprobs": "chat/completions",
    "tools": "chat/completions",
    "tool_choice": "chat/completions",
}


@dataclass
class Hostile:
    name: str
    method: str
    path: str
    body: bytes | None
    status: int = 400
    content_type: str = "application/json"


def valid_body(path: str) -> dict[str, Any]:
    if path == "chat/completions":
        return {"model": MODEL, "messages": CHAT, "max_tokens": 1}
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}


def as_json(body: Any) -> bytes:
    # Not httpx's json=: it refuses NaN and lone surrogates, which are the point here.
    return json.dumps(body).encode()


def hostile_requests(seed: int = 14, sampled: int = 36) -> list[Hostile]:
    """Requests built by hand to break the framework, then a seeded sample of bad fields."""
    ok = as_json(valid_body("completions"))
    cut = random.Random(seed).randrange(1, len(ok) - 1)
    cases = [
        Hostile("not-utf8", "POST", "completions", ok[:-2] + b'"\xff\xfe"}'),
        Hostile("nested-100k", "POST", "chat/completions", b"[" * 100_000 + b"]" * 100_000),
        Hostile("infinity-literal", "POST", "completions", ok[:-1] + b', "temperature": Infinity}'),
        Hostile("truncated", "POST", "completions", ok[:cut]),
        Hostile("empty", "POST", "completions", b""),
        Hostile("array", "POST", "chat/completions", b"[]"),
        Hostile("string", "POST", "completions", b'"prompt"'),
        Hostile("text-plain", "POST", "completions", ok, content_type="text/plain"),
        Hostile(
            "too-long", "POST", "completions", as_json({**valid_body(""), "prompt": "hi " * 300})
        ),
        Hostile("unknown-path", "GET", "nope", None, 404),
        Hostile("unknown-post", "POST", "chat/complete", ok, 404),
        Hostile("get-completions", "GET", "completions", None, 405),
        Hostile("delete-chat", "DELETE", "chat/completions", None, 405),
        Hostile("post-models", "POST", "models", ok, 405),
    ]
    fields = [
        (path, name, value)
        for name, values in NEVER_VALID.items()
        for value in values
        for path in ("completions", "chat/completions")
        if ONLY_ON.get(name, path) == path
    ]
    for path, name, value in random.Random(seed).sample(fields, sampled):
        status = 404 if name == "model" and isinstance(value, str) else 400
        body = as_json({**valid_body(path), "stream": True, name: value})
        cases.append(Hostile(f"{path}-{name}={value!r}", "POST", path, body, status))
    return cases


def test_fuzz_hostile_requests_get_openai_errors(server, llm):
    cases = hostile_requests()
    assert len(cases) == 50
    before = metrics(server)
    with httpx.Client(base_url=server.base + "/v1/", timeout=60) as http:
        for case in cases:
            headers = {"content-type": case.content_type}
            r = http.request(case.method, case.path, content=case.body, headers=headers)
            try:
                err = check_error(r, case.status)
            except AssertionError as e:
                raise AssertionError(f"{case.name}: {e}") from None
            if case.name == "too-long":
                assert err["code"] == "context_length_exceeded", err
    after = metrics(server)

    def errors(m: dict[str, float]) -> float:
        return sum(v for k, v in m.items() if k.startswith("minisgl:error_responses_total"))

    assert errors(after) - errors(before) == 50
    # None reached the engine, so none counts as a failed request.
    assert after["minisgl:failed_requests_total"] == before["minisgl:failed_requests_total"]
    assert after["minisgl:requests_total"] == before["minisgl:requests_total"], "one got through"
    # The server still answers, and correctly.
    assert httpx.get(server.base + "/health").status_code == 200
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX, "temperature": 0}
    r = httpx.post(server.base + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == offline(llm, PROMPT, MAX)["text"]


def test_serves_after_bad_input(server, client, llm):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX, temperature=0)
    assert out.choices[0].text == offline(llm, PROMPT, MAX)["text"]
    assert httpx.get(server.base + "/health").status_code == 200


# ---- clients that hang up -----------------------------------------------------------------


def test_disconnected_streams_free_their_pages(server, client, llm):
    good = ["The sun is", "The moon is", "The river is", "The garden is"]
    refs = llm.generate(good, SamplingParams(max_tokens=8), use_tqdm=False)

    def finish(prompt: str) -> str:
        stream = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        return "".join(chunk.choices[0].text for chunk in stream)

    def hang_up(i: int) -> int:
        body = {
            "model": MODEL,
            "prompt": f"Tell me a long story about dragon number {i}.",
            "max_tokens": 64,
            "temperature": 0,
            "stream": True,
        }
        seen = 0
        with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen == 2:
                    break  # leaving the block closes the connection mid-stream
        return seen

    with ThreadPoolExecutor(8) as pool:
        finished = [pool.submit(finish, p) for p in good]
        dropped = [pool.submit(hang_up, i) for i in range(4)]
        assert [f.result() for f in dropped] == [2] * 4
        assert [f.result() for f in finished] == [r["text"] for r in refs]
    m = wait_idle(server)
    assert m["minisgl:num_requests_running"] == 0, m
    assert m["minisgl:kv_pages_used"] == 0, m
    assert m["minisgl:num_requests_waiting"] == 0, m
    assert httpx.get(server.base + "/health").status_code == 200


# ---- models and metrics -------------------------------------------------------------------


def test_workers_are_named_in_ps(server):
    titles = [
        Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        for pid in descendants(server.proc.pid)
    ]
    assert {"minisgl::scheduler", "minisgl::tokenizer"} <= set(titles), titles


def test_models_lists_the_served_model(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    body = httpx.get(server.base + "/v1/models").json()
    assert body["object"] == "list" and body["data"][0]["object"] == "model"


LABEL = r'[a-z_]+="[^"]*"'
SAMPLE = re.compile(rf"^[a-z_:][a-z0-9_:]*(\{{{LABEL}(,{LABEL})*\}})? -?[0-9.e+-]+$")


def test_metrics_are_prometheus_text(server, client, tok):
    before = metrics(server)
    for _ in range(2):  # the second run finds the prompt in the prefix cache
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    deadline = time.monotonic() + 10
    while (after := metrics(server))["minisgl:cached_tokens_total"] == before[
        "minisgl:cached_tokens_total"
    ] and time.monotonic() < deadline:
        time.sleep(0.2)

    r = httpx.get(server.base + "/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    types = {}
    for line in r.text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
        elif not line.startswith("# HELP "):
            assert SAMPLE.match(line), line
    expected = {
        "minisgl:requests_total": "counter",
        "minisgl:prompt_tokens_total": "counter",
        "minisgl:generation_tokens_total": "counter",
        "minisgl:cached_tokens_total": "counter",
        "minisgl:num_requests_running": "gauge",
        "minisgl:num_requests_waiting": "gauge",
        "minisgl:kv_pages_used": "gauge",
        "minisgl:kv_pages_capacity": "gauge",
        "minisgl:preemptions_total": "counter",
        "minisgl:time_to_first_token_seconds": "histogram",
        "minisgl:time_per_output_token_seconds": "histogram",
        "minisgl:e2e_request_latency_seconds": "histogram",
    }
    assert expected.items() <= types.items(), types

    def grew(name: str) -> float:
        return after[name] - before[name]

    assert grew("minisgl:requests_total") == 2
    assert grew("minisgl:prompt_tokens_total") == 2 * len(tok.encode(PROMPT))
    assert grew("minisgl:generation_tokens_total") == 4
    assert grew("minisgl:cached_tokens_total") > 0
    hists = ("time_to_first_token_seconds", "time_per_output_token_seconds")
    for hist in (*hists, "e2e_request_latency_seconds"):
        name = f"minisgl:{hist}"
        assert grew(f"{name}_count") == 2
        assert after[f"{name}_sum"] > before[f"{name}_sum"]
        buckets = [v for k, v in after.items() if k.startswith(f"{name}_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] == after[f"{name}_count"]


# ---- shutting down ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spares(tmp_path_factory) -> Iterator[list[Server]]:
    """Three more servers, started together: one for each way of ending."""
    need(SMOL)
    log_dir = tmp_path_factory.mktemp("spares")
    servers = [launch(log_dir, *SMOL_CPU, "--num-pages", "256") for _ in range(3)]
    try:
        for s in servers:
            wait_ready(s)
        yield servers
    finally:
        for s in servers:
            stop(s)


def test_metrics_from_start_up(spares):
    """Before any request, /metrics already knows the size of the KV pool."""
    m = metrics(spares[0])
    assert m["minisgl:requests_total"] == 0, m
    assert m["minisgl:kv_pages_capacity"] == 256, m  # --num-pages 256
    assert m["minisgl:kv_pages_used"] == 0, m


def check_stops(server: Server, send: Any) -> None:
    pid = server.proc.pid
    tree = [pid, *descendants(pid)]
    assert len(tree) >= 3, f"launcher, scheduler and tokenizer: got {tree}"
    folder = ipc_dir(pid)
    assert folder.parent == Path(tempfile.gettempdir()) and folder.is_dir()
    assert folder.stat().st_mode & 0o777 == 0o700, oct(folder.stat().st_mode)
    send(pid)
    started = time.monotonic()
    try:
        server.proc.wait(10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server still runs 10 s after the signal:\n{server.tail()}")
    left = wait_gone(tree, 10 - (time.monotonic() - started))
    assert not left, f"processes left {time.monotonic() - started:.1f} s after the signal: {left}"
    assert not folder.exists(), f"{folder} is left behind"


def test_sigterm_stops_every_process(spares):
    check_stops(spares[0], lambda pid: os.kill(pid, signal.SIGTERM))


def test_ctrl_c_stops_every_process(spares):
    # A terminal's Ctrl-C: SIGINT to the whole foreground process group.
    check_stops(spares[1], lambda pid: os.killpg(pid, signal.SIGINT))


def test_dead_worker_makes_the_server_exit(spares):
    server = spares[2]
    pid = server.proc.pid
    tree = [pid, *descendants(pid)]
    folder = ipc_dir(pid)
    scheduler = [p for p in tree[1:] if (folder / "scheduler").as_posix() in socket_paths(p)]
    assert len(scheduler) == 1, f"the process bound to {folder / 'scheduler'}: {scheduler}"
    # The launcher notices a dead worker within half a second, answers /health with 503 for
    # a grace period, then exits.
    os.kill(scheduler[0], signal.SIGKILL)
    assert not wait_gone(scheduler, 10)
    deadline = time.monotonic() + 10
    r = httpx.get(server.base + "/health", timeout=5)
    while r.status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
        r = httpx.get(server.base + "/health", timeout=5)
    assert r.status_code == 503, r.text
    try:
        code = server.proc.wait(10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server still runs 10 s after its scheduler died:\n{server.tail()}")
    assert code != 0
    assert not wait_gone(tree, 10)
    assert not folder.exists()
