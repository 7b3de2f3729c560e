"""The scheduler's speculative decode step: drafts, one verify forward, acceptance.

A decode step of a small model is bound by kernel launches, not by arithmetic, so a
forward over a few tokens per request costs little more than over one. Each request
proposes up to k tokens (here by n-gram lookup in its own text), the verify batch runs
the model over its last token and the drafts, and `accept_drafts` keeps the longest run
the model agrees with plus the model's own next token: one to k + 1 tokens per request
per step, exactly those decoding without drafts would give.

Around the forward, the bookkeeping of a decode step: the drafts go into the token pool
and get KV pages; after acceptance the request's lengths cover only what was accepted,
the pages of rejected drafts go back, and the radix cache only ever sees accepted tokens
(it caches up to `cached_len`).

How many drafts a request proposes, and whether it proposes any, follows from its own
measured acceptance and the measured step costs (acceptance.py, cost.py). The step is taken
only where it is exact and pays: no grammar or log-probabilities in the batch (they take
the plain step), at least one draft, and at most `speculative_max_bs` requests: a bound a
user may set; below it, what a verify costs at the batch's size, measured, decides.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from minisgl.core import Batch, Req
from minisgl.message.backend import TokenMsg
from minisgl.scheduler.config import SchedulerConfig
from minisgl.speculative.acceptance import Acceptance
from minisgl.speculative.cost import StepCosts
from minisgl.speculative.draft_model import DraftModelDrafter
from minisgl.speculative.ngram import NgramDrafter
from minisgl.speculative.suffix import SuffixDrafter
from minisgl.speculative.verify import VerifyRows, accept_into_pool
from minisgl.utils import to_device, to_host

if TYPE_CHECKING:
    from minisgl.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class Speculator:
    def __init__(self, scheduler: Scheduler, config: SchedulerConfig) -> None:
        self.scheduler = scheduler
        self.enabled = config.speculative != "off"
        self.max_drafts, self.max_bs = config.num_draft_tokens, config.speculative_max_bs
        self.always = config.speculative_always  # no measuring: every draft is verified
        self.drafter: NgramDrafter | DraftModelDrafter | SuffixDrafter = NgramDrafter()
        if config.speculative == "draft":  # a smaller model's greedy tokens
            self.drafter = DraftModelDrafter(config, scheduler.engine)
        elif config.speculative == "suffix":  # this request's and earlier requests' text
            self.drafter = SuffixDrafter()
        self.acceptance = Acceptance(self.max_drafts)  # per request: rate, switch-off
        # Drafts proposed and accepted, requests verified, and verify forwards run.
        self.num_drafted = self.num_accepted = self.num_steps = self.num_forwards = 0
        self.accepted_lengths = [0] * (self.max_drafts + 1)  # verifies by drafts accepted
        self.skipped: set[str] = set()  # why some batches took the plain step, said once
        self.costs = StepCosts()  # what verify and plain steps cost, measured
        self.drained = False  # this step drained the pipeline for a verify

    def try_step(self, batch: Batch) -> list[TokenMsg] | None:
        """Run `batch` (a decode batch) as a verify step and return its tokens; None when
        it should be a plain decode step instead, and nothing was done.

        Drafts are made from a request's tokens on the host, so a verify step needs the
        step before it processed. With overlap scheduling that step is still in flight:
        plain steps keep overlapping, and only where the host's (one step old) tokens
        already draft something worth a verify step is the pipeline drained for one."""
        began, takes, forwards = time.perf_counter(), self._takes(batch), self.num_forwards
        self.drained = False
        out = self._try(batch) if takes else None
        kind = "verify" if self.num_forwards > forwards else "drained" if self.drained else "plain"
        self.costs.start(kind if takes else None, batch.size, now=began)  # from its beginning
        return out

    def _try(self, batch: Batch) -> list[TokenMsg] | None:
        s = self.scheduler
        drafts, _ = self._draft(batch.reqs)
        if not self._pays(batch.reqs, drafts):
            return None
        messages: list[TokenMsg] = []
        if s.in_flight is not None:
            stale = {r.uid: d[0] for r, d in zip(batch.reqs, drafts) if d}  # guesses of it
            messages, self.drained = s.drain(), True  # finished requests leave: schedule again
            fresh = s.decode.schedule()
            if fresh is None:
                return messages
            batch = fresh
            if not self._takes(batch):  # e.g. a grammar's first token came in
                return messages + s.run(batch)
            drafts, ks = self._draft(batch.reqs)  # from the fresh tokens
            self._missed(batch.reqs, drafts, ks, stale)
        drafts = self._fit(drafts, batch.reqs)
        if not self._pays(batch.reqs, drafts):  # not after all: a plain step
            return messages + s.run(batch)
        return messages + self._verify(batch.reqs, drafts)

    def _missed(
        self, reqs: list[Req], drafts: list[list[int]], ks: list[int], stale: dict[int, int]
    ) -> None:
        """A request whose stale drafts drained the pipeline, whose first draft was not the
        token that came in, and whose fresh tokens draft nothing: a drain for nothing, as
        dear as a verify that takes no draft, and counted as one. Otherwise such drains
        would never reach the switch-off, which learns only from verifies."""
        for req, draft, k in zip(reqs, drafts, ks):
            guess = stale.get(req.uid)
            if k and not draft and guess is not None and guess != int(req.input_ids[-1]):
                self.acceptance.record(req.uid, 0, 1)

    def _pays(self, reqs: list[Req], drafts: list[list[int]]) -> bool:
        """Whether these drafts are worth a verify step: the drafts each request is expected
        to have accepted (its acceptance rate a: a + a^2 + ... over its drafts), against
        what a verify step costs at this batch size (cost.py)."""
        if not any(drafts) or self.always:
            return any(drafts)
        expected = sum(self.acceptance.expected(r.uid, len(d)) for r, d in zip(reqs, drafts))
        return self.costs.pays(len(reqs), expected)

    def release(self, uid: int) -> None:
        """A request finished or was preempted: forget it, and a drafter's state for it."""
        if self.enabled:
            self.acceptance.forget(uid)
            self.drafter.retain(set(self.scheduler.reqs) - {uid})

    def shutdown(self) -> None:
        if isinstance(self.drafter, DraftModelDrafter):  # its graphs go before the engines
            self.drafter.engine.graph_runner.destroy_cuda_graphs()

    def _takes(self, batch: Batch) -> bool:
        """A batch speculates only where that is exact and pays: decode, at most max_bs
        requests, none with a grammar or log-probabilities. Their tokens would go out through
        the scheduler's `emit` as any others; what a verify step lacks is upstream of it: the
        grammar's mask for each draft's position (and its matcher stepping back over rejected
        drafts), and the log-probabilities of each accepted row, which `accept_drafts` does
        not compute. Those batches take the plain step, which gives the same tokens."""
        if not self.enabled or not batch.is_decode or batch.size > self.max_bs:
            return False
        reqs = batch.reqs
        if self.scheduler.grammars.constrains(reqs):
            return self._skip("a request has a grammar, which would have to mask every draft")
        if any(r.sampling_params.logprobs for r in reqs):
            return self._skip(
                "a request wants log-probabilities, which verify steps do not compute"
            )
        return True

    def _skip(self, reason: str) -> bool:
        """Say once per reason why batches take the plain step; False."""
        if reason not in self.skipped:
            self.skipped.add(reason)
            logger.info("speculative decoding: plain steps for batches where %s", reason)
        return False

    def _draft(self, reqs: list[Req]) -> tuple[list[list[int]], list[int]]:
        """Each request's drafts and how many it asked for: as many as its acceptance earns,
        fewer near its length limit, none while it is switched off or with penalties (they
        change with every token: see verify.py)."""
        a = self.acceptance
        need = None if self.always else self.costs.ratio(len(reqs)) - 1  # gain, to go on
        ks = [
            min(a.draft_len(r.uid), r.remain_len - 1)
            if not r.sampling_params.has_penalties and a.proposes(r.uid, r.seq_len, need)
            else 0
            for r in reqs
        ]
        return self.drafter.propose(reqs, ks), ks

    def rate(self, uid: int) -> float:
        """The share of a request's drafts accepted so far (a fresh request starts at 0.8)."""
        return self.acceptance.rate(uid)

    def _fit(self, drafts: list[list[int]], reqs: list[Req]) -> list[list[int]]:
        """Drop the drafts of the last requests whose pages would not fit."""
        cache = self.scheduler.cache
        room = cache.available_pages - sum(cache.pages_needed(r, r.device_len) for r in reqs)
        for i, (req, draft) in enumerate(zip(reqs, drafts)):
            extra = cache.pages_needed(req, req.device_len + len(draft))
            extra -= cache.pages_needed(req, req.device_len)
            if extra > room:
                drafts[i] = []
            else:
                room -= extra
        return drafts

    @torch.inference_mode()
    def _verify(self, reqs: list[Req], drafts: list[list[int]]) -> list[TokenMsg]:
        s = self.scheduler
        engine, pool = s.engine, s.engine.token_pool
        rows = self._place(reqs, drafts)
        batch = Batch(reqs, "verify")
        self.num_forwards += 1

        def accept() -> torch.Tensor:  # once the batch is prepared: its input ids are set
            return accept_into_pool(engine.logits(batch), batch.input_ids, reqs, drafts, pool, rows)

        out = s.forward(batch, accept)
        if engine.state_pool is not None:  # a hybrid's states: back to the accepted  # [ch31]
            engine.state_pool.keep_accepted(batch, out[0])  # [ch31]
        accepted, final = self._read_back(out)
        return self._emit(reqs, drafts, accepted, final)

    def _place(self, reqs: list[Req], drafts: list[list[int]]) -> VerifyRows:
        """The drafts into the token pool, after each request's last token; where each
        request's rows will lie in the verify batch comes back, on the device."""
        pool = self.scheduler.engine.token_pool
        width, device = pool.size(1), pool.device
        places = [
            r.table_idx * width + r.device_len + j
            for r, d in zip(reqs, drafts)
            for j in range(len(d))
        ]
        tokens = [t for d in drafts for t in d]
        counts = [len(d) for d in drafts]
        starts = [0]
        for k in counts[:-1]:
            starts.append(starts[-1] + k + 1)
        after = [r.table_idx * width + r.cached_len + 1 for r in reqs]  # of the first draft
        n, bs = len(places), len(reqs)  # one copy to the device for all five
        host = to_device(places + tokens + starts + counts + after, device, torch.int64)
        where, tokens_d, starts_d, counts_d, after_d = host.split([n, n, bs, bs, bs])
        pool.put_(where, tokens_d.to(torch.int32))
        for req, draft in zip(reqs, drafts):
            req.device_len += len(draft)
        return VerifyRows(starts_d, counts_d, after_d, max(counts, default=0))

    def _read_back(self, out: torch.Tensor) -> tuple[list[int], list[int]]:
        """The accepted counts and the tokens after them come to the host, which waits."""
        both = to_host(out)
        if out.device.type == "cuda":
            torch.cuda.current_stream(out.device).synchronize()  # the host needs them now
        accepted, final = both.tolist()
        return accepted, final

    def _emit(
        self, reqs: list[Req], drafts: list[list[int]], accepted: list[int], final: list[int]
    ) -> list[TokenMsg]:
        """Each request's accepted drafts and the model's token, through the scheduler's
        `emit`; its lengths cover only those, and the pages past them go back."""
        s = self.scheduler
        messages = []
        for req, draft, n, token in zip(reqs, drafts, accepted, final):
            self._count(req.uid, n, len(draft))
            req.cached_len += 1 + n  # its last token and the accepted drafts
            req.device_len = req.cached_len + 1
            s.cache.trim(req, req.device_len)
            for t in draft[:n] + [token]:
                messages.append(s.emit(req, t))
                if messages[-1].finished:  # it has left, and its acceptance is forgotten
                    break
        if len(self.acceptance.records) > 2 * len(s.reqs) + 64:  # requests aborted since
            self.acceptance.retain(set(s.reqs))
            self.drafter.retain(set(s.reqs))
        return messages

    def _count(self, uid: int, accepted: int, drafted: int) -> None:
        self.num_steps += 1
        self.num_drafted += drafted
        self.num_accepted += accepted
        if drafted:
            self.acceptance.record(uid, accepted, drafted)
            self.accepted_lengths[accepted] += 1
