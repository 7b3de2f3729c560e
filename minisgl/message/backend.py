"""Messages to and from the scheduler. Plain data, so they can cross a process boundary."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.message.dashboard import DashboardSnapshot, WatchMsg  # noqa: F401  # [ch30]
from minisgl.message.logprobs import PromptLogprobs  # [ch25]
from minisgl.sampling_params import SamplingParams


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
    """One generated token of one request (or, with `error`, its refusal)."""

    uid: int
    token: int
    finished: bool
    finish_reason: str | None  # "stop" (EOS or a stop token) or "length"
    cached_tokens: int  # prompt tokens served from the prefix cache
    logprob: float | None = None
    error: str | None = None
    top_ids: list[int] | None = None  # the likeliest tokens here, best first  # [ch25]
    top_logprobs: list[float] | None = None  # [ch25]
    prompt_logprobs: PromptLogprobs | None = None  # with the request's first token  # [ch25]


# >>> ch21
@dataclass
class StopMsg:
    """From rank 0 to the other ranks: leave the loop (the offline LLM is shutting down)."""


# <<< ch21
# >>> ch27
@dataclass
class FlushCacheMsg:
    """From the API server straight to the scheduler: empty the prefix cache, if idle."""


# <<< ch27
@dataclass
class SchedulerStats:
    running: int
    queued: int
    kv_pages_total: int
    kv_pages_in_use: int  # held by running requests (cached, evictable pages count as free)
    cached_tokens_total: int  # prompt tokens served from the prefix cache so far
    preemptions_total: int
    spec_drafted_total: int = 0  # draft tokens proposed so far  # [ch26]
    spec_accepted_total: int = 0  # [ch26]
    spec_accepted_lengths: list[int] | None = None  # [n]: verifies that took n drafts  # [ch26]
    queued_tokens: int = 0  # prompt tokens of the queued requests  # [ch27]
    cache_flushes_total: int = 0  # [ch27]


@dataclass
class SchedulerOutput:
    """What the scheduler sends after a step: the tokens, and how it is doing."""

    tokens: list[TokenMsg]
    stats: SchedulerStats
    dashboard: DashboardSnapshot | None = None  # while a page watches  # [ch30]
