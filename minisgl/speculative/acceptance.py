"""A request's acceptance: how many drafts it proposes, and when it stops proposing at all.

Per request, a moving count of drafts taken and rejected (recent verifies weighing most)
gives an acceptance rate a. A draft j positions deep adds a token only if the j - 1 before
it were taken, with probability about a^j, so a request drafts up to the largest j with
a^j >= WORTH: all k while it copies well, one or two while its drafts are mostly wrong. Its
expected gain from a verify is E = a + a^2 + ... over those drafts.

Never slower, by construction: a verify step costs r plain steps (cost.py measures r per
batch size), so it pays for a request only where E >= r - 1. Before each step a request
whose E falls short is switched off: it asks the drafter for nothing for BACKOFF tokens,
then probes with a fresh count (its text may have changed: a chat turned into a copy). A
probe that does not pay doubles the wait; only a verify that paid for itself (accepted at
least r - 1 drafts) resets it. So a request whose drafts miss, or are taken too rarely to
pay, spends a few verify steps at its start (one where a verify costs two plain steps),
then one for each doubling of its length: on 256 tokens, five.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minisgl.core import Req

WORTH = 0.1  # a draft is proposed while the chance it adds a token is at least this
DECAY = 0.8  # the weight of the acceptance seen so far against the newest verify
FRESH = (2.0, 0.5)  # drafts taken and rejected of a request that has not verified: a = 0.8
MIN_GAIN = 0.1  # a smaller expected gain is within the noise of measured step times
BACKOFF = 16  # tokens decoded plainly after a switch-off, before a probe
MAX_BACKOFF = 1024
AHEAD = 0.5  # a verify is followed by one launched ahead where the chance that all its
# requests' drafts and guesses hold is at least this (each request's share of its recent
# verifies in which they held, recent ones weighing most; a fresh request's: this)


@dataclass
class Record:
    taken: float = FRESH[0]
    rejected: float = FRESH[1]
    off_until: int = 0  # the request drafts nothing while shorter than this
    backoff: int = BACKOFF
    need: float = 0.0  # the gain its last drafts had to bring: r - 1 then
    held: float = AHEAD  # how often its drafts and the guess after them all held
    lead: float = FRESH[0] / sum(FRESH)  # how often its guess of a plain step's token held
    verified: int = 0  # verifies since its count was last fresh: 0, its rate is a guess


class Acceptance:
    def __init__(self, max_drafts: int) -> None:
        self.max_drafts = max_drafts
        self.records: dict[int, Record] = {}  # by uid

    def rate(self, uid: int) -> float:
        """The share of a request's drafts accepted, recent verifies weighing most."""
        r = self.records.get(uid)
        taken, rejected = (r.taken, r.rejected) if r else FRESH
        return taken / (taken + rejected)

    def draft_len(self, uid: int) -> int:
        """The most drafts j with a^j >= WORTH."""
        rate = self.rate(uid)
        if rate >= 1.0:
            return self.max_drafts
        return max(1, min(self.max_drafts, int(math.log(WORTH) / math.log(max(rate, 1e-3)))))

    def expected(self, uid: int, drafts: int) -> float:
        """The drafts of these many that a verify is expected to accept."""
        rate = self.rate(uid)
        if rate >= 1.0 or drafts <= 0:
            return float(max(drafts, 0))
        return rate * (1 - rate**drafts) / (1 - rate)  # a + a^2 + ... + a^drafts

    def proposes(self, uid: int, length: int, need: float | None) -> bool:
        """Whether the request, `length` tokens long, asks for drafts this step. `need` is
        the gain a verify must bring (r - 1); None: every request drafts."""
        r = self.records.setdefault(uid, Record())
        if length < r.off_until:
            return False
        if r.off_until:  # the wait is over: a probe, from a fresh count
            r.taken, r.rejected, r.verified = *FRESH, 0
            r.off_until = 0
        r.need = 0.0 if need is None else max(need, MIN_GAIN)
        if need is None or self.expected(uid, self.draft_len(uid)) >= r.need:
            return True
        r.off_until = length + r.backoff
        r.backoff = min(2 * r.backoff, MAX_BACKOFF)
        return False

    def record(self, uid: int, accepted: int, drafted: int) -> None:
        """A verify took `accepted` of the request's `drafted` drafts. A few taken drafts
        do not reset the wait between probes: a chat that shares a word now and then with
        its drafts would probe every BACKOFF tokens, at a loss each time."""
        r = self.records.setdefault(uid, Record())
        missed = accepted < drafted  # the draft after the accepted ones was wrong
        r.taken, r.rejected = DECAY * r.taken + accepted, DECAY * r.rejected + missed
        r.verified += 1
        if accepted and accepted >= r.need:  # this verify paid for itself
            r.backoff = BACKOFF

    def held(self, uid: int) -> float:
        """The share of the request's recent verifies (with a guess) in which every draft and
        the guess of the token after them held: the chance a verify launched ahead of its
        next one counts (step.py)."""
        r = self.records.get(uid)
        return r.held if r else AHEAD

    def record_guess(self, uid: int, held: bool) -> None:
        r = self.records.setdefault(uid, Record())
        r.held = DECAY * r.held + (1 - DECAY) * held

    def lead(self, uid: int) -> float:
        """The share of the request's recent guesses of the token of the plain step in flight
        (a verify launched behind it, step.py) that held. Apart from its rate: a plain step
        comes where the drafts stopped, and there the next token is harder to guess than
        a copy's next one."""
        r = self.records.get(uid)
        return r.lead if r else FRESH[0] / sum(FRESH)

    def record_lead(self, uid: int, held: bool) -> None:
        r = self.records.setdefault(uid, Record())
        r.lead = DECAY * r.lead + (1 - DECAY) * held

    def guessed(self, uid: int) -> bool:
        """Whether the request's rate is still the guess of a fresh count: it has not
        verified since it started, or since its last switch-off."""
        r = self.records.get(uid)
        return r is None or r.verified == 0

    def last_sooner(self, reqs: list[Req], drafts: list[list[int]]) -> float:
        """How many tokens sooner the last of these requests is expected to finish if this
        step verifies their drafts than if it is a plain step (see `last_sooner`)."""
        rates = [self.rate(r.uid) for r in reqs]
        return last_sooner([r.remain_len for r in reqs], rates, [len(d) for d in drafts])

    def forget(self, uid: int) -> None:
        self.records.pop(uid, None)

    def retain(self, uids: set[int]) -> None:
        self.records = {uid: r for uid, r in self.records.items() if uid in uids}


def last_sooner(remain: list[int], rates: list[float], drafts: list[int]) -> float:
    """Requests R_i tokens from their ends, each verifying k_i drafts and taking the first j
    with probability about a_i^j: the last of them finishes R_max - E[max_i (R_i - taken_i)]
    tokens sooner than without the verify. Only its requests that end last count: drafts
    taken by one that ends earlier anyway do not bring the last answer sooner. For one
    request this is its expected gain, a + a^2 + ... + a^k."""
    top = max(remain)
    low = max(r - k for r, k in zip(remain, drafts))  # the least the last can have left
    last = float(low)  # E[M] = low + the sum over x in [low, top) of P(M > x)
    for x in range(low, top):
        at_most = 1.0  # P(M <= x): every request takes at least R_i - x drafts
        for r, a, k in zip(remain, rates, drafts):
            need = r - x
            at_most *= 1.0 if need <= 0 else a**need if need <= k else 0.0
        last += 1.0 - at_most
    return top - last
