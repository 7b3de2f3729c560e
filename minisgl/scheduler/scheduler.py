"""The scheduler: continuous batching over one Engine.

Each step picks a batch (a prefill if any request waits and fits, else one decode step for
every running request), launches its forward, and turns the sampled tokens into messages.
Requests join and leave between any two steps: that is continuous batching.
"""

# >>> ch12 overlap scheduling
# With overlap scheduling the step launches batch N+1 *before* it reads batch N's tokens,
# so the host's bookkeeping for N (detokenizing, finishing, freeing) runs while the device
# computes N+1. The host state is then one step behind: a request that ends at N may sit
# in batch N+1, whose extra token is dropped, never sent and never freed twice. Overlap is
# on by default only on CUDA: a CPU computes the forward itself, so it has nothing to hide
# host work behind, and each result would only come out a step later.
# <<< ch12

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from minisgl.core import Batch, Req
from minisgl.engine.engine import Engine
from minisgl.engine.sampler import ForwardOutput, StepLogits
from minisgl.env import ENV  # [ch12]
from minisgl.message.backend import AbortMsg, TokenMsg, UserMsg
from minisgl.scheduler.cache import CacheManager
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.decode import DecodeManager
from minisgl.scheduler.grammar import Grammars  # [ch25]
from minisgl.scheduler.grammar_pool import GrammarPool  # [ch25]
from minisgl.scheduler.hybrid_cache import hybrid_cache  # [ch31]
from minisgl.scheduler.logprobs import LogprobCollector  # [ch25]
from minisgl.scheduler.prefill import PendingReq, PrefillManager
from minisgl.scheduler.table import TableManager
from minisgl.scheduler.window_cache import window_cache  # [ch29]
from minisgl.speculative.step import Speculator  # [ch26]

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class InFlight:
    batch: Batch
    output: ForwardOutput | None  # None until sampled
    emits: list[bool]  # which requests' tokens are real (not a mid-prompt chunk)
    logits: StepLogits | None = None  # the forward, while its sampling waits
    finish: Callable[[], list[TokenMsg]] | None = None  # a verify's: reads its tokens  # [ch26]


class StepListener(Protocol):
    """Told of every forward the scheduler runs (the live page's step log is one)."""

    def forward_begins(self, batch: Batch) -> None: ...

    def forward_launched(self, batch: Batch) -> None: ...


