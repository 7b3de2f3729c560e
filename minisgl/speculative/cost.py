"""When a verify step pays: step times measured as the engine runs, against the tokens the
drafts are expected to add.

A verify step makes a batch of bs requests produce bs tokens plus the drafts it accepts,
in more time than a plain step: on the H200 with SmolLM2, 1.7-1.9 ms against 0.76 ms at
batch 1 (it cannot overlap the host's work with the device's, see step.py), 2.8 against
1.3 ms at batch 32. It pays when (bs + E) / verify time > bs / plain time, E the drafts
expected to be accepted: a draft j positions deep is taken with probability a^j, a the
request's acceptance rate, so E = sum over requests and drafts of a^j.

Both times are measured here, per batch-size bucket, as the interval from one scheduler
step to the next (which is what a step costs the requests, host and device together), in
a moving average. Until a bucket has both, a verify step is assumed to cost PRIOR plain
steps. A bucket where verifying stopped paying is re-tried now and then (every RETRY
declined batches), so the measurement follows the workload.
"""

from __future__ import annotations

import time

PRIOR = 2.0  # verify / plain step time where not measured yet
RETRY = 64  # declined verify steps in a bucket before one is run anyway, to measure again
WEIGHT = 0.2  # of the newest interval in the moving average


def bucket(bs: int) -> int:
    """1, 2, 4, 8, ...: batch sizes whose steps cost about the same."""
    return 1 << (bs - 1).bit_length()


class StepCosts:
    def __init__(self) -> None:
        self.seconds: dict[tuple[str, int], float] = {}  # (kind, bucket) -> average step
        self.seen: set[tuple[str, int]] = set()  # the first interval of each is a warm-up
        self.declined: dict[int, int] = {}  # by bucket: verify steps declined since the last
        self._open: tuple[str, int, float] | None = None  # the step running: kind, bucket, start

    def start(self, kind: str | None, bs: int, now: float | None = None) -> None:
        """A step begins: "plain" or "verify" for a decode batch of bs requests that could
        speculate, None for any other (a prefill, a batch with a grammar). The interval
        since the last start is that step's cost."""
        now = time.perf_counter() if now is None else now
        if self._open is not None:
            key = self._open[:2]
            spent, old = now - self._open[2], self.seconds.get(key)
            if key not in self.seen:
                self.seen.add(key)  # compilation, a pipeline filling: not a step's cost
            elif old is None:
                self.seconds[key] = spent
            elif spent < 4 * old:  # longer: the scheduler waited for work
                self.seconds[key] = (1 - WEIGHT) * old + WEIGHT * spent
        self._open = (kind, bucket(bs), now) if kind is not None else None

    def ratio(self, bs: int) -> float:
        """What a verify step costs in plain steps, at this batch size."""
        b = bucket(bs)
        plain, verify = self.seconds.get(("plain", b)), self.seconds.get(("verify", b))
        return verify / plain if plain and verify else PRIOR

    def pays(self, bs: int, expected: float) -> bool:
        """Whether a verify step that is expected to accept `expected` drafts beats a plain
        step; a bucket declined RETRY times in a row gets one verify step to measure."""
        b = bucket(bs)
        if bs + expected >= bs * self.ratio(bs):
            self.declined[b] = 0
            return True
        self.declined[b] = self.declined.get(b, 0) + 1
        if self.declined[b] >= RETRY:
            self.declined[b] = 0
            return True
        return False
