"""Messages between the API server and the tokenizer worker."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minisgl.message.logprobs import TokenLogprob  # [ch25]
from minisgl.sampling_params import SamplingParams


@dataclass
class TokenizeMsg:
    """A request as the API received it: text, chat messages, or token ids."""

    uid: int
    sampling_params: SamplingParams
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None
    template_vars: dict[str, Any] = field(default_factory=dict)  # for the chat template: tools
    stop: list[str] = field(default_factory=list)  # cut the text here, and end the request
    skip_special_tokens: bool = True
    echo: bool = False  # send the prompt's text back with the first delta  # [ch25]


@dataclass
class AcceptedMsg:
    """The prompt is tokenized and valid; tokens will follow."""

    uid: int
    prompt_tokens: int
    # a chat answer's reasoning: "open" (its prompt opened a think block), "may" (the
    # template knows one; the answer may open it), None (answers stay as they are)  # [ch25]
    thinking: str | None = None  # [ch25]
    think_style: str = "think"  # <think>...</think>, or "channel": Gemma 4's  # [ch25]


@dataclass
class RejectedMsg:
    """The request cannot run; `message` says why (for a 400, or a 500 where it hit a bug)."""

    uid: int
    message: str
    code: str | None = None  # OpenAI's machine-readable reason, e.g. "context_length_exceeded"
    status: int = 400


@dataclass
class DeltaMsg:
    """New text for one request; the last one has `finished` set."""

    uid: int
    text: str
    token: int | None  # None when the delta comes from cutting at a stop string
    token_text: str | None  # the token alone, decoded (for logprobs)
    logprob: float | None
    finished: bool
    finish_reason: str | None
    cached_tokens: int
    token_bytes: list[int] | None = None  # its own bytes (UTF-8 may span tokens)  # [ch25]
    top_logprobs: list[TokenLogprob] | None = None  # [ch25]
    prompt_text: str | None = None  # echo, on the first delta: the prompt  # [ch25]
    prompt_logprobs: list[TokenLogprob] | None = None  # the first's logprob is None  # [ch25]


@dataclass
class ReadyMsg:
    """A worker finished starting; `info` carries what the others need to know."""

    worker: str
    info: dict[str, Any] = field(default_factory=dict)
