"""Messages to and from the scheduler. Plain data, so they can cross a process boundary."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.core import SamplingParams


@dataclass
class UserMsg:
    """A new request, already tokenized."""

    uid: int
    input_ids: list[int]
    sampling_params: SamplingParams


@dataclass
class AbortMsg:
    uid: int


@dataclass
class TokenMsg:
    """One generated token of one request."""

    uid: int
    token: int
    finished: bool
    finish_reason: str | None  # "stop" (EOS or a stop token) or "length"
    cached_tokens: int  # prompt tokens served from the prefix cache
