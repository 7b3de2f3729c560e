"""The logprobs that messages carry beyond the chosen token's own: chapter 25's full API.

Two shapes, one per side of the tokenizer worker: the scheduler sends token ids with their
log-probabilities (`PromptLogprobs`, and the alternatives inside `TokenMsg`); the worker
turns each id into the text and bytes the API shows (`TokenLogprob`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PromptLogprobs:
    """How likely each prompt token was after the ones before it (the first has no value)."""

    token_ids: list[int]  # the whole prompt
    logprobs: list[float]  # one per token after the first
    top_ids: list[list[int]]  # per token after the first: the likeliest tokens there
    top_logprobs: list[list[float]]


@dataclass
class TokenLogprob:
    """One token, how likely it was, and (for a chosen token) the likeliest alternatives."""

    token: str
    logprob: float | None
    bytes: list[int]
    top: list[TokenLogprob] = field(default_factory=list)