class Scheduler:
    def __init__(self, config: SchedulerConfig, eos_token_ids: set[int]) -> None:
        self.engine = engine = Engine(config)
        self.limits = limits = engine.limits  # what the engine holds, in numbers
        self.eos_token_ids = frozenset(eos_token_ids)
        self.table = TableManager(limits.max_running_req, engine.token_pool)
        cache_type = config.cache_type
        self.cache = CacheManager(limits.num_pages, limits.page_size, engine.page_table, cache_type)
        self.cache = hybrid_cache(self.cache, engine.state_pool)  # with state snapshots  # [ch31]
        self.cache = window_cache(self.cache, engine.kv_cache)  # sliding layers' pages  # [ch29]
        self.prefill = PrefillManager(self.cache, self.table, config.max_prefill_length)
        self.decode = DecodeManager()
        self.reqs: dict[int, Req] = {}  # admitted and not finished, by uid
        disabled = ENV.DISABLE_OVERLAP_SCHEDULING.value  # [ch12]
        self.overlap = engine.device.type == "cuda" if disabled is None else not disabled  # [ch12]
        self._in_flight: InFlight | None = None
        self._drained: list[TokenMsg] = []  # results processed early, to hand out next
        self.num_preemptions = 0
        self.listeners: list[StepListener] = []  # registered by whoever watches the steps
        self.grammars = Grammars(config.model_path, limits.vocab_size, eos_token_ids)  # [ch25]
        self.grammar_pool = GrammarPool(self.grammars, config.grammar_compile_timeout)  # [ch25]
        self.logprobs = LogprobCollector()  # [ch25]
        self.spec = Speculator(self, config)  # [ch26]

    # ---- requests in ----------------------------------------------------------------------

    def receive(self, messages: list[Any]) -> list[TokenMsg]:
        """Apply new messages; the refusals of requests that can never run come back."""
        refused = []
        for msg in messages:
            if isinstance(msg, AbortMsg):
                self.abort(msg)
            elif isinstance(msg, UserMsg):
                try:
                    self.add_request(msg)
                except ValueError as e:  # the tokenizer checks first; this is the last line
                    refused.append(TokenMsg(msg.uid, -1, True, None, 0, error=str(e)))
        return refused

    def validate(self, msg: UserMsg) -> None:
        """Raise ValueError if the request can never run; nothing is changed."""
        self.limits.check_prompt(msg.input_ids)
        self.grammars.check(msg.sampling_params)  # [ch25]

    def add_request(self, msg: UserMsg) -> None:
        self.validate(msg)
        max_len = min(len(msg.input_ids) + msg.sampling_params.max_tokens, self.limits.max_req_len)
        ids = torch.tensor(msg.input_ids, dtype=torch.int32)
        pending = PendingReq(msg.uid, ids, msg.sampling_params, max_len, len(ids))
        if self.grammar_pool.hold(pending):  # it queues once its grammar is in  # [ch25]
            return  # [ch25]
        self.prefill.add(pending)

    def abort(self, msg: AbortMsg) -> None:
        for pending in list(self.prefill.pending):
            if pending.uid == msg.uid:
                self.prefill.pending.remove(pending)
                self.grammars.remove(msg.uid)  # [ch25]
        self.grammar_pool.drop(msg.uid)  # [ch25]
        req = self.reqs.get(msg.uid)
        if req is not None:
            self._finish(req)

    @property
    def has_work(self) -> bool:
        if self.grammar_pool.waiting:  # [ch25]
            return True  # [ch25]
        return self.prefill.has_work or self.decode.has_work or self._in_flight is not None

    # ---- one step -------------------------------------------------------------------------

    def step(self) -> list[TokenMsg]:
        self._drained += self._admit_compiled()  # [ch25]
        batch = self._schedule()
        messages, self._drained = self._drained, []
        if batch is not None and (verified := self.spec.try_step(batch)) is not None:  # [ch26]
            return messages + verified  # [ch26]
        return messages + self.run(batch)

    # >>> ch25
    def _admit_compiled(self) -> list[TokenMsg]:
        """Requests whose grammar is in join the queue; those whose grammar failed are refused."""
        idle = not (self.prefill.has_work or self.decode.has_work or self._in_flight)
        refused = []
        for pending, grammar, error in self.grammar_pool.admit(idle):
            if grammar is None:
                refused.append(TokenMsg(pending.uid, -1, True, None, 0, error=error))
            else:
                self.prefill.add(pending)
                self.grammars.add(pending.uid, grammar)
        return refused

    # <<< ch25
    def _schedule(self) -> Batch | None:
        reserve = len(self.decode.running)
        if self.prefill.has_work and (scheduled := self.prefill.schedule(reserve)) is not None:
            batch, admitted = scheduled
            for req in admitted:
                self.reqs[req.uid] = req
            return batch
        batch = self.decode.schedule()
        if batch is not None and not self._fits(batch):
            self._drained += (
                self.drain()
            )  # finished requests may free pages; victims must be current
            batch = self.decode.schedule()
            while batch is not None and not self._fits(batch):
                self._preempt(self.decode.running[-1])
                batch = self.decode.schedule()
        return batch

    def _fits(self, batch: Batch) -> bool:
        needed = sum(self.cache.pages_needed(r, r.device_len) for r in batch.reqs)
        return needed <= self.cache.available_pages

    def _preempt(self, victim: Req) -> None:
        """Out of KV pages: send a request back to the queue, to be recomputed later."""
        logger.info("KV cache full: preempting request %d to recompute later", victim.uid)
        self.num_preemptions += 1
        self._release(victim)
        del self.reqs[victim.uid]
        pending = PendingReq(
            victim.uid,
            victim.input_ids,
            victim.sampling_params,
            victim.max_device_len,
            victim.prompt_len,
            cached_tokens=victim.cached_tokens,
        )
        self.prefill.add(pending, front=True)

    # ---- the parts of a step (the speculative step is made of them too) -------------------

    @property
    def in_flight(self) -> InFlight | None:
        """The step launched and not yet processed, if there is one."""
        return self._in_flight

    def run(self, batch: Batch | None) -> list[TokenMsg]:
        """Launch `batch` as a plain step; the tokens ready now come back."""
        launched = self.launch(batch) if batch is not None else None
        # >>> ch12 overlap: launch N+1, then process N while the device computes; N+1's
        # tokens come back with the next step
        if self.overlap:
            messages = self.drain()
            if launched is not None and launched.output is None:  # [ch25]
                self.grammars.sample(launched, self.engine)  # N's tokens are in  # [ch25]
            self._in_flight = launched
            return messages
        # <<< ch12
        return self.process(launched) if launched else []

    def launch(self, batch: Batch) -> InFlight:
        """Give the batch its pages and start its forward; lengths move on now."""
        emits = [not req.mid_prompt for req in batch.reqs]
        flight = self.forward(batch, lambda: self._forward(batch, emits))
        for req, emit in zip(batch.reqs, emits):
            if emit:
                req.complete_one()
            else:
                req.cached_len = req.device_len  # a chunk done; the prompt goes on
        if batch.is_prefill:
            for req in batch.reqs:
                self.cache.cache_req(req, finished=False)  # later prompts may share it now
            self.decode.add([r for r, emit in zip(batch.reqs, emits) if emit])
        return flight

    def forward(self, batch: Batch, compute: Callable[[], T]) -> T:
        """Allocate the batch's pages, prepare it and `compute` its forward; the listeners
        are told when it begins and once it is launched."""
        self.cache.allocate(batch.reqs)
        for listener in self.listeners:
            listener.forward_begins(batch)
        self.engine.prepare_batch(batch)
        out = compute()
        for listener in self.listeners:
            listener.forward_launched(batch)
        return out

    def _forward(self, batch: Batch, emits: list[bool]) -> InFlight:
        if self.grammars.constrains(batch.reqs):  # masked once the step before is in  # [ch25]
            return InFlight(batch, None, emits, self.engine.forward_logits(batch))  # [ch25]
        return InFlight(batch, self.engine.forward_batch(batch), emits)

    def process(self, flight: InFlight) -> list[TokenMsg]:
        """Wait for a launched step's tokens and emit each real one."""
        if flight.finish is not None:  # a verify left in flight (speculative/step.py)  # [ch26]
            return flight.finish()  # [ch26]
        if flight.output is None:  # without overlap, the step before is processed  # [ch25]
            self.grammars.sample(flight, self.engine)  # [ch25]
        output = flight.output
        assert output is not None, "a step is processed only once it is sampled"
        if output.copy_done is not None:
            output.copy_done.synchronize()
        self.logprobs.gather(flight.batch.reqs, output, self.reqs)  # [ch25]
        messages = []
        rows = zip(flight.batch.reqs, flight.emits, output.next_tokens_cpu.tolist())
        for i, (req, emit, token) in enumerate(rows):
            if emit and self.reqs.get(req.uid) is req:  # not a chunk's, nor a finished one's
                messages.append(self.emit(req, token, output, i))
        return messages

    # >>> ch26
    def hand_over(self, finish: Callable[[], list[TokenMsg]]) -> None:
        """Leave a step launched elsewhere in flight (a verify): the next drain calls
        `finish` for its tokens."""
        assert self._in_flight is None, "one step in flight at a time"
        self._in_flight = InFlight(Batch([], "decode"), None, [], finish=finish)

    # <<< ch26
    def drain(self) -> list[TokenMsg]:
        """Process the step in flight, if one is: nothing is in flight after."""
        flight, self._in_flight = self._in_flight, None
        return self.process(flight) if flight is not None else []

    def emit(
        self, req: Req, token: int, output: ForwardOutput | None = None, row: int = 0
    ) -> TokenMsg:
        """A request's next token: appended, its finish decided, its message made (with the
        log-probabilities it asked for, from `output`'s `row`); a finished request leaves."""
        req.append_host(token)
        reason = self._finish_reason(req, token)
        msg = TokenMsg(req.uid, token, reason is not None, reason, req.cached_tokens)
        if output is not None:
            if req.sampling_params.logprobs and output.logprobs_cpu is not None:
                msg.logprob = output.logprobs_cpu[row].item()
            self.logprobs.attach(msg, req, output, row)  # [ch25]
        if reason is not None:
            self._finish(req)
        return msg

    def _finish_reason(self, req: Req, token: int) -> str | None:
        params = req.sampling_params
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
        ):
            return "stop"
        if self.grammars.accept(req.uid, token):  # the document is complete  # [ch25]
            return "stop"  # [ch25]
        if req.seq_len >= req.max_device_len:
            return "length"
        return None

    def _finish(self, req: Req) -> None:
        self._release(req)
        del self.reqs[req.uid]
        self.grammars.remove(req.uid)  # [ch25]
        self.logprobs.remove(req.uid)  # [ch25]

    def _release(self, req: Req) -> None:
        """Give back the request's row and pages (its computed prefix stays cached)."""
        if req is self.prefill.chunked:
            self.prefill.chunked = None
        if req in self.decode.running:
            self.decode.remove(req)
        self.cache.cache_req(req, finished=True)
        self.table.free(req.table_idx)
        self.spec.release(req.uid)  # a draft model's pages for it go back too  # [ch26]

    # ---- checks ---------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Every KV page accounted for exactly once; radix reference counts consistent."""
        self.cache.check_integrity(list(self.reqs.values()))
        rows = self.table.available + len(self.reqs)
        assert rows == self.limits.max_running_req, f"rows leaked: {rows} accounted"

    def shutdown(self) -> None:
        self.drain()
        self.grammar_pool.shutdown()  # [ch25]
        self.spec.shutdown()  # [ch26]
        self.engine.shutdown()
