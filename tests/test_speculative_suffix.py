"""Suffix drafts: the tree's counts, its bounds and eviction, drafts sized by frequency, and
greedy output equal to Hugging Face's and to plain decoding under chunks, pages of 16,
preemption and overlap scheduling."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from helpers import SMOL, TINY, hf_greedy, need

from minisgl.core import Req, SamplingParams
from minisgl.llm import LLM
from minisgl.speculative.suffix import DEPTH, MIN_PROB, ROOT, SuffixDrafter, SuffixTree

pytestmark = pytest.mark.usefixtures("serial")  # from conftest.py

KW = dict(dtype=torch.float32, device="cpu", max_running_req=4, max_seq_len_override=192)


def substrings(seqs: list[list[int]], depth: int) -> Counter:
    """Every substring of up to `depth` tokens, counted: what the tree must hold."""
    return Counter(
        tuple(s[i : i + n])
        for s in seqs
        for n in range(1, depth + 1)
        for i in range(len(s) - n + 1)
    )


def contents(tree: SuffixTree) -> Counter:
    out: Counter = Counter()
    todo = [((), ROOT)]
    while todo:
        path, node = todo.pop()
        for token, child in tree.children[node].items():
            out[path + (token,)] = tree.counts[child]
            todo.append((path + (token,), child))
    return out


def test_the_tree_counts_every_substring_up_to_its_depth_and_forgets_exactly() -> None:
    rng = random.Random(0)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
    tree = SuffixTree(depth=5)
    ends = tree.extend([ROOT], seqs[0][:7])  # one sequence in two pieces
    tree.extend(ends, seqs[0][7:])
    for s in seqs[1:]:
        tree.extend([ROOT], s)
    want = substrings(seqs, 5)
    assert contents(tree) == want and tree.num_nodes == len(want)
    for s in seqs[:3]:
        tree.remove(s)
    want = substrings(seqs[3:], 5)
    assert contents(tree) == want and tree.num_nodes == len(want)
    tree.extend([ROOT], seqs[0])  # into nodes taken out before
    want = substrings([seqs[0], *seqs[3:]], 5)
    assert contents(tree) == want and tree.num_nodes == len(want)
    assert len(tree.counts) == 1 + tree.num_nodes + len(tree.unused)


def test_drafts_follow_the_longest_match_and_their_length_follows_the_counts() -> None:
    tree = SuffixTree()
    story = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    tree.extend([ROOT], story)
    # A match of 3 tokens drafts at most 3, all likely (one occurrence, one way on).
    assert tree.draft([5, 11, 12, 13], 8) == ([14, 15, 16], 3.0)
    assert tree.draft([5, 6, 7], 8) == ([], 0.0)  # nothing matches
    assert tree.draft([5, 13], 8) == ([], 0.0)  # one token is too short a match
    # After "1 .. 6" the text forks, and forks again: the likeliest branch (the first seen,
    # where counts tie) is drafted while the product of its shares stays >= MIN_PROB.
    fork = SuffixTree()
    stem = [1, 2, 3, 4, 5, 6]
    for tail, times in [([7, 8, 9, 10, 11], 1), ([7, 8, 9, 12], 1), ([7, 8, 13], 2)]:
        for _ in range(times):
            fork.extend([ROOT], stem + tail)
    for tail, times in [([7, 14], 4), ([15], 8)]:
        for _ in range(times):
            fork.extend([ROOT], stem + tail)
    drafts, expected = fork.draft([0, *stem], 8)
    assert drafts == [7, 8, 9] and expected == pytest.approx(0.5 + 0.25 + 0.125)
    assert MIN_PROB > 0.125 * 0.5  # 10 or 12 after "7 8 9": a coin toss too many
    # Past the deepest level the match is found again, drafts included.
    long = list(range(100, 100 + 3 * DEPTH))
    tree.extend([ROOT], long)
    assert tree.draft(long[:DEPTH], 3 * DEPTH)[0] == long[DEPTH : 2 * DEPTH - 1]


def finished(uid: int, prompt: list[int], output: list[int]) -> Req:
    req = Req(torch.tensor(prompt), 0, 0, len(output), uid, SamplingParams())
    for t in output:
        req.append_host(t)
    return req


def test_ends_carried_a_token_a_step_find_the_match_a_search_from_the_root_finds() -> None:
    """The drafter keeps where each request's suffixes end in both trees and moves them by
    the tokens that came (`follow`, `extend`); the longest of them with a continuation is
    the match a bisection over the text finds, in its own tree (which holds the text), in
    a shared one (which does not), and past tokens not in either (pending drafts)."""
    rng = random.Random(3)
    shared = SuffixTree(depth=6)
    for _ in range(8):
        shared.extend([ROOT], [rng.randrange(5) for _ in range(30)])
    text = [rng.randrange(5) for _ in range(60)]
    own, ends, theirs = SuffixTree(depth=6), [ROOT], [ROOT]
    lengths = set()
    for i, token in enumerate(text):
        ends, theirs = own.extend(ends, [token]), shared.follow(theirs, [token])
        tail = text[max(0, i - 4) : i + 1]
        assert own.longest(ends) == own.match(tail)
        assert shared.longest(theirs) == shared.match(tail)
        lengths.add(shared.longest(theirs)[0])
        more = [rng.randrange(5) for _ in range(3)]
        longer = (tail + more)[-5:]
        assert own.longest(own.follow(ends, more)) == own.match(longer)
        assert shared.longest(shared.follow(theirs, more)) == shared.match(longer)
    assert {1, 2, 3, 4, 5} == lengths  # matches of every length came


def test_a_requests_ends_in_the_shared_tree_are_found_again_after_it_changes() -> None:
    """A request that finished changes the shared tree (its output comes in, the oldest go
    out and their nodes are used again): the others' ends there are walked again."""
    drafter = SuffixDrafter(shared_tokens=40)
    req = Req(torch.tensor([1, 2, 3, 4]), 0, 0, 16, 0, SamplingParams())
    assert drafter.propose([req], [4]) == [[]]
    drafter.learn(finished(1, [9], [2, 3, 4, 5, 6, 7]))  # after "2 3 4": "5 6 7"
    assert drafter.propose([req], [4]) == [[5, 6, 7]]
    for uid in range(2, 12):  # pushes it out, reusing its nodes for other tokens
        drafter.learn(finished(uid, [0], [20 + uid] * 8))
    assert 1 not in drafter.outputs
    assert drafter.propose([req], [4]) == [[]]


