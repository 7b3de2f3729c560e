"""Chunked prefill: a prompt longer than the prefill budget is computed over several steps.

Whatever the budget and the page size, every request must give Hugging Face's greedy
tokens for that request alone; a chunk that is not a prompt's last must not emit a token;
and a long prompt must not keep short requests from finishing. The scheduler is driven
by hand, recording every batch the engine runs.
"""

from __future__ import annotations

import inspect
import itertools
import json.decoder
from collections import Counter, defaultdict

import pytest
import torch
from helpers import SMOL, hf_greedy, need

from minisgl.core import Batch, SamplingParams
from minisgl.message.backend import TokenMsg, UserMsg
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler
from minisgl.tokenizer.tokenizer import Tokenizer

MAX_NEW = 4
LENGTHS = [1, 7, 16, 17, 40, 120]  # prompt lengths: inside, at and across chunk and page edges
SHORT = [1, 7, 17]  # a budget of 1 token computes one prompt token per step: keep it short

_uids = itertools.count()


@pytest.fixture(scope="module")
def corpus() -> list[int]:
    # Real text, so that the model's greedy choices are confident, not near-ties.
    return Tokenizer(need(SMOL)).encode(inspect.getsource(json.decoder))


def prompt(corpus: list[int], n: int) -> list[int]:
    start = 37 * n % (len(corpus) - n)  # different text for each length
    return corpus[start : start + n]


def reference(ids: list[int], n: int) -> list[int]:
    return hf_greedy(SMOL, ids, MAX_NEW)[:n]


class Recorder:
    """Wraps the engine's forward to record, per step, who ran and whether it was a last chunk."""

    def __init__(self, sched: Scheduler) -> None:
        self.batches: list[tuple[str, list[tuple[int, int, bool]]]] = []
        forward = sched.engine.forward_batch

        def record(batch: Batch):
            rows = [(r.uid, r.extend_len, r.device_len >= len(r.input_ids)) for r in batch.reqs]
            self.batches.append((batch.phase, rows))
            return forward(batch)

        sched.engine.forward_batch = record  # type: ignore[method-assign]

    def prefill_chunks(self, uid: int) -> list[tuple[int, bool]]:
        return [
            (n, last)
            for phase, rows in self.batches
            if phase == "prefill"
            for u, n, last in rows
            if u == uid
        ]

    def emitting_runs(self, uid: int) -> int:
        """Forwards of `uid` that produce a real token: last chunks and decode steps."""
        return sum(last for _, rows in self.batches for u, _, last in rows if u == uid)


