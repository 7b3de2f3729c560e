"""SamplingParams: how one request picks its tokens, checked where it is built.

Its own module, free of torch, because it travels: the API server builds it from a request's
body and sends it, through the tokenizer worker, to the scheduler. Neither of the first two
computes anything with tensors, and importing torch would cost them seconds at start-up.
"""

from __future__ import annotations

import json  # [ch25]
from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20  # as OpenAI's API  # [ch25]


@dataclass
class SamplingParams:
    """How to pick tokens for one request. temperature 0 (or top_k 1) means greedy."""

    temperature: float = 0.0
    top_k: int = -1  # -1: no limit
    top_p: float = 1.0
    max_tokens: int = 1024
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None  # same seed, same prompt -> same tokens, whatever the batch
    presence_penalty: float = 0.0  # OpenAI's: on tokens generated so far
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # the multiplicative one, on prompt and output tokens
    logprobs: bool = False  # report the log-probability of each chosen token
    # >>> ch25 the rest of the OpenAI API
    top_logprobs: int = 0  # and of the most likely alternatives at each such position
    prompt_logprobs: bool = False  # and of every prompt token after the first (echo)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    json_schema: str | None = None  # the output must be JSON that this schema accepts
    # <<< ch25

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (no limit) or >= 1, got {self.top_k}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        self._check_api_fields()  # [ch25]

    # >>> ch25
    def _check_api_fields(self) -> None:
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        if self.top_logprobs and not (self.logprobs or self.prompt_logprobs):
            raise ValueError("top_logprobs needs logprobs or prompt_logprobs")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys are token ids (ints >= 0), got {token!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except ValueError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError("json_schema must be a JSON object")

    # <<< ch25

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )
