"""The decode manager: the requests past their prompt, one new token each per step."""

from __future__ import annotations

from minisgl.core import Batch, Req


class DecodeManager:
    def __init__(self) -> None:
        self.running: list[Req] = []  # in admission order: the newest is preempted first

    def add(self, reqs: list[Req]) -> None:
        self.running.extend(reqs)

    def remove(self, req: Req) -> None:
        self.running.remove(req)

    @property
    def has_work(self) -> bool:
        return bool(self.running)

    def schedule(self) -> Batch | None:
        # A request with no tokens left is only waiting for its last result to be processed.
        reqs = [req for req in self.running if req.remain_len > 0]
        return Batch(reqs, "decode") if reqs else None
