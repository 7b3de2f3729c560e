"""The API server's part of chapter 25: logprobs in full, and echo.

A choice keeps, for each logprob, the token's own bytes, the likeliest alternatives and
where its text starts; completions show them as `top_logprobs` and `text_offset`, chat as
`bytes` and `top_logprobs` per token. With echo the prompt comes back first, its tokens'
logprobs ahead of the completion's. `max_tokens` 0 with echo scores the prompt alone: a
prefill always samples a token, and that one is not shown.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from minisgl.message.frontend import DeltaMsg
from minisgl.message.logprobs import TokenLogprob

if TYPE_CHECKING:
    from minisgl.server.frontend import Choice


@dataclass
class FullChoice:
    """What a choice keeps beyond its text and its tokens' logprobs."""

    details: list[TokenLogprob] = field(default_factory=list)  # per logprob: bytes, alternatives
    offsets: list[int] = field(default_factory=list)  # per logprob: where its text starts
    text_end: int = 0  # the length of the text so far, echo included
    echo: str | None = None  # the prompt, sent back before the completion
    prompt: list[TokenLogprob] = field(default_factory=list)  # and its tokens' logprobs
    hidden: bool = False  # max_tokens 0 with echo: the one token generated is not shown

    def record(self, delta: DeltaMsg) -> None:
        """Take the prompt from a choice's first delta, hide what max_tokens 0 must not
        show, and keep each logprob's details; before the choice counts the delta."""
        if delta.prompt_text is not None:
            self.echo, self.text_end = delta.prompt_text, len(delta.prompt_text)
        if delta.prompt_logprobs is not None:
            self.prompt = delta.prompt_logprobs
        if self.hidden:
            delta.text, delta.token, delta.logprob = "", None, None
            delta.finish_reason = "length"
        if delta.token is not None and delta.logprob is not None:
            token = delta.token_text or ""
            top = delta.top_logprobs or []
            raw = delta.token_bytes if delta.token_bytes is not None else list(token.encode())
            self.details.append(TokenLogprob(token, delta.logprob, raw, top))
            self.offsets.append(self.text_end)
            self.text_end += len(token)


def add_chat_details(content: list[dict[str, Any]], details: list[TokenLogprob]) -> None:
    """Each chat token's own bytes, and the likeliest tokens in its place."""
    for entry, d in zip(content, details):
        entry["bytes"] = d.bytes
        entry["top_logprobs"] = [
            {"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in d.top
        ]


def completion_details(full: FullChoice, start: int) -> dict[str, Any]:
    """Completions' alternatives and text offsets of the logprobs from `start` on."""
    return {
        "top_logprobs": [_top_dict(d) for d in full.details[start:]],
        "text_offset": full.offsets[start:],
    }


def echo_choice(c: Choice, logprobs: bool) -> dict[str, Any]:
    """The streamed chunk that carries the prompt, ahead of the completion's."""
    lp = echo_logprobs(c.full) if logprobs else None
    return {"index": c.index, "text": c.full.echo, "finish_reason": None, "logprobs": lp}


def add_echo(body: dict[str, Any], full: FullChoice, logprobs: bool) -> None:
    """The prompt ahead of a whole completion's text, and its logprobs ahead of the rest."""
    if full.echo is None:
        return
    body["text"] = full.echo + body["text"]
    if logprobs:
        echoed = echo_logprobs(full)
        body["logprobs"] = {k: v + body["logprobs"][k] for k, v in echoed.items()}


def echo_logprobs(full: FullChoice) -> dict[str, Any]:
    offsets = itertools.accumulate((len(p.token) for p in full.prompt), initial=0)
    return {
        "token_logprobs": [p.logprob for p in full.prompt],
        "tokens": [p.token for p in full.prompt],
        "top_logprobs": [None if p.logprob is None else _top_dict(p) for p in full.prompt],
        "text_offset": list(offsets)[: len(full.prompt)],
    }


def _top_dict(t: TokenLogprob) -> dict[str, float | None]:
    """Completions' shape of the alternatives: text -> logprob, the chosen token's included."""
    top: dict[str, float | None] = {alt.token: alt.logprob for alt in t.top}
    top.setdefault(t.token, t.logprob)
    return top
