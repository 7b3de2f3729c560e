"""When a verify step pays: step times measured as the engine runs, against the tokens the
drafts are expected to add.

A verify step makes a batch of bs requests produce bs tokens plus the drafts it accepts,
in more time than a plain step. It pays when (bs + E) / verify cost > bs / plain cost, E
the drafts expected to be accepted: a draft j positions deep is taken with probability
a^j, a the request's acceptance rate, so E = sum over requests and drafts of a^j.

Both costs are measured here, per batch-size bucket (1, 2, 4, 8, ...), from the interval
between one scheduler step's start and the next (what a step costs the requests, host and
device together), in moving averages. With overlap scheduling that interval is not the
whole story of a verify step. Its drafts need the tokens of the step in flight, so it
drains the pipeline first, and it runs alone: the plain step after it starts with nothing
in flight, so the host's work for it is hidden behind nothing. The intervals show it: the
verify's holds the wait for the step before (which a plain step would have waited for
too), the next plain step's is short (no step to wait for), the one after a little long.
So a verify is charged with what it changed: its own interval plus, for each of the
REFILL plain steps after it, the difference from a plain step's cost; those steps are not
plain costs. A drain that found nothing to verify after all (the fresh tokens drafted
less than the stale ones promised) is a cost of verifying too: its excess over a plain
step is charged to the next verify of its bucket. On a CPU, without overlap, the refill
costs nothing and the charge is the verify's interval.

Until a bucket has both costs, a verify is assumed to cost PRIOR plain steps. The
measurements follow the workload: a bucket where verifying stopped paying verifies again
after RETRY declined batches, and one that verified REMEASURE times since its plain cost
was last measured (or has none) takes plain steps until it is: REFILL + 1 in a row, since
the ones that refill the pipeline are not a plain step's cost.

A measurement can be wrong: a verify that waited for a kernel to be built, on a machine
whose compile caches are empty, costs a thousand plain steps. Later outliers are not
counted (WAIT), but the first counted verify has no average to be compared with; and with
a cost that high no request proposes drafts at all (acceptance.py), so no declined verify
ever reaches RETRY and the cost would never be measured again. So a bucket's verify cost
that EXPIRE plain steps have passed without a verify is forgotten: the prior decides
again, and the next verify measures anew (where verifies do not pay, one in EXPIRE steps).
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

PRIOR = 2.0  # verify / plain step cost where not measured yet
RETRY = 64  # declined verify steps in a bucket before one is run anyway, to measure again
REMEASURE = 256  # verify steps in a bucket before plain steps are taken, to measure them again
WEIGHT = 0.2  # of the newest cost in the moving average
REFILL = 2  # plain steps after a verify whose difference from a plain step is the verify's
WAIT = 4.0  # an interval this many times its kind's average: the scheduler waited for work
EXPIRE = 4 * RETRY  # plain steps in a bucket with no verify, after which its verify cost goes


# Under tensor parallelism every rank must take the same steps (scheduler/ranks.py), and
# these decisions are timed: so every rank times its steps by rank 0's clock, as read when
# it shared the messages a step starts from.
_leader_clock = [0.0]


def stamp_clock(data: bytes) -> bytes:
    """Rank 0: its clock now, before the shared messages (and its own steps read it)."""
    _leader_clock[0] = time.perf_counter()
    return struct.pack("d", _leader_clock[0]) + data


def read_clock(data: bytes) -> bytes:
    """Ranks 1..: rank 0's clock off the shared messages; the messages."""
    (_leader_clock[0],) = struct.unpack_from("d", data)
    return data[8:]


def leader_clock() -> float:
    return _leader_clock[0]


def bucket(bs: int) -> int:
    """1, 2, 4, 8, ...: batch sizes whose steps cost about the same."""
    return 1 << (bs - 1).bit_length()


@dataclass
class Charge:
    """A verify whose cost is still being added up: the plain steps after it refill the
    pipeline."""

    bucket: int
    seconds: float
    refill: int = REFILL  # plain steps still to charge
    counts: bool = True  # False: a warm-up, or a wait for work: not a verify's cost


