"""POST /generate: SGLang's native endpoint, which routers forward and SGLang's clients use.

A body gives its prompt as `text` (a string, or a list of them) or `input_ids` (a list of
token ids, or a list of such lists), its sampling as `sampling_params` in SGLang's names
(`max_new_tokens`, `temperature`, ...; greedy is temperature 0, the default is 1), and may
ask to `stream`. The answer is SGLang's: `text`, `output_ids` and `meta_info` (prompt,
completion and cached tokens, the finish reason); a list of prompts gets a list of
answers. A stream sends the text and ids so far in every event, as SGLang does by default,
and ends with `data: [DONE]`.

What SGLang's endpoint takes and this one does not (images, LoRA, logprobs, regex
grammars, sessions, a streamed batch) is refused with a 400 that names the field, not
ignored: an answer that silently dropped a constraint would be wrong without saying so.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from minisgl.message.frontend import DeltaMsg, TokenizeMsg
from minisgl.sampling_params import SamplingParams
from minisgl.server.frontend import Choice, Frontend
from minisgl.server.protocol import INT64_END, MAX_PROMPTS, APIError, Text, TokenId, check_model

# SGLang's fields that we take at their defaults only (which are what we do). Routers send
# some of them on every request, filled in with those defaults.
SAMPLING_DEFAULTS = {
    "min_p": 0.0,
    "min_new_tokens": 0,
    "n": 1,  # several answers: send the prompt several times
    "no_stop_trim": False,
    "spaces_between_special_tokens": True,
}
REQUEST_DEFAULTS = {
    "return_text_in_logprobs": False,
    "return_hidden_states": False,
    "return_bytes": False,
    "return_entropy": False,
    "background": False,
}
LOGGING_FIELDS = ("log_metrics", "no_logs")  # how SGLang logs a request: nothing to do here


def _at_defaults(data: Any, defaults: dict[str, Any], ignored: tuple[str, ...] = ()) -> Any:
    """`data` without the fields of `defaults`, which must hold their default values."""
    if not isinstance(data, dict):
        return data  # the model's own validation says what is wrong
    data = {k: v for k, v in data.items() if k not in ignored}
    for name, default in defaults.items():
        if name in data and data.pop(name) != default:
            raise ValueError(f"{name}: only {json.dumps(default)} is supported here")
    return data


class NativeSampling(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_new_tokens: int = Field(128, ge=1, lt=INT64_END)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, lt=INT64_END)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    json_schema: str | None = None
    sampling_seed: int | None = Field(None, ge=0, lt=INT64_END)

    @model_validator(mode="before")
    @classmethod
    def _sglang_defaults(cls, data: Any) -> Any:
        return _at_defaults(data, SAMPLING_DEFAULTS)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (no limit) or >= 1")
        return v

    def params(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            max_tokens=self.max_new_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=list(self.stop_token_ids or []),
            seed=self.sampling_seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            json_schema=self.json_schema,
        )


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None  # routers name the model they picked
    text: Text | list[Text] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: NativeSampling = Field(default_factory=NativeSampling)
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool = False

    @model_validator(mode="before")
    @classmethod
    def _sglang_defaults(cls, data: Any) -> Any:
        return _at_defaults(data, REQUEST_DEFAULTS, LOGGING_FIELDS)

    @field_validator("return_logprob")
    @classmethod
    def _no_logprobs(cls, v: bool) -> bool:
        if v:
            raise ValueError("not supported on /generate; /v1/completions has logprobs")
        return v

    @model_validator(mode="after")
    def _one_prompt_kind(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give the prompt as `text` or as `input_ids`, one of the two")
        prompts = self.prompts()
        if not 1 <= len(prompts) <= MAX_PROMPTS:
            raise ValueError(f"send 1 to {MAX_PROMPTS} prompts, not {len(prompts)}")
        if not all(prompts):
            raise ValueError("the prompt is empty")
        if self.batched and self.stream:
            raise ValueError("a list of prompts cannot be streamed; send one request each")
        rids = self.rid if isinstance(self.rid, list) else None
        if rids is not None and (not self.batched or len(rids) != len(prompts)):
            raise ValueError("rid: a list of ids needs a list of prompts of the same length")
        return self

    @property
    def batched(self) -> bool:
        p = self.text if self.text is not None else self.input_ids
        return isinstance(p, list) and bool(p) and isinstance(p[0], str | list)

    def prompts(self) -> list[str | list[int]]:
        p = self.text if self.text is not None else self.input_ids
        return list(p) if self.batched else [p]  # type: ignore[list-item]

    def ids(self) -> list[str]:
        if isinstance(self.rid, list):
            return self.rid
        if self.batched:
            return [uuid.uuid4().hex for _ in self.prompts()]
        return [self.rid or uuid.uuid4().hex]


class _Answer:
    """One prompt's request as it runs: its deltas in, SGLang's answer shape out."""

    def __init__(self, rid: str, msg: TokenizeMsg) -> None:
        self.rid, self.msg = rid, msg
        self.queue: asyncio.Queue | None = None
        self.prompt_tokens = 0
        self.started = time.perf_counter()
        self.choice = Choice(msg.uid, 0, started=self.started, arrived=self.started)
        self.cached_tokens = 0
        self.matched: int | None = None  # the token that ended it, if one did

    def take(self, delta: DeltaMsg) -> None:
        """What SGLang's answer says of a delta that the choice does not keep."""
        self.cached_tokens = delta.cached_tokens
        if delta.finished:
            self.matched = delta.token

    def results(self, frontend: Frontend) -> AsyncIterator[tuple[Choice, DeltaMsg]]:
        assert self.queue is not None
        return frontend.results(self.queue, [self.choice])

    def body(self) -> dict[str, Any]:
        c = self.choice
        reason: dict[str, Any] | None = None
        if c.finish_reason == "length":
            reason = {"type": "length", "length": c.tokens}
        elif c.finish_reason is not None:  # EOS or a stop token (its id), or a stop string
            reason = {"type": "stop", "matched": self.matched}
        meta = {
            "id": self.rid,
            "finish_reason": reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": c.tokens,
            "cached_tokens": self.cached_tokens,
            "e2e_latency": round(time.perf_counter() - self.started, 6),
        }
        return {"text": "".join(c.text), "output_ids": list(c.token_ids), "meta_info": meta}


