"""The OpenAI request bodies we accept, validated field by field.

Fields we do not know are ignored, as OpenAI-compatible servers do; fields we know must
have the right type and range, or the client gets a 400 naming the field. Ranges are
OpenAI's. Whatever passes here must also cross our msgpack pipes: integers fit in 64 bits
and text is valid Unicode, so that nothing reaches the workers that they could choke on.
"""

from __future__ import annotations

import json  # [ch25]
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from minisgl.core import SamplingParams

UNLIMITED = 1 << 30  # "until EOS or the end of the context"
INT64_END = 1 << 63  # msgpack carries integers of up to 64 bits; prompts and params stay below


def _unicode(text: str) -> str:
    # JSON can spell a lone surrogate ("\ud800"); UTF-8, and so msgpack, cannot carry one.
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError("the text holds a lone surrogate (\\ud800-\\udfff): not Unicode") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]
TokenId = Annotated[int, Field(ge=0, lt=INT64_END)]  # the vocabulary's bound is the server's
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]  # added to a logit


class StreamOptions(BaseModel):
    include_usage: bool = False


# >>> ch25
class JsonSchema(BaseModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")  # `schema` is a BaseModel method's name
    strict: bool | None = None  # we always hold the output to the schema


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema: {"name", "schema"}')
        return self

    def schema_text(self) -> str | None:
        """The JSON schema the output must satisfy, as text (ASCII: it travels well)."""
        if self.type == "json_object":
            return '{"type": "object"}'
        if self.type == "json_schema" and self.json_schema is not None:
            return json.dumps(self.json_schema.schema_)
        return None


# <<< ch25


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, lt=INT64_END)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | Annotated[list[Text], Field(max_length=4)] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: int | None = Field(None, ge=0, lt=INT64_END)
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    skip_special_tokens: bool = True
    logit_bias: dict[TokenId, Bias] | None = None
    response_format: ResponseFormat | None = None  # [ch25]

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (no limit) or >= 1")
        return v

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def token_ids(self) -> dict[str, list[int]]:
        """The token ids the request names, by field: each must be in the model's vocabulary."""
        return {
            "stop_token_ids": list(self.stop_token_ids or []),
            "logit_bias": list(self.logit_bias or {}),
        }

    def sampling_params(self, max_tokens: int | None, logprobs: bool, i: int) -> SamplingParams:
        seed = None if self.seed is None else (self.seed + i) % 2**63  # n choices must differ
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            max_tokens=max_tokens or UNLIMITED,
            ignore_eos=self.ignore_eos,
            stop_token_ids=list(self.stop_token_ids or []),
            seed=seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logprobs=logprobs,
            **self._api_params(),  # [ch25]
        )

    # >>> ch25
    def _api_params(self) -> dict[str, Any]:
        """The rest of the API, as SamplingParams spells it."""
        fmt = self.response_format
        return {
            "logit_bias": dict(self.logit_bias or {}),
            "json_schema": fmt.schema_text() if fmt is not None else None,
            **self._logprob_params(),
        }

    def _logprob_params(self) -> dict[str, Any]:
        raise NotImplementedError  # each endpoint spells them its own way

    # <<< ch25


class CompletionRequest(_Common):
    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]]
    echo: bool = False  # the prompt comes back before the completion
    max_tokens: int | None = Field(16, ge=0, lt=INT64_END)  # 0 with echo: score the prompt
    logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("max_tokens")
    @classmethod
    def _zero_with_echo(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens must be >= 1 (0 only with echo, to score the prompt)")
        return v

    def max_new_tokens(self) -> int | None:
        # A prefill always samples a token: with max_tokens 0 one is made, and not shown.
        return 1 if self.max_tokens == 0 else self.max_tokens

    # >>> ch25
    def _logprob_params(self) -> dict[str, Any]:
        # logprobs N: the chosen token's and the N likeliest; with echo, the prompt's too.
        return {
            "top_logprobs": self.logprobs or 0,
            "prompt_logprobs": self.echo and self.logprobs is not None,
        }

    # <<< ch25

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        # A list of several prompts is a batch; we take one prompt per request.
        if isinstance(v, list) and v and isinstance(v[0], str | list):
            if len(v) != 1:
                raise ValueError("send one prompt per request")
            v = v[0]
        if not v:
            raise ValueError("the prompt is empty")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[dict[str, Any]]

    @model_validator(mode="after")
    def _text_only(self) -> ChatMessage:
        self.text()  # raises for parts that are not text
        return self

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(_unicode(part["text"]))
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, lt=INT64_END)
    max_completion_tokens: int | None = Field(None, ge=1, lt=INT64_END)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    # Tool calling is not implemented: refused, rather than silently answered without tools.
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None  # the deprecated spelling of tools
    function_call: Any = None

    @field_validator("tools", "tool_choice", "functions", "function_call")
    @classmethod
    def _no_tools(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError("tool calling is not supported by this server; leave it out or null")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def _logprob_params(self) -> dict[str, Any]:  # [ch25]
        return {"top_logprobs": self.top_logprobs or 0}  # [ch25]

    def plain_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]
