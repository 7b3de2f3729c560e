"""EngineLimits: what an engine can hold, as plain numbers that anyone may read or send.

The scheduler plans with these numbers and no others; the tokenizer worker, in a process
of its own, gets them in the scheduler's ready message (a plain map) and refuses a prompt
that can never run before it costs the scheduler anything. Both refuse with the same
`check_prompt`, so a prompt is turned away with the same words wherever that happens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

UNLIMITED = 1 << 30  # a max_tokens this large means: until EOS or the end of the context


class PromptTooLong(ValueError):
    """The prompt does not fit the context or the KV cache."""

    code = "context_length_exceeded"  # OpenAI's name for it, in the API's error body


@dataclass(frozen=True)
class EngineLimits:
    max_seq_len: int  # the context: a prompt plus everything generated after it
    num_pages: int  # pages of the KV cache
    page_size: int  # tokens per page
    max_running_req: int  # rows of the page table and token pool: requests at once
    vocab_size: int

    @property
    def max_kv_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def max_req_len(self) -> int:
        """How long one request may grow: the context, or the whole KV cache if smaller
        (beyond it, even running alone, it could never get another page)."""
        return min(self.max_seq_len, self.max_kv_tokens)

    def check_prompt(self, ids: Sequence[int], max_tokens: int = UNLIMITED) -> None:
        """Raise ValueError (PromptTooLong if it is too long) for a prompt that can never run,
        or (with a `max_tokens` short of UNLIMITED: the API's) never run to its end."""
        n = len(ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.max_seq_len:
            raise PromptTooLong(
                f"the prompt has {n} tokens; this model's context is {self.max_seq_len} "
                "tokens, including at least one generated token"
            )
        if n >= self.max_kv_tokens:
            raise PromptTooLong(
                f"the prompt has {n} tokens; the KV cache holds {self.max_kv_tokens} tokens, "
                "including at least one generated token"
            )
        if not all(0 <= t < self.vocab_size for t in ids):
            raise ValueError(
                f"the prompt has token ids outside the vocabulary [0, {self.vocab_size})"
            )
        if max_tokens < UNLIMITED and n + max_tokens > self.max_seq_len:
            raise PromptTooLong(
                f"the prompt has {n} tokens and max_tokens is {max_tokens}: {n + max_tokens} in"
                f" all, more than this model's context of {self.max_seq_len} tokens; lower"
                " max_tokens, or leave it out to generate until the context ends"
            )

    def to_dict(self) -> dict[str, int]:
        """Plain data for msgpack (a ready message, a broadcast); never pickle."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineLimits:
        return cls(**data)
