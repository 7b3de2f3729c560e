"""N-gram drafts (prompt lookup): the text that followed the last few tokens last time.

A request that edits, repeats or continues text it was given says again what is already in
its prompt or its output. So the drafter takes the request's last n tokens, finds where
they occurred before in the same request (the most recent place), and proposes the tokens
that followed there. It tries the longest n first: a longer match is a better predictor,
and stops at n = 2: a match of one token proposes mostly wrong drafts (on SmolLM2's
outputs it makes half of all steps verify, for a few more tokens than n >= 2 finds).
No model and no device memory; the search is numpy over the request's own tokens.

Every drafter answers `propose(reqs, ks)`: up to ks[i] tokens for request i, from the
request's tokens so far (`req.input_ids`, the prompt and what it has generated), and
`retain(uids)`: forget every request that is not in `uids` (finished, aborted, preempted).
The prompt-lookup drafters also take `pending`: tokens request i is assumed to have after
those (a verify's drafts still in flight), to draft what would follow them.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from minisgl.core import Req

WINDOW = 4096  # only the most recent tokens are searched: the cost stays flat with length


class NgramDrafter:
    def __init__(self, max_n: int = 4, min_n: int = 2) -> None:
        self.max_n, self.min_n = max_n, min_n

    def propose(
        self, reqs: list[Req], ks: list[int], pending: list[list[int]] | None = None
    ) -> list[list[int]]:
        drafts = []
        for i, (req, k) in enumerate(zip(reqs, ks)):
            tokens = req.input_ids.numpy()
            if pending:
                tokens = np.concatenate([tokens, np.asarray(pending[i], tokens.dtype)])
            drafts.append(self.lookup(tokens, k) if k > 0 else [])
        return drafts

    def retain(self, uids: set[int]) -> None:
        pass  # it keeps nothing between steps

    def lookup(self, tokens: np.ndarray, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix
        of `tokens` (a request's prompt and output so far); [] when nothing matches."""
        tokens = tokens[-WINDOW:]
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows that end before the last token, so a continuation exists.
            windows = sliding_window_view(tokens[: length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []
