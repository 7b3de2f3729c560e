"""The prefill manager: which waiting requests start now, and how much of each prompt.

A prefill batch holds about `max_prefill_length` new tokens. Requests are admitted in
arrival order while there is a free row, enough KV pages, and budget left; a prompt that
does not fit the remaining budget is cut, and its next chunk leads the next prefill.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from minisgl.core import Batch, Req, SamplingParams
from minisgl.scheduler.cache import CacheManager
from minisgl.scheduler.logprobs import prompt_logprobs_due  # [ch25]
from minisgl.scheduler.table import TableManager
from minisgl.utils import cdiv, common_prefix_len

# A waiting request that shares at least this many not-yet-cached prompt tokens with one
# already in the batch waits one round, then finds them in the prefix cache.
_SHARED_PREFIX_TO_WAIT = 32


@dataclass
class PendingReq:
    uid: int
    input_ids: torch.Tensor  # int32, host: the prompt (or, after preemption, prompt + output)
    sampling_params: SamplingParams
    max_device_len: int  # prompt + max_tokens, capped by the context
    prompt_len: int  # the original prompt's length (input_ids grows if preempted)
    cached_tokens: int | None = None  # set once admitted: prompt tokens the cache served


class PrefillManager:
    def __init__(self, cache: CacheManager, table: TableManager, max_prefill_length: int) -> None:
        self.cache, self.table = cache, table
        self.max_prefill_length = max_prefill_length
        self.pending: deque[PendingReq] = deque()
        self.chunked: Req | None = None  # a request part-way through its prompt
        self.cached_tokens_total = 0  # prompt tokens served from the cache, over all requests

    def add(self, pending: PendingReq, front: bool = False) -> None:
        if front:
            self.pending.appendleft(pending)
        else:
            self.pending.append(pending)

    @property
    def has_work(self) -> bool:
        return bool(self.pending) or self.chunked is not None

    def schedule(self, reserve_pages: int) -> tuple[Batch, list[Req]] | None:
        """The next prefill batch and its newly admitted requests, or None.

        `reserve_pages` is kept free for the running decode requests' next step.
        """
        budget = self.max_prefill_length
        reqs: list[Req] = []
        admitted: list[Req] = []
        # >>> ch10 a chunked prompt goes on first
        if self.chunked is not None:
            req = self.chunked
            n = min(req.seq_len - req.cached_len, budget)
            if self.cache.pages_needed(req, req.cached_len + n) > self.cache.available_pages:
                return None  # the decode side must free pages first
            req.device_len = req.cached_len + n
            self.cache.allocate([req])
            reqs.append(req)
            budget -= n
        # <<< ch10
        heads: dict[tuple, list[Req]] = {}
        for req in reqs:
            heads.setdefault(_head(req.input_ids), []).append(req)
        for pending in list(self.pending):
            if budget == 0 or self.table.available == 0:
                break
            if self._shares_uncached_prefix(pending, heads):
                continue
            req = self._admit(pending, budget, reserve_pages)
            if req is None:
                break
            self.pending.remove(pending)
            reqs.append(req)
            admitted.append(req)
            heads.setdefault(_head(req.input_ids), []).append(req)
            budget = max(0, budget - req.extend_len)
            budget = 0 if req.mid_prompt else budget  # one prompt is cut at a time  # [ch31]
        self.chunked = next((r for r in reqs if r.mid_prompt), None)  # [ch10]
        return (Batch(reqs, "prefill"), admitted) if reqs else None

    def _admit(self, pending: PendingReq, budget: int, reserve_pages: int) -> Req | None:
        """Start `pending` now, or return None if the KV cache cannot take it yet."""
        ids = pending.input_ids
        wants_prompt_logprobs = prompt_logprobs_due(pending)  # [ch25]
        if wants_prompt_logprobs:  # every position's logits: none from the cache  # [ch25]
            ids = ids[:1]  # matches nothing: the last token is always computed  # [ch25]
        match = self.cache.match(ids)
        n = len(pending.input_ids) - match.length
        n = min(n, budget)  # cut to the budget; the rest comes in the next rounds  # [ch10]
        n = min(n, match.stop - match.length) if match.stop else n  # to save a state  # [ch31]
        pages = cdiv(match.length + n, self.cache.page_size) - match.length // self.cache.page_size
        self.cache.cache.lock(match.node)  # so the check below does not count it as evictable
        fits = pages + reserve_pages <= self.cache.available_pages
        self.cache.cache.unlock(match.node)
        if not fits:
            return None
        row = self.table.alloc(pending.input_ids)
        output_len = pending.max_device_len - len(pending.input_ids)
        req = Req(
            pending.input_ids, row, match.length, output_len, pending.uid, pending.sampling_params
        )
        req.prompt_len = pending.prompt_len
        req.wants_prompt_logprobs = wants_prompt_logprobs  # [ch25]
        if pending.cached_tokens is None:  # first admission (not a preempted request's return)
            req.cached_tokens = match.length
            self.cached_tokens_total += match.length
        else:
            req.cached_tokens = pending.cached_tokens
        self.cache.attach(req, match)
        req.device_len = match.length + n
        self.cache.allocate([req])
        return req

    def _shares_uncached_prefix(self, pending: PendingReq, heads: dict[tuple, list[Req]]) -> bool:
        # Only requests whose first _SHARED_PREFIX_TO_WAIT tokens are the same can share that
        # many: looking them up by those tokens keeps admission linear in the batch size.
        ids = pending.input_ids
        for req in heads.get(_head(ids), ()):
            if common_prefix_len(ids, req.input_ids) - req.cached_len >= _SHARED_PREFIX_TO_WAIT:
                return True
        return False


def _head(ids: torch.Tensor) -> tuple[int, ...]:
    return tuple(ids[:_SHARED_PREFIX_TO_WAIT].tolist())