def test_the_shared_tree_is_bounded_and_evicts_the_oldest_outputs() -> None:
    rng = random.Random(1)
    drafter = SuffixDrafter(shared_tokens=200)
    outputs = {}
    for uid in range(30):
        prompt = [rng.randrange(50) for _ in range(12)]
        output = [rng.randrange(50) for _ in range(rng.randrange(20, 40))]
        outputs[uid] = prompt[-(DEPTH - 1) :] + output  # what an answer follows is learned too
        drafter.learn(finished(uid, prompt, output))
        assert drafter.held <= 200
        assert drafter.shared.num_nodes <= DEPTH * drafter.held
    kept = list(drafter.outputs)
    assert kept == list(range(30 - len(kept), 30))  # the newest stay, in order
    assert contents(drafter.shared) == substrings([outputs[u] for u in kept], DEPTH)
    # A request seen again (preempted, then finished) replaces its earlier output.
    last = kept[-1]
    drafter.learn(finished(last, [1, 2, 3], [4, 5, 6, 7]))
    assert drafter.outputs[last] == [1, 2, 3, 4, 5, 6, 7]
    assert contents(drafter.shared) == substrings(
        [drafter.outputs[u] for u in drafter.outputs], DEPTH
    )
    drafter.learn(finished(99, [1, 2], []))  # nothing generated: nothing learned
    assert 99 not in drafter.outputs