def add_generate_route(
    app: FastAPI, frontend: Frontend, vocab_size: int, names: tuple[str, ...]
) -> None:
    """`names`: the served model name first, then the names it also answers to."""

    @app.post("/generate")
    async def generate(body: GenerateRequest) -> Response:
        check_model(body.model, names)
        sp = body.sampling_params
        if outside := [t for t in sp.stop_token_ids or [] if t >= vocab_size]:
            message = f"token id {outside[0]} is outside the vocabulary [0, {vocab_size})"
            raise APIError(400, f"sampling_params.stop_token_ids: {message}")
        try:
            params = sp.params()
        except ValueError as e:
            raise APIError(400, f"sampling_params: {e}") from None
        stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
        answers = [
            _Answer(rid, _message(next(frontend.uids), prompt, params, stop, sp))
            for rid, prompt in zip(body.ids(), body.prompts())
        ]
        try:
            for a in answers:  # one at a time, so that each knows its own prompt's length
                a.queue, a.prompt_tokens = await frontend.open([a.msg])
        except BaseException:
            await frontend.close([a.msg.uid for a in answers if a.queue is not None], abort=True)
            raise
        if body.stream:
            return StreamingResponse(_events(frontend, answers[0]), media_type="text/event-stream")
        tasks = [asyncio.ensure_future(_finish(frontend, a)) for a in answers]
        try:
            await asyncio.gather(*tasks)
        finally:  # one failed, or the client left: the others stop too
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        bodies = [a.body() for a in answers]
        return JSONResponse(bodies if body.batched else bodies[0])


def _message(
    uid: int, prompt: str | list[int], params: SamplingParams, stop: list[str], sp: NativeSampling
) -> TokenizeMsg:
    text = prompt if isinstance(prompt, str) else None
    ids = None if isinstance(prompt, str) else list(prompt)
    return TokenizeMsg(
        uid,
        params,
        prompt=text,
        input_ids=ids,
        stop=stop,
        skip_special_tokens=sp.skip_special_tokens,
    )


async def _finish(frontend: Frontend, answer: _Answer) -> None:
    async for _, delta in answer.results(frontend):
        answer.take(delta)


async def _events(frontend: Frontend, answer: _Answer) -> AsyncIterator[str]:
    try:
        async for _, delta in answer.results(frontend):
            answer.take(delta)
            yield f"data: {json.dumps(answer.body())}\n\n"
    except APIError as e:  # too late for a status: an error event, as the others
        yield f"data: {json.dumps(e.body())}\n\n"
    else:
        yield "data: [DONE]\n\n"
    finally:  # a client that hangs up cancels this generator while it sends: abort now
        await frontend.end([answer.choice])