class StepCosts:
    def __init__(self) -> None:
        self.seconds: dict[tuple[str, int], float] = {}  # (kind, bucket) -> average cost
        self.seen: set[tuple[str, int]] = set()  # the first interval of each is a warm-up
        self.declined: dict[int, int] = {}  # by bucket: verify steps declined since the last
        self.wasted: dict[int, float] = {}  # by bucket: drains that verified nothing
        self.since_plain: dict[int, int] = {}  # by bucket: verifies since a plain cost
        self.since_verify: dict[int, int] = {}  # by bucket: plain steps since a verify cost
        self._open: tuple[str, int, float] | None = None  # the step running: kind, bucket, start
        self._charge: Charge | None = None

    def start(self, kind: str | None, bs: int, now: float | None = None) -> None:
        """A step begins: "plain", "verify" or "drained" (a plain step after a drain) for a
        decode batch of bs requests that could speculate, None for any other (a prefill, a
        batch with a grammar). The interval since the last start is that step's cost."""
        now = time.perf_counter() if now is None else now
        if self._open is not None:
            kind_before, b, began = self._open
            self._close(kind_before, b, now - began)
        if kind is None:
            self._commit()
        self._open = (kind, bucket(bs), now) if kind is not None else None

    def _close(self, kind: str, b: int, spent: float) -> None:
        warm_up = (kind, b) not in self.seen
        self.seen.add((kind, b))  # compilation, a pipeline filling: not a step's cost
        plain = self.seconds.get(("plain", b))
        charge = self._charge
        if charge is not None and (kind == "verify" or charge.bucket != b):
            self._commit()
            charge = None
        if kind == "verify":
            self.since_plain[b] = self.since_plain.get(b, REMEASURE) + 1
            verify = self.seconds.get(("verify", b))
            waited = verify is not None and spent > WAIT * verify
            self._charge = Charge(
                b, spent + self.wasted.pop(b, 0.0), counts=not (warm_up or waited)
            )
        elif charge is not None:  # refilling the pipeline: the difference is the verify's
            if plain is not None:
                charge.seconds += spent - plain
                charge.counts &= spent < WAIT * plain
            charge.refill -= 1
            if charge.refill == 0:
                self._commit()
        elif warm_up or (plain is not None and spent > WAIT * plain):
            pass  # not a step's cost
        elif kind == "drained":
            if plain is not None:
                self.wasted[b] = self.wasted.get(b, 0.0) + max(spent - plain, 0.0)
        else:
            self.seconds[("plain", b)] = spent if plain is None else average(plain, spent)
            self.since_plain[b] = 0
            self.since_verify[b] = self.since_verify.get(b, 0) + 1
            if self.since_verify[b] >= EXPIRE:  # too old to go by: measured again
                self.seconds.pop(("verify", b), None)

    def _commit(self) -> None:
        """The verify being charged is complete: into its bucket's average."""
        charge, self._charge = self._charge, None
        if charge is None or not charge.counts:
            return
        key, spent = ("verify", charge.bucket), max(charge.seconds, 0.0)
        self.since_verify[charge.bucket] = 0
        old = self.seconds.get(key)
        self.seconds[key] = spent if old is None else average(old, spent)

    def ratio(self, bs: int) -> float:
        """What a verify step costs in plain steps, at this batch size."""
        b = bucket(bs)
        plain, verify = self.seconds.get(("plain", b)), self.seconds.get(("verify", b))
        return verify / plain if plain and verify is not None else PRIOR

    def measured(self, bs: int) -> bool:
        """Whether both costs at this batch size are measured (else `ratio` is the prior)."""
        b = bucket(bs)
        return ("plain", b) in self.seconds and ("verify", b) in self.seconds

    def pays(self, bs: int, expected: float) -> bool:
        """Whether a verify step that is expected to accept `expected` drafts beats a plain
        step; a bucket declined RETRY times in a row gets one verify step to measure, and
        one whose plain cost is missing or old measures it first."""
        b = bucket(bs)
        if ("verify", b) in self.seconds and self.since_plain.get(b, REMEASURE) >= REMEASURE:
            return False
        if bs + expected >= bs * self.ratio(bs):
            self.declined[b] = 0
            return True
        self.declined[b] = self.declined.get(b, 0) + 1
        if self.declined[b] >= RETRY:
            self.declined[b] = 0
            return True
        return False


def average(old: float, new: float) -> float:
    return (1 - WEIGHT) * old + WEIGHT * new
