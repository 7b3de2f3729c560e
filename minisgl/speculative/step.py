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
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch

from minisgl.core import Batch, Req
from minisgl.env import ENV
from minisgl.message.backend import TokenMsg
from minisgl.scheduler.cache import CacheManager
from minisgl.scheduler.config import SchedulerConfig
from minisgl.speculative.acceptance import AHEAD, Acceptance
from minisgl.speculative.cost import StepCosts, leader_clock
from minisgl.speculative.draft_model import DraftModelDrafter
from minisgl.speculative.ngram import NgramDrafter
from minisgl.speculative.suffix import DEPTH, SuffixDrafter
from minisgl.speculative.verify import VerifyRows, accept_into_pool
from minisgl.utils import to_device, to_host

if TYPE_CHECKING:
    from minisgl.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class Ahead:
    """A verify launched and not yet read back. The one launched on top of it, if any, is its
    `child`: its rows assumed that this one takes every draft and makes the token `guesses`
    says, and the requests for which that turns out wrong are the child's `dead` rows."""

    reqs: list[Req]
    drafts: list[list[int]]
    guesses: list[int | None]  # the token expected after each request's drafts, if drafted
    base: list[int]  # each request's cached_len at the launch: its first row's position
    out: torch.Tensor  # [2, bs] int64 on the device: accepted drafts, the token after them
    host: torch.Tensor  # its copy on the host, valid once `done` is reached
    done: torch.cuda.Event | None
    child: Ahead | None = None
    dead: set[int] = field(default_factory=set)  # rows that count for nothing
    # launched behind a plain step: the token each request's drafts assumed that step makes
    leads: list[int | None] = field(default_factory=list)


