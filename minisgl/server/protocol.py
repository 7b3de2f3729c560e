"""The OpenAI request bodies we accept, validated field by field.

Fields we do not know are ignored, as OpenAI-compatible servers do; fields we know must
have the right type and range, or the client gets a 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from minisgl.core import SamplingParams

UNLIMITED = 1 << 30  # "until EOS or the end of the context"


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    skip_special_tokens: bool = True

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (no limit) or >= 1")
        return v

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

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
        )


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=1)  # we report the chosen token's only
    echo: Literal[False] = False

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
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0)  # only the chosen token's

    @model_validator(mode="after")
    def _content(self) -> ChatCompletionRequest:
        for m in self.messages:
            m.text()  # raises for non-text parts
        return self

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def plain_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]