def test_a_requests_own_tree_follows_its_tokens_and_is_learned_when_it_leaves() -> None:
    drafter = SuffixDrafter()
    prompt = [7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    req = Req(torch.tensor(prompt), 0, 0, 8, 0, SamplingParams())
    assert drafter.propose([req], [4]) == [[1, 2, 3]]  # as long as "7 8 9" matched
    req.append_host(1)
    assert drafter.propose([req], [4]) == [[2, 3, 4, 5]]
    assert drafter.propose([req], [0]) == [[]]  # switched off: nothing asked
    drafter.retain(set())  # it left: its output is in the shared tree
    assert not drafter.own and drafter.outputs[0][-1] == 1
    other = Req(torch.tensor([40, 41, 7, 8, 9]), 1, 0, 8, 1, SamplingParams())
    assert drafter.propose([other], [2]) == [[1]]  # from the first request's answer


def test_trees_are_as_deep_as_the_drafts_a_request_may_ask_for() -> None:
    """More drafts than the default (`--num-draft-tokens 15`): a request that copies its
    prompt gets as many as it asks for, where trees of the default depth stop at the 9
    tokens their match carries; the engine's drafter gets trees that deep, and one more
    (the guess before the drafts of a verify launched behind a plain step)."""
    text = list(range(100, 140))
    req = Req(torch.tensor(text + text[:20]), 0, 0, 64, 0, SamplingParams())
    assert SuffixDrafter().propose([req], [16]) == [text[20 : 20 + DEPTH - 1]]
    assert SuffixDrafter(depth=17).propose([req], [16]) == [text[20:36]]
    llm = LLM(str(need(TINY["llama"])), **KW, speculative="suffix", num_draft_tokens=15)
    drafter = llm.scheduler.spec.drafter
    llm.shutdown()
    assert isinstance(drafter, SuffixDrafter) and drafter.depth == 18


PROMPTS = [
    "Copy this line twice: the cat sat on the mat. the cat sat on the mat.",
    "def area(w, h):\n    return w * h\n\ndef area(w, h):\n",
    "Write the numbers from 1 to 12, separated by commas.",
    "Hi",
]


def test_smollm2_greedy_equals_hugging_face_and_learns_from_earlier_answers() -> None:
    path = need(SMOL)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    kw = dict(KW, num_page_override=512, speculative_max_bs=4, speculative_always=True)
    llm = LLM(str(path), **kw, speculative="suffix")
    spec = llm.scheduler.spec
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    want = [hf_greedy(path, i, 16) for i in ids]
    first = [o["token_ids"] for o in llm.generate(ids, params, use_tqdm=False)]
    once = spec.num_accepted, spec.num_steps
    again = [o["token_ids"] for o in llm.generate(ids[::-1], params, use_tqdm=False)][::-1]
    llm.scheduler.check_integrity()
    llm.shutdown()
    assert first == want and again == want
    accepted, verified = spec.num_accepted - once[0], spec.num_steps - once[1]
    assert accepted / verified > 2 * once[0] / once[1]  # the first answers draft the second


@pytest.mark.parametrize("overlap", [False, True])
def test_tiny_model_greedy_equal_under_chunks_pages_of_16_and_preemption(monkeypatch, overlap):
    from minisgl.env import ENV

    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", not overlap)
    gen = torch.Generator().manual_seed(3)
    stem = torch.randint(0, 1000, (20,), generator=gen).tolist()
    prompts = [stem + stem[: 3 + i] for i in range(3)] + [stem[:9] * 2]
    params = [SamplingParams(max_tokens=20 + 3 * i, ignore_eos=True) for i in range(4)]
    kw = dict(KW, page_size=16, num_page_override=6, max_prefill_length=12)
    plain = LLM(str(need(TINY["qwen3"])), **kw)
    want = [o["token_ids"] for o in plain.generate(prompts, params, use_tqdm=False)]
    plain.shutdown()
    llm = LLM(str(TINY["qwen3"]), **kw, speculative="suffix", speculative_max_bs=4)
    got = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    again = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    s = llm.scheduler
    s.check_integrity()
    llm.shutdown()
    assert got == want and again == want
    assert s.spec.num_accepted > 0 and s.num_preemptions > 0 and s.overlap == overlap
