"""Overlap scheduling: the host runs one batch behind the device, and nothing may show it.

The same requests run with overlap on and off must give the same tokens, which are
Hugging Face's greedy tokens for each request alone, cut at EOS, a stop token or
max_tokens. A request that ends on EOS is already in the next launched batch when the
host finds out (the lag case): that extra token must never be sent, and its pages and
row must be freed exactly once.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest
import torch
from helpers import SMOL, hf_greedy, need

from minisgl.core import Batch, SamplingParams
from minisgl.env import ENV
from minisgl.message.backend import AbortMsg, TokenMsg, UserMsg
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler
from minisgl.tokenizer.tokenizer import Tokenizer

MAX_NEW = 8
EOS = 2
CHATS = [
    "Reply with one word: yes or no?",  # "Yes." then EOS
    "What is 1+1? Reply with a number only.",  # "1 + 1 = 2" then EOS
    "Is the sky blue? Answer yes or no.",  # "No." then EOS
]
PLAIN = [
    "1, 2, 3, 4,",
    "The capital of France is",
    "Once upon a time",
    "Hello",
    "In the middle of the night, the old lighthouse keeper climbed the stairs once more "
    "to check the lamp, as he had done every evening for forty years.",
]
_uids = itertools.count()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tok = Tokenizer(need(SMOL))
    chats = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    return [tok.encode(t) for t in chats + PLAIN]


def reference(ids: list[int]) -> list[int]:
    return hf_greedy(SMOL, ids, MAX_NEW)


def expected(ids: list[int], params: SamplingParams) -> tuple[list[int], str]:
    """HF's greedy tokens cut where the request must finish, and the reason."""
    out = []
    for token in reference(ids)[: params.max_tokens]:
        out.append(token)
        if token in params.stop_token_ids or (not params.ignore_eos and token == EOS):
            return out, "stop"
    return out, "length"


def workload(prompts: list[list[int]]) -> list[tuple[list[int], SamplingParams]]:
    counting = reference(prompts[3])
    stop = counting[1]  # a token HF produces early, to stop on
    assert stop not in counting[:1] and stop != EOS
    return [
        (prompts[0], SamplingParams(max_tokens=MAX_NEW)),  # EOS early
        (prompts[1], SamplingParams(max_tokens=MAX_NEW)),  # EOS on the last allowed token
        (prompts[2], SamplingParams(max_tokens=MAX_NEW)),  # EOS early
        (prompts[3], SamplingParams(max_tokens=MAX_NEW, stop_token_ids=[stop])),
        (prompts[4], SamplingParams(max_tokens=5)),
        (prompts[5], SamplingParams(max_tokens=MAX_NEW, stop_token_ids=[EOS + 1])),
        (prompts[6], SamplingParams(max_tokens=1)),
        (prompts[7], SamplingParams(max_tokens=6, ignore_eos=True)),
        (prompts[0], SamplingParams(max_tokens=5, ignore_eos=True)),  # goes past EOS
    ]


def make_scheduler(monkeypatch, overlap: bool, **kw) -> Scheduler:
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", not overlap)
    kw.setdefault("max_running_req", 4)
    kw.setdefault("num_page_override", 512)
    kw.setdefault("cache_type", "naive")
    config = SchedulerConfig(
        str(SMOL), dtype=torch.float32, device="cpu", max_seq_len_override=128, **kw
    )
    sched = Scheduler(config, {EOS})
    assert sched.overlap == overlap
    return sched


class Recorder:
    """Counts, per request, the forwards that would produce a real token for it."""

    def __init__(self, sched: Scheduler) -> None:
        self.runs: dict[int, int] = defaultdict(int)
        forward = sched.engine.forward_batch

        def record(batch: Batch):
            for r in batch.reqs:
                self.runs[r.uid] += r.device_len >= len(r.input_ids)
            return forward(batch)

        sched.engine.forward_batch = record  # type: ignore[method-assign]


def run(
    sched: Scheduler, work: list[tuple[list[int], SamplingParams]], later_at: int = 3
) -> tuple[dict[int, list[TokenMsg]], list[int]]:
    """Half the requests at once, the rest before step `later_at`; integrity after every step."""
    msgs = [UserMsg(next(_uids), list(ids), params) for ids, params in work]
    half = len(msgs) // 2
    for msg in msgs[:half]:
        sched.add_request(msg)
    out: dict[int, list[TokenMsg]] = defaultdict(list)
    rows = sched.engine.config.max_running_req
    for step in range(500):
        if step == later_at:
            for msg in msgs[half:]:
                sched.add_request(msg)
        if step > later_at and not sched.has_work:
            break
        for m in sched.step():
            assert not any(x.finished for x in out[m.uid]), (
                f"request {m.uid} got token {m.token} after its finished message"
            )
            out[m.uid].append(m)
        sched.check_integrity()
        assert sched.table.available + len(sched.reqs) == rows
    else:
        pytest.fail("the scheduler never finished")
    assert not sched.reqs and sched.table.available == rows, "rows not all free at the end"
    sched.check_integrity()
    return out, [m.uid for m in msgs]