def make_scheduler(page_size: int, budget: int, **kw) -> Scheduler:
    kw.setdefault("num_page_override", 1024 // page_size)
    config = SchedulerConfig(
        str(SMOL),
        dtype=torch.float32,
        device="cpu",
        max_seq_len_override=256,
        max_running_req=8,
        page_size=page_size,
        max_prefill_length=budget,
        cache_type="naive",
        **kw,
    )
    return Scheduler(config, {2})


def run(sched: Scheduler, msgs: list[UserMsg], max_steps: int = 1000) -> dict[int, list[TokenMsg]]:
    for msg in msgs:
        sched.add_request(msg)
    out: dict[int, list[TokenMsg]] = defaultdict(list)
    for _ in range(max_steps):
        if not sched.has_work:
            break
        for m in sched.step():
            out[m.uid].append(m)
    else:
        pytest.fail(f"still busy after {max_steps} steps")
    return out


def check_request(out: dict[int, list[TokenMsg]], msg: UserMsg) -> list[int]:
    msgs = out[msg.uid]
    n = msg.sampling_params.max_tokens
    assert len(msgs) == n, f"request of {len(msg.input_ids)} tokens got {len(msgs)} tokens, not {n}"
    assert [m.finished for m in msgs] == [False] * (n - 1) + [True]
    assert msgs[-1].finish_reason == "length"
    return [m.token for m in msgs]


def assert_idle(sched: Scheduler) -> None:
    assert not sched.has_work and not sched.reqs
    sched.check_integrity()
    assert sched.cache.allocator.num_free == sched.engine.num_pages
    assert sched.table.available == sched.engine.config.max_running_req


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("budget", [1, 7, 16])
def test_chunked_outputs_equal_hf(corpus, budget: int, page_size: int) -> None:
    lengths = SHORT if budget == 1 else LENGTHS
    prompts = [prompt(corpus, n) for n in lengths]
    sched = make_scheduler(page_size, budget)
    rec = Recorder(sched)
    max_tokens = [MAX_NEW - i % 3 for i in range(len(prompts))]
    msgs = [
        UserMsg(next(_uids), ids, SamplingParams(max_tokens=n, ignore_eos=True))
        for ids, n in zip(prompts, max_tokens)
    ]
    out = run(sched, msgs)
    for msg, ids, n in zip(msgs, prompts, max_tokens):
        got = check_request(out, msg)
        assert got == reference(ids, n), (
            f"budget {budget}, page {page_size}: prompt of {len(ids)} tokens differs from HF alone"
        )
    for phase, rows in rec.batches:
        if phase == "prefill":
            total = sum(n for _, n, _ in rows)
            assert total <= budget, f"a prefill of {total} tokens, over the budget of {budget}"
    for msg in msgs:
        chunks = rec.prefill_chunks(msg.uid)
        # The prompt was computed exactly once, in order, and only its last chunk said so.
        assert sum(n for n, _ in chunks) == len(msg.input_ids)
        assert [last for _, last in chunks] == [False] * (len(chunks) - 1) + [True]
        assert len(chunks) >= -(-len(msg.input_ids) // budget), "the prompt was not chunked"
        # One token per emitting forward, and one per max_tokens: a mid-prompt chunk emits none.
        assert rec.emitting_runs(msg.uid) == msg.sampling_params.max_tokens
    assert_idle(sched)
    sched.shutdown()


def test_a_chunk_that_is_not_the_last_emits_nothing(corpus) -> None:
    ids = prompt(corpus, 40)
    sched = make_scheduler(16, 16)
    rec = Recorder(sched)
    msg = UserMsg(next(_uids), ids, SamplingParams(max_tokens=2, ignore_eos=True))
    sched.add_request(msg)
    steps: list[list[TokenMsg]] = []
    while sched.has_work:
        steps.append(sched.step())
    # 40 tokens at 16 a step: chunks of 16, 16 and 8; the first token comes with the last chunk
    # (or a step later when the scheduler overlaps), and exactly two tokens in all.
    assert [n for n, _ in rec.prefill_chunks(msg.uid)] == [16, 16, 8]
    first = next(i for i, s in enumerate(steps) if s)
    assert first in (2, 3), f"first token at step {first}: a mid-prompt chunk emitted"
    tokens = [m.token for s in steps for m in s]
    assert tokens == reference(ids, 2)
    assert all(m.cached_tokens == 0 for s in steps for m in s)
    assert_idle(sched)
    sched.shutdown()


def test_long_prompt_does_not_block_short_ones(corpus) -> None:
    long_ids = prompt(corpus, 120)
    shorts = [prompt(corpus, n) for n in (7, 16, 1)]
    sched = make_scheduler(1, 16)
    rec = Recorder(sched)
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    before = UserMsg(next(_uids), shorts[0], params)  # queued ahead of the long prompt
    long_msg = UserMsg(next(_uids), long_ids, params)
    after = [UserMsg(next(_uids), ids, params) for ids in shorts[1:]]  # queued behind it
    for m in [before, long_msg, *after]:
        sched.add_request(m)
    out: dict[int, list[TokenMsg]] = defaultdict(list)
    done_at: dict[int, int] = {}
    for step in range(200):
        if not sched.has_work:
            break
        for m in sched.step():
            out[m.uid].append(m)
            if m.finished:
                done_at[m.uid] = step
    assert not sched.has_work, "the scheduler never finished"
    for m in [before, long_msg, *after]:
        assert m.uid in done_at, f"request of {len(m.input_ids)} tokens never finished"
        assert check_request(out, m) == reference(m.input_ids, MAX_NEW)
    # The long prompt really was chunked, and the short one shared its first prefill batch.
    assert len(rec.prefill_chunks(long_msg.uid)) >= 120 // 16
    first_prefill = [u for u, _, _ in rec.batches[0][1]]
    assert before.uid in first_prefill and long_msg.uid in first_prefill
    counts = Counter(u for _, rows in rec.batches for u, _, _ in rows)
    assert all(counts[m.uid] >= MAX_NEW for m in [before, *after])
    assert_idle(sched)
    sched.shutdown()
