"""Suffix drafts: what followed the text's longest matching suffix, in this request and in
the answers of earlier ones, as far as the counts say it is likely.

N-gram lookup (ngram.py) finds drafts only where a request repeats its own prompt. Much of
what a service generates also repeats what *other* requests generated: the same openings
of answers, the same JSON keys, the same boilerplate. So this drafter keeps two trees of
the same kind: one per request over its prompt and output, and one shared by all over
the outputs of earlier requests (the requests it drafted for), bounded by the tokens it
holds: the oldest outputs leave first.

The tree is a suffix trie cut at DEPTH: every substring of up to DEPTH tokens of the
sequences added is a path from the root, and each node counts how often its substring
occurred. Adding a token visits at most DEPTH nodes (the ends of the suffixes that the
token extends), so the cost per token is flat and a tree holds at most DEPTH nodes per
token. To draft, take the longest suffix of the request's text that occurred before with
a continuation (a suffix that occurred followed by a token has shorter suffixes that did
too), then follow the most frequent child, token by token. The drafter keeps, for each
request, the nodes where its text's suffixes end in both trees and moves them by the
tokens that came, so a step finds its match without a walk from the root. The share of
that child among its siblings estimates the chance it comes next; their product, the chance
that the whole run so far is right. The run stops where that falls below MIN_PROB, or where
it is as long as the match (a text that followed another for m tokens is trusted about m
tokens further), or at k. So the frequencies choose the draft length: a phrase that always
continued the same way drafts far, one that forked drafts little. The tree that offers
more expected tokens (the sum of those chances) wins.

Every drafter answers `propose(reqs, ks)` and `retain(uids)` (see ngram.py); this one keeps
what it learned from a request when `retain` no longer lists it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from minisgl.core import Req

DEPTH = 10  # the longest substring a tree counts; a match of DEPTH - 1 covers 8 drafts
# and the guess after them (more drafts a request: `SuffixDrafter(depth=k + 2)`)
MIN_MATCH = 2  # a match of one token guesses mostly wrong (as for n-gram drafts)
MIN_PROB = 0.1  # a draft token is proposed while the run up to it is at least this likely
OWN_WINDOW = 4096  # a request's tree starts from its last tokens: its cost stays bounded
SHARED_TOKENS = 16384  # earlier outputs the shared tree holds; at most DEPTH nodes a token


ROOT = 0


class SuffixTree:
    """The substrings of up to `depth` tokens of every sequence added, with their counts.

    A node is a number: its children (token -> node) and its count live in two lists.
    A tree holds up to DEPTH nodes per token; as objects of their own they made every full
    pass of Python's garbage collector walk them all, and adding a token cost five times
    more. Dicts of ints are not tracked by the collector, so these cost it nothing.
    """

    def __init__(self, depth: int = DEPTH) -> None:
        self.depth = depth
        self.children: list[dict[int, int]] = [{}]  # node 0 is the root, the empty string
        self.counts = [0]  # occurrences of the substring each node ends
        self.unused: list[int] = []  # nodes taken out, to be used again
        self.num_nodes = 0  # below the root
        self.version = 0  # changes whenever nodes come or go: a walk made before is stale

    def extend(self, ends: list[int], tokens: list[int]) -> list[int]:
        """Add tokens to a sequence. `ends[i]` is the node of its suffix of i tokens
        (`[ROOT]` for a new sequence); returns the ends after the new tokens."""
        children, counts = self.children, self.counts
        self.version += 1
        for token in tokens:
            after = [ROOT]
            for node in ends:
                child = children[node].get(token)
                if child is None:
                    child = children[node][token] = self._new()
                counts[child] += 1
                if len(after) < self.depth:  # a suffix of depth tokens extends no further
                    after.append(child)
            ends = after
        return ends

    def remove(self, tokens: list[int]) -> None:
        """Take out a sequence that was added whole: every count it added, and the nodes
        only it had (their own children go in the same walk)."""
        children, counts = self.children, self.counts
        self.version += 1
        ends = [ROOT]
        for token in tokens:
            after = [ROOT]
            for node in ends:
                child = children[node][token]
                counts[child] -= 1
                if counts[child] == 0:
                    del children[node][token]
                    self.unused.append(child)
                    self.num_nodes -= 1
                if len(after) < self.depth:
                    after.append(child)
            ends = after

    def _new(self) -> int:
        self.num_nodes += 1
        if self.unused:
            return self.unused.pop()
        self.children.append({})
        self.counts.append(0)
        return len(self.counts) - 1

    def follow(self, ends: list[int], tokens: list[int]) -> list[int]:
        """As `extend`, for a text the tree does not hold: `ends[i]` is the node of its
        suffix of i tokens for as long as that occurs in the tree (a suffix that does not
        occur has no longer one that does), and no count changes."""
        children, depth = self.children, self.depth
        for token in tokens:
            after = [ROOT]
            for node in ends:
                child = children[node].get(token)
                if child is None or len(after) == depth:
                    break
                after.append(child)
            ends = after
        return ends

    def longest(self, ends: list[int]) -> tuple[int, int]:
        """`match` for a text whose suffixes' nodes are `ends` (as `extend` and `follow`
        keep them): the longest that has a continuation, found without a walk."""
        children = self.children
        for length in range(len(ends) - 1, 0, -1):
            if children[ends[length]]:
                return length, ends[length]
        return 0, ROOT

    def match(self, text: list[int]) -> tuple[int, int]:
        """The longest suffix of `text` (at most depth - 1 tokens) that occurred followed
        by a token: its length and node; (0, ROOT) if none. The longest is tried first
        (a text that copies, or a draft run past the deepest level, has it), then the
        lengths between, by bisection."""
        best, lo, hi = (0, ROOT), 1, min(self.depth - 1, len(text))
        mid = hi
        while lo <= hi:
            node = self.find(text[len(text) - mid :])
            if node is not None and self.children[node]:
                best, lo = (mid, node), mid + 1
            else:
                hi = mid - 1
            mid = (lo + hi) // 2
        return best

    def find(self, tokens: list[int]) -> int | None:
        node: int | None = ROOT
        for token in tokens:
            node = self.children[node].get(token)
            if node is None:
                return None
        return node

    def draft(self, text: list[int], k: int) -> tuple[list[int], float]:
        """Up to k tokens that likely follow `text`, and the tokens of them expected to be
        right (the sum of each run's estimated probability)."""
        tail = text[-(self.depth - 1) :]
        return self.draft_at(tail, *self.match(tail), k)

    def draft_at(self, tail: list[int], length: int, node: int, k: int) -> tuple[list[int], float]:
        """`draft` where the match of `tail` (the text's last depth - 1 tokens, which grows
        by the drafts) is known: `length` tokens, ending at `node`."""
        if length < MIN_MATCH:
            return [], 0.0
        counts = self.counts
        drafts: list[int] = []
        prob, expected = 1.0, 0.0
        while len(drafts) < min(k, length):
            if not self.children[node]:  # the deepest level: match again, drafts included
                again, node = self.match(tail)
                if again < MIN_MATCH:
                    break
            after = self.children[node]
            token = max(after, key=lambda t: counts[after[t]])
            prob *= counts[after[token]] / sum(counts[c] for c in after.values())
            if prob < MIN_PROB:
                break
            drafts.append(token)
            tail.append(token)
            expected += prob
            node = after[token]
        return drafts, expected


@dataclass
class Own:
    """A request's tree and how far it has read the request's tokens."""

    req: Req
    tree: SuffixTree
    ends: list[int] = field(default_factory=lambda: [ROOT])
    read: int = 0  # tokens of req.input_ids added
    theirs: list[int] = field(default_factory=lambda: [ROOT])  # the same in the shared tree
    seen: int = -1  # the shared tree's version `theirs` was walked in


class SuffixDrafter:
    def __init__(self, shared_tokens: int = SHARED_TOKENS, depth: int = DEPTH) -> None:
        self.depth = depth  # a draft follows a match of up to depth - 1 tokens that far
        self.shared = SuffixTree(depth)
        self.capacity = shared_tokens
        self.outputs: OrderedDict[int, list[int]] = OrderedDict()  # in the shared tree, by uid
        self.held = 0  # tokens in self.outputs
        self.own: dict[int, Own] = {}  # by uid

    def propose(
        self, reqs: list[Req], ks: list[int], pending: list[list[int]] | None = None
    ) -> list[list[int]]:
        drafts = []
        for i, (req, k) in enumerate(zip(reqs, ks)):
            if k == 0:
                drafts.append([])
                continue
            own = self._read(req)  # its own tokens: pending ones may yet be rejected
            mine, theirs, more = own.ends, own.theirs, pending[i] if pending else []
            if more:
                mine, theirs = own.tree.follow(mine, more), self.shared.follow(theirs, more)
            mine, theirs = own.tree.longest(mine), self.shared.longest(theirs)
            if mine[0] < MIN_MATCH and theirs[0] < MIN_MATCH:
                drafts.append([])  # most steps of a chat: no tree is asked to draft
                continue
            tail = (req.tokens_from(-(self.depth - 1)) + more)[-(self.depth - 1) :]
            best = max(
                own.tree.draft_at(tail[:], *mine, k),
                self.shared.draft_at(tail, *theirs, k),
                key=lambda d: d[1],
            )
            drafts.append(best[0])
        return drafts

    def retain(self, uids: set[int]) -> None:
        for uid in [uid for uid in self.own if uid not in uids]:
            self.learn(self.own.pop(uid).req)

    def learn(self, req: Req) -> None:
        """Put a request's output into the shared tree, after the last prompt tokens that
        led to it (so that the start of an answer is found too); a request seen before (one
        that was preempted) replaces its earlier output. The oldest outputs leave while
        the tree holds more than its capacity."""
        if req.seq_len == req.prompt_len:
            return  # nothing generated
        start = max(0, req.prompt_len - (self.depth - 1))
        tokens = req.tokens_from(start)[-self.capacity :]
        self._forget(req.uid)
        self.shared.extend([ROOT], tokens)
        self.outputs[req.uid] = tokens
        self.held += len(tokens)
        while self.held > self.capacity:
            self._forget(next(iter(self.outputs)))

    def _forget(self, uid: int) -> None:
        tokens = self.outputs.pop(uid, None)
        if tokens is not None:
            self.shared.remove(tokens)
            self.held -= len(tokens)

    def _read(self, req: Req) -> Own:
        """The request's tree, up to date with its tokens (a new one from its last
        OWN_WINDOW tokens), and where its text's suffixes end in both trees. Those ends
        move by a token a step, so a step's match takes no walk from the root; in the
        shared tree they are walked again after it changed (a request finished)."""
        own = self.own.get(req.uid)
        if own is None:
            own = self.own[req.uid] = Own(req, SuffixTree(self.depth))
            own.read = max(0, req.seq_len - OWN_WINDOW)
        new = req.tokens_from(own.read) if own.read < req.seq_len else []
        if new:
            own.ends = own.tree.extend(own.ends, new)
            own.read = req.seq_len
        if own.seen != self.shared.version:
            own.theirs = self.shared.follow([ROOT], req.tokens_from(-(self.depth - 1)))
            own.seen = self.shared.version
        elif new:
            own.theirs = self.shared.follow(own.theirs, new)
        return own