def check_outputs(out, uids, work, label: str) -> list[tuple[list[int], str]]:
    results = []
    for uid, (ids, params) in zip(uids, work):
        msgs = out[uid]
        want, reason = expected(ids, params)
        got = [m.token for m in msgs]
        assert got == want, f"{label}: request {uid} gave {got}, HF alone {want}"
        assert [m.finished for m in msgs] == [False] * (len(msgs) - 1) + [True]
        assert msgs[-1].finish_reason == reason, f"{label}: request {uid}"
        results.append((got, reason))
    return results


def test_overlap_on_and_off_give_the_same_tokens(monkeypatch, prompts) -> None:
    work = workload(prompts)
    results = {}
    for overlap, cache_type in [(False, "naive"), (True, "naive"), (True, "radix")]:
        label = f"overlap={overlap}, {cache_type}"
        sched = make_scheduler(monkeypatch, overlap, cache_type=cache_type)
        out, uids = run(sched, work)
        results[label] = check_outputs(out, uids, work, label)
        pages = sched.cache.allocator.num_free + sched.cache.cache.evictable_tokens
        assert pages == sched.engine.num_pages, f"{label}: KV pages leaked"
        assert sched.cache.cache.protected_tokens == 0, f"{label}: cache locks leaked"
        sched.shutdown()
    first, *others = results.values()
    assert all(r == first for r in others)
    assert {reason for _, reason in first} == {"stop", "length"}


def test_lagged_token_of_a_finished_request_is_dropped(monkeypatch, prompts) -> None:
    # Three requests ending on EOS early, next to one that keeps going: with overlap, each EOS
    # is only seen after the next decode batch (with the request in it) was launched.
    work = [
        (prompts[0], SamplingParams(max_tokens=MAX_NEW)),
        (prompts[2], SamplingParams(max_tokens=MAX_NEW)),
        (prompts[7], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)),
        (prompts[1], SamplingParams(max_tokens=MAX_NEW)),
    ]
    extra = {}
    for overlap in (False, True):
        sched = make_scheduler(monkeypatch, overlap, max_running_req=4)
        rec = Recorder(sched)
        out, uids = run(sched, work, later_at=0)
        check_outputs(out, uids, work, f"overlap={overlap}")
        extra[overlap] = {uid: rec.runs[uid] - len(out[uid]) for uid in uids}
        assert sched.cache.allocator.num_free == sched.engine.num_pages, "KV pages leaked"
        sched.shutdown()
    assert set(extra[False].values()) == {0}, f"serial runs computed extra tokens: {extra[False]}"
    eos_uids = [uid for uid, (_, p) in zip(uids, work) if not p.ignore_eos]
    assert all(extra[True][uid] == 1 for uid in eos_uids[:2]), (
        f"the lag case did not happen (forwards minus tokens sent: {extra[True]}): "
        "the test proves nothing"
    )
    assert all(n <= 1 for n in extra[True].values())


def test_abort_under_overlap_frees_everything(monkeypatch, prompts) -> None:
    sched = make_scheduler(monkeypatch, True)
    keep = UserMsg(next(_uids), prompts[7], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    drop = UserMsg(next(_uids), prompts[5], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    sched.add_request(keep)
    sched.add_request(drop)
    out: dict[int, list[TokenMsg]] = defaultdict(list)
    for _ in range(3):
        for m in sched.step():
            out[m.uid].append(m)
    assert sched.in_flight is not None and drop.uid in sched.reqs
    sched.abort(AbortMsg(drop.uid))  # its batch is still in flight
    sched.check_integrity()
    while sched.has_work:
        for m in sched.step():
            out[m.uid].append(m)
        sched.check_integrity()
    n = len(out[drop.uid])
    assert [m.token for m in out[drop.uid]] == reference(prompts[5])[:n]
    assert n < MAX_NEW and not any(m.finished for m in out[drop.uid])
    assert [m.token for m in out[keep.uid]] == reference(prompts[7])
    assert not sched.reqs and sched.table.available == sched.engine.config.max_running_req
    assert sched.cache.allocator.num_free == sched.engine.num_pages
    sched.shutdown()


@pytest.mark.parametrize("cache_type", ["naive", "radix"])
def test_preemption_under_overlap(monkeypatch, prompts, cache_type: str) -> None:
    # 8 pages of 4 tokens for requests that want about 16 at once.
    sched = make_scheduler(
        monkeypatch,
        True,
        max_running_req=4,
        page_size=4,
        num_page_override=8,
        cache_type=cache_type,
    )
    work = [(ids, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)) for ids in prompts[3:7]]
    out, uids = run(sched, work, later_at=0)
    assert sched.num_preemptions > 0, "the pool was never short: the test proves nothing"
    check_outputs(out, uids, work, f"overlap, preemption, {cache_type}")
    sched.shutdown()