class Speculator:
    def __init__(self, scheduler: Scheduler, config: SchedulerConfig) -> None:
        self.scheduler = scheduler
        self.enabled = config.speculative != "off"
        self.max_drafts, self.max_bs = config.num_draft_tokens, config.speculative_max_bs
        self.always = config.speculative_always  # no measuring: every draft is verified
        self.tp_size = config.tp_size  # ranks: they time their steps by rank 0's clock
        self.drafter: NgramDrafter | DraftModelDrafter | SuffixDrafter = NgramDrafter()
        if config.speculative == "draft":  # a smaller model's greedy tokens
            self.drafter = DraftModelDrafter(config, scheduler.engine)
        elif config.speculative == "suffix":  # this request's and earlier requests' text
            # trees deep enough that a match can carry every draft a request may ask for: k,
            # the guess after them, and the token of the step in flight before them (below)
            self.drafter = SuffixDrafter(depth=max(DEPTH, self.max_drafts + 3))
        self.acceptance = Acceptance(self.max_drafts)  # per request: rate, switch-off
        # Whose wait a verify must shorten: False (a server), each request's own, so the
        # drafts the batch is expected to take must pay for the step; True (the offline
        # API, whose caller waits for every answer), the last answer's too (`_pays`).
        self.together = False
        # Drafts proposed and accepted, requests verified, and verify forwards run.
        self.num_drafted = self.num_accepted = self.num_steps = self.num_forwards = 0
        self.accepted_lengths = [0] * (self.max_drafts + 1)  # verifies by drafts accepted
        self.skipped: set[str] = set()  # why some batches took the plain step, said once
        self.costs = StepCosts()  # what verify and plain steps cost, measured
        self.drained = False  # this step drained the pipeline for a verify
        self.num_drained = 0  # steps that did
        # A verify launched ahead of the one before it (below): with overlap scheduling, for
        # prompt-lookup drafts, where the KV pool is all a request keeps (no recurrent state
        # to roll back, no sliding window to free pages by a length that may go back).
        self.ahead_on = (
            ENV.SPECULATIVE_AHEAD.value == "on"
            and scheduler.overlap
            and isinstance(self.drafter, NgramDrafter | SuffixDrafter)
            and type(scheduler.cache) is CacheManager
        )
        if scheduler.engine.state_pool is not None:  # a recurrent state: no going back  # [ch31]
            self.ahead_on = False  # [ch31]
        self.ahead: Ahead | None = None  # the verify in flight, when one is
        self.num_ahead = self.num_ahead_dead = 0  # verifies launched ahead; their rows in vain
        # A verify launched behind the plain step in flight (`_behind`), for prompt-lookup
        # drafts: a plain step always makes one token, so where it goes is known.
        self.behind_on = (
            ENV.SPECULATIVE_BEHIND.value == "on"
            and scheduler.overlap
            and isinstance(self.drafter, NgramDrafter | SuffixDrafter)
        )
        self.num_behind = self.num_behind_missed = 0  # such verifies; rows whose guess missed

    def try_step(self, batch: Batch) -> list[TokenMsg] | None:
        """Run `batch` (a decode batch) as a verify step and return its tokens; None when
        it should be a plain decode step instead, and nothing was done.

        Drafts are made from a request's tokens on the host, so a verify step needs the
        step before it processed. With overlap scheduling that step is still in flight:
        plain steps keep overlapping, and only where the host's (one step old) tokens
        already draft something worth a verify step is the pipeline drained for one. A
        verify in flight is different: its requests' lengths wait on its tokens, so the next
        step either launches the next verify on top of it (`_go_ahead`) or drains it first."""
        began = time.perf_counter() if self.tp_size == 1 else leader_clock()  # all ranks alike
        takes, forwards = self._takes(batch), self.num_forwards
        self.drained = False
        out = self._after_ahead(batch, takes) if self.ahead is not None else None
        if out is None:
            out = self._try(batch) if takes else None
        kind = "verify" if self.num_forwards > forwards else "drained" if self.drained else "plain"
        self.costs.start(kind if takes else None, batch.size, now=began)  # from its beginning
        return out

    def _after_ahead(self, batch: Batch, takes: bool) -> list[TokenMsg] | None:
        """The step after a verify left in flight: the next verify launched on top of it, or
        that verify drained. None where the verify in flight does not concern this batch
        (a prefill's)."""
        if not batch.is_decode:
            return None  # new requests' forward: the verify's tokens come with its drain
        if takes and (launched := self._go_ahead(batch.reqs)) is not None:
            return launched
        # Drained, and nothing launched: the next step schedules the requests as they now
        # stand (some finished; one whose verify took every draft may need a page).
        self.drained = True
        self.num_drained += 1
        return self.scheduler.drain()

    def _try(self, batch: Batch) -> list[TokenMsg] | None:
        s = self.scheduler
        if (lead := self._behind(batch.reqs)) is not None:  # behind the plain step in flight
            drafts, _, guesses, leads = self._draft(batch.reqs, lead=lead)
            fitted = self._fit(drafts, batch.reqs, guesses)
            if fitted is None:  # no room: a plain step on top
                return None
            if self._pays(batch.reqs, fitted, leads):
                return self._verify(batch.reqs, fitted, guesses, leads)
        # Not behind it (its guesses hold too rarely to pay): drained first, as below.
        drafts, _, guesses, _ = self._draft(batch.reqs)
        if not self._pays(batch.reqs, drafts):
            return None
        messages: list[TokenMsg] = []
        if s.in_flight is not None:
            stale = {r.uid: d[0] for r, d in zip(batch.reqs, drafts) if d}  # guesses of it
            messages, self.drained = s.drain(), True  # finished requests leave: schedule again
            self.num_drained += 1
            fresh = s.decode.schedule()
            if fresh is None:
                return messages
            batch = fresh
            if not self._takes(batch):  # e.g. a grammar's first token came in
                return messages + s.run(batch)
            drafts, ks, guesses, _ = self._draft(batch.reqs)  # from the fresh tokens
            self._missed(batch.reqs, drafts, ks, stale)
        fitted = self._fit(drafts, batch.reqs, guesses)
        if fitted is None or not self._pays(batch.reqs, fitted):  # not after all: plain
            return messages + s.run(batch)
        return messages + self._verify(batch.reqs, fitted, guesses)

    def _behind(self, reqs: list[Req]) -> list[int] | None:
        """Whether the verify may be launched behind the plain step in flight, not after
        draining it: for each request, the tokens that step makes which the host does not
        have yet (1 where it is in that step, else 0); None where it may not.

        A plain step makes exactly one token a request, at a place known before it is made,
        and there it already lies in the token pool when the verify's forward reads its
        first row. The drafts after it are made from the host's tokens, one short, as if
        that token were their own first one: where it was, they are as good as drafts made
        after draining; where it was not, the verify still makes that request's next token
        (the rows are checked against the model, whatever they hold), as a plain step
        would. Meanwhile the host's work for the verify runs while the device computes the
        step before it, as a plain step's does."""
        flight = self.scheduler.in_flight
        if not self.behind_on or flight is None or flight.finish is not None:
            return None
        if flight.output is None:  # a grammar's step, sampled once the one before is in
            return None
        lead = [r.device_len - r.seq_len for r in reqs]
        return lead if any(lead) and all(n in (0, 1) for n in lead) else None

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

    def _pays(
        self, reqs: list[Req], drafts: list[list[int]], leads: list[int | None] | None = None
    ) -> bool:
        """Whether these drafts are worth a verify step: the drafts each request is expected
        to have accepted (its acceptance rate a: a + a^2 + ... over its drafts), against
        what a verify step costs at this batch size (cost.py).

        A verify delays every request in the batch by its extra cost, and each request's
        wait shortens by the drafts it takes. A server's requests are each waited for by
        their own client, so the sum of their expected gains must pay. Where one caller
        waits for them all (`together`: the offline API) and none is left waiting to start,
        what counts is how much sooner the last answer comes, and which answer will be last
        depends on lengths not known yet. If every request ran to its token limit, it would
        be the one with most left, and the gain `last_sooner` (for bs requests, g tokens
        sooner for the last is worth bs * g: cost.py weighs a batch's tokens); if lengths
        had nothing to do with drafts, any request would be as likely to be last, and the
        gain the sum's. The step takes the midpoint, and the sum while a request's rate or
        the batch size's verify cost is still a guess: they are learned only by verifying.
        `leads`: drafts made after a guess of the plain step's token in flight (`_behind`)
        count only if it is right, as often as the request's guesses of it were."""
        if not any(drafts) or self.always:
            return any(drafts)
        a = self.acceptance
        lead = leads or [None] * len(reqs)
        sure = sum(a.expected(r.uid, len(d)) for r, d in zip(reqs, drafts))
        expected = sum(
            a.expected(r.uid, len(d)) * (a.lead(r.uid) if g is not None else 1.0)
            for r, d, g in zip(reqs, drafts, lead)
        )
        if self.together and len(reqs) > 1 and not self.scheduler.prefill.has_work:
            last = a.last_sooner(reqs, drafts) * (expected / sure if sure else 1.0)
            gain = (len(reqs) * last + expected) / 2
            guessed = any(d and a.guessed(r.uid) for r, d in zip(reqs, drafts))
            if guessed or not self.costs.measured(len(reqs)):  # learned by verifying
                gain = max(gain, expected)
            return self.costs.pays(len(reqs), gain)
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

    def _draft(
        self,
        reqs: list[Req],
        pending: list[list[int]] | None = None,
        lead: list[int] | None = None,
    ) -> tuple[list[list[int]], list[int], list[int | None], list[int | None]]:
        """Each request's drafts, how many it asked for, and where verifies may go ahead, the
        token after its drafts (one more drafted, or the last of fewer: the guess of the
        token its verify makes): as many as its acceptance earns, fewer near its length
        limit, none while it is switched off or with penalties (they change with every
        token: see verify.py). Last, with `lead`, each request's guess of the token of the
        plain step in flight, which its drafts follow (`_behind`; None where there is none).
        `pending`: tokens each request is assumed to have after its own (a verify's drafts
        and guess in flight)."""
        a = self.acceptance
        need = None if self.always else self.costs.ratio(len(reqs)) - 1  # gain, to go on
        ks = [
            min(a.draft_len(r.uid), r.remain_len - 1)
            if not r.sampling_params.has_penalties and a.proposes(r.uid, r.seq_len, need)
            else 0
            for r in reqs
        ]
        asked = [k + 1 if k and self.ahead_on else k for k in ks]
        longer, leads = self._propose(reqs, asked, pending, lead)
        if not self.ahead_on:
            return longer, ks, [None] * len(reqs), leads
        drafts: list[list[int]] = []
        guesses: list[int | None] = []
        likely = self._likely(reqs)  # else a draft given up for a guess is lost
        for d, k in zip(longer, ks):
            if 0 < k < len(d):  # k drafts and the guess (kept to learn how often they hold)
                drafts.append(d[:k])
                guesses.append(d[k])
            elif len(d) >= 2 and likely:  # fewer: the last one is the guess
                drafts.append(d[:-1])
                guesses.append(d[-1])
            else:
                drafts.append(d)
                guesses.append(None)
        return drafts, ks, guesses, leads

    def _propose(
        self,
        reqs: list[Req],
        asked: list[int],
        pending: list[list[int]] | None,
        lead: list[int] | None,
    ) -> tuple[list[list[int]], list[int | None]]:
        """The drafter's tokens, and the guesses of the plain step's token in flight: where
        `lead` says a request lacks it, one token more is asked for and the first taken off."""
        none: list[int | None] = [None] * len(reqs)
        if pending is not None:
            return self.drafter.propose(reqs, asked, pending), none  # type: ignore[call-arg]
        if lead is None:
            return self.drafter.propose(reqs, asked), none
        got = self.drafter.propose(reqs, [k + n if k else 0 for k, n in zip(asked, lead)])
        drafts = [d[n:] if len(d) > n else [] for d, n in zip(got, lead)]
        leads = [d[0] if n and len(d) > n else None for d, n in zip(got, lead)]
        return drafts, leads

    def rate(self, uid: int) -> float:
        """The share of a request's drafts accepted so far (a fresh request starts at 0.8)."""
        return self.acceptance.rate(uid)

    def _fit(
        self, drafts: list[list[int]], reqs: list[Req], guesses: list[int | None]
    ) -> list[list[int]] | None:
        """Drop the drafts of the last requests whose pages would not fit, and their guesses
        (each was of the token after all its drafts); None where the requests' own next
        tokens do not fit."""
        cache = self.scheduler.cache
        room = cache.available_pages - sum(cache.pages_needed(r, r.device_len) for r in reqs)
        if room < 0:
            return None
        for i, (req, draft) in enumerate(zip(reqs, drafts)):
            extra = cache.pages_needed(req, req.device_len + len(draft))
            extra -= cache.pages_needed(req, req.device_len)
            if extra > room:
                drafts[i], guesses[i] = [], None
            else:
                room -= extra
        return drafts

    def _verify(
        self,
        reqs: list[Req],
        drafts: list[list[int]],
        guesses: list[int | None],
        leads: list[int | None] | None = None,
    ) -> list[TokenMsg]:
        """A verify step: launched, then either its tokens read back now, or, where every
        request has a guess of its token and the batch's drafts and guesses are likely to
        hold, left in flight for the next step to launch the next verify on top of it.
        With `leads` it was launched behind the plain step in flight, whose tokens are read
        while it runs; it goes ahead only where every guess of them held."""
        ahead = self._launch(reqs, drafts, guesses, leads=leads)
        messages: list[TokenMsg] = []
        held = True
        if leads is not None:
            self.num_behind += 1
            messages = self.scheduler.drain()  # the step before: its tokens are in now
            missed = sum(self._lead_held(ahead, i) is False for i in range(len(reqs)))
            self.num_behind_missed += missed
            held = missed == 0
        if held and self.ahead_on and self._goes_ahead(reqs, guesses):
            self._hand_over(ahead)
            return messages
        return messages + self._finish(ahead)

    @staticmethod
    def _lead_held(ahead: Ahead, i: int) -> bool | None:
        """Whether row i's drafts followed the plain step's token they assumed (None: they
        assumed none, or there are no drafts). Read once that step's tokens are emitted."""
        lead = ahead.leads[i] if ahead.leads else None
        if lead is None or not ahead.drafts[i]:
            return None
        return int(ahead.reqs[i].input_ids[ahead.base[i]]) == lead

    def _goes_ahead(self, reqs: list[Req], guesses: list[int | None]) -> bool:
        return all(g is not None for g in guesses) and self._likely(reqs)

    def _likely(self, reqs: list[Req]) -> bool:
        """Whether a verify of these requests launched ahead is likely to count: the chance
        that every request's drafts and guess hold (the product of their recent shares) is
        at least AHEAD. A chain goes on only while none of its rows died, so at batch 4
        each request must hold about 84% of the time."""
        if self.always:
            return True
        chance = 1.0
        for req in reqs:
            chance *= self.acceptance.held(req.uid)
        return chance >= AHEAD

    def _go_ahead(self, reqs: list[Req]) -> list[TokenMsg] | None:
        """The next verify, launched before the one in flight is read: each request as if
        that one took every draft and made the token it guessed, the guess its first row
        (its last token), drafts from its text with the pending ones after it. Then the
        one in flight is read: where it took fewer drafts or made another token, the
        request's lengths go back to what it did make, and the new verify's rows for it
        count for nothing (the device knows too: its acceptance is guarded). None where
        this batch cannot go ahead (another batch, a request without a guess, no room),
        nothing done."""
        before = self.ahead
        assert before is not None
        if len(reqs) != len(before.reqs) or any(r is not q for r, q in zip(reqs, before.reqs)):
            return None
        if before.dead or not self._goes_ahead(reqs, before.guesses):
            return None
        saved = [(r.cached_len, r.device_len) for r in reqs]
        for req in reqs:  # its drafts in the cache, its guess the last token
            req.cached_len, req.device_len = req.device_len, req.device_len + 1
        pending = [d + [g] for d, g in zip(before.drafts, before.guesses)]  # type: ignore[list-item]
        drafts, _, guesses, _ = self._draft(reqs, pending)
        fitted = None
        if all(r.device_len <= r.max_device_len for r in reqs):
            fitted = self._fit(drafts, reqs, guesses)
        if fitted is None:  # no room: the verify in flight is drained instead
            for req, (cached, device) in zip(reqs, saved):
                req.cached_len, req.device_len = cached, device
            return None
        s = self.scheduler
        ahead = self._launch(reqs, fitted, guesses, before)
        before.child = ahead
        self.num_ahead += 1
        messages = s.drain()  # the verify before: its tokens, and the rows that died
        self.num_ahead_dead += len(ahead.dead)
        if len(ahead.dead) < len(reqs):
            self._hand_over(ahead)
        return messages

    def _hand_over(self, ahead: Ahead) -> None:
        """Leave a launched verify in flight: the scheduler's next drain reads it back."""
        self.ahead = ahead
        self.scheduler.hand_over(partial(self._finish, ahead))

    @torch.inference_mode()
    def _launch(
        self,
        reqs: list[Req],
        drafts: list[list[int]],
        guesses: list[int | None],
        before: Ahead | None = None,
        leads: list[int | None] | None = None,
    ) -> Ahead:
        s = self.scheduler
        engine, pool = s.engine, s.engine.token_pool
        base = [r.cached_len for r in reqs]
        rows = self._place(reqs, drafts, before)
        batch = Batch(reqs, "verify")
        self.num_forwards += 1

        def accept() -> torch.Tensor:  # once the batch is prepared: its input ids are set
            return accept_into_pool(engine.logits(batch), batch.input_ids, reqs, drafts, pool, rows)

        out = s.forward(batch, accept)
        if engine.state_pool is not None:  # a hybrid's states: back to the accepted  # [ch31]
            engine.state_pool.keep_accepted(batch, out[0])  # [ch31]
        host, done = to_host(out), None
        if out.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return Ahead(reqs, drafts, guesses, base, out, host, done, leads=leads or [])

    def _place(self, reqs: list[Req], drafts: list[list[int]], before: Ahead | None) -> VerifyRows:
        """The drafts into the token pool, after each request's last token (and for a
        verify launched ahead, that last token: the guess of the one before); where each
        request's rows will lie in the verify batch comes back, on the device."""
        pool = self.scheduler.engine.token_pool
        width, device = pool.size(1), pool.device
        places = [
            r.table_idx * width + r.device_len + j
            for r, d in zip(reqs, drafts)
            for j in range(len(d))
        ]
        tokens = [t for d in drafts for t in d]
        if before is not None:  # the guesses, where the verify before would put its token
            places += [r.table_idx * width + r.cached_len for r in reqs]
            tokens += before.guesses  # type: ignore[arg-type]
        counts = [len(d) for d in drafts]
        starts = [0]
        for k in counts[:-1]:
            starts.append(starts[-1] + k + 1)
        after = [r.table_idx * width + r.cached_len + 1 for r in reqs]  # of the first draft
        n, bs = len(places), len(reqs)  # one copy to the device for all
        guard = [len(d) for d in before.drafts] + list(before.guesses) if before else []
        host = to_device(places + tokens + starts + counts + after + guard, device, torch.int64)
        parts = host.split([n, n, bs, bs, bs, len(guard)])
        pool.put_(parts[0], parts[1].to(torch.int32))
        for req, draft in zip(reqs, drafts):
            req.device_len += len(draft)
        rows = VerifyRows(parts[2], parts[3], parts[4], max(counts, default=0))
        if before is not None:
            rows.guard = (before.out, *parts[5].split(bs))
        return rows

    def _finish(self, ahead: Ahead) -> list[TokenMsg]:
        """A verify's tokens, read back (the host waits for them), and emitted."""
        if self.ahead is ahead:
            self.ahead = None
        return self._emit(ahead, *self._read_back(ahead))

    def _read_back(self, ahead: Ahead) -> tuple[list[int], list[int]]:
        if ahead.done is not None:
            ahead.done.synchronize()  # the host needs them now
        accepted, final = ahead.host.tolist()
        return accepted, final

    def _emit(self, ahead: Ahead, accepted: list[int], final: list[int]) -> list[TokenMsg]:
        """Each live request's accepted drafts and the model's token, through the scheduler's
        `emit`; its lengths cover only those and the pages past them go back, unless the
        verify launched on top of this one assumed exactly this (then its lengths are that
        one's already). A request whose chain broke earlier, or that finished meanwhile, is
        passed over."""
        s, child = self.scheduler, ahead.child
        messages = []
        for i, (req, draft, n, token) in enumerate(zip(ahead.reqs, ahead.drafts, accepted, final)):
            if i in ahead.dead or s.reqs.get(req.uid) is not req:
                continue
            self._count(req.uid, n, len(draft), self._lead_held(ahead, i))
            held = n == len(draft) and token == ahead.guesses[i]
            if ahead.guesses[i] is not None:
                self.acceptance.record_guess(req.uid, held)
            if child is None or not held:
                if child is not None:
                    child.dead.add(i)
                req.cached_len = ahead.base[i] + 1 + n  # its last token and the accepted drafts
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

    def _count(self, uid: int, accepted: int, drafted: int, lead: bool | None = None) -> None:
        """A verify's drafts for one request, counted. `lead`: whether the token its drafts
        assumed the plain step before would make was made (its own share); where it was
        not, the drafts after it were checked against another token and say nothing of
        the drafter."""
        self.num_steps += 1
        self.num_drafted += drafted
        self.num_accepted += accepted
        if drafted:
            self.accepted_lengths[accepted] += 1
        if lead is not None:
            self.acceptance.record_lead(uid, lead)
        if drafted and lead is not False:
            self.acceptance.record(uid, accepted, drafted)
