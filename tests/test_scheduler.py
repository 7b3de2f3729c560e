"""Continuous batching through the Scheduler: every request equals itself run alone in HF.

The scheduler is driven by hand here: requests go in with `add_request` (some between
steps), `step` is called until there is no work left, and the TokenMsgs that come out
are collected per request. The reference for every request is Hugging Face greedy
`generate` on that request alone, in fp32; a run with fewer tokens is compared with a
prefix of it. This chapter's cache manager caches nothing, so every run uses "naive".
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict

import msgpack
import pytest
import torch
from helpers import SMOL, hf_greedy, need

from minisgl.core import SamplingParams
from minisgl.engine.limits import EngineLimits, PromptTooLong
from minisgl.message.backend import AbortMsg, TokenMsg, UserMsg
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler
from minisgl.tokenizer.tokenizer import Tokenizer

MAX_NEW = 8  # every reference is HF's first MAX_NEW greedy tokens
MAX_SEQ_LEN = 128
EOS = 2  # <|im_end|>, SmolLM2's EOS

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "Once upon a time",
    "Hello",
    "In the middle of the night, the old lighthouse keeper climbed the stairs once more "
    "to check the lamp, as he had done every evening for forty years.",
]

_uids = itertools.count()


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(need(SMOL))


@pytest.fixture(scope="module")
def prompts(tok: Tokenizer) -> list[list[int]]:
    return [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def chat(tok: Tokenizer) -> list[int]:
    # A question whose greedy answer is short: "Yes." then <|im_end|>.
    text = tok.apply_chat_template([{"role": "user", "content": "Reply with one word: yes or no?"}])
    return tok.encode(text)


def reference(ids: list[int], n: int) -> list[int]:
    assert n <= MAX_NEW
    return hf_greedy(SMOL, ids, MAX_NEW)[:n]


def make_scheduler(**kw) -> Scheduler:
    kw.setdefault("max_running_req", 8)
    kw.setdefault("num_page_override", 512)
    config = SchedulerConfig(
        str(SMOL),
        dtype=torch.float32,
        device="cpu",
        max_seq_len_override=MAX_SEQ_LEN,
        cache_type="naive",
        **kw,
    )
    return Scheduler(config, {EOS})


@pytest.fixture(scope="module")
def sched() -> Scheduler:
    need(SMOL)
    return make_scheduler()


@pytest.fixture(scope="module")
def small_pool() -> Scheduler:
    # 8 pages of 4 tokens: 32 tokens of KV, far less than the requests below want at once.
    return make_scheduler(page_size=4, num_page_override=8)


@pytest.fixture(scope="module")
def two_rows() -> Scheduler:
    return make_scheduler(max_running_req=2)


def request(ids: list[int], **params) -> UserMsg:
    params.setdefault("max_tokens", MAX_NEW)
    return UserMsg(next(_uids), list(ids), SamplingParams(**params))


def run(
    sched: Scheduler,
    msgs: list[UserMsg],
    later: dict[int, list[UserMsg]] | None = None,
    max_steps: int = 400,
    on_step=None,
) -> dict[int, list[tuple[int, TokenMsg]]]:
    """Step until idle; `later[k]` is added right before step k. Returns uid -> [(step, msg)]."""
    later = dict(later or {})
    for msg in msgs:
        sched.add_request(msg)
    out: dict[int, list[tuple[int, TokenMsg]]] = defaultdict(list)
    step = 0
    while sched.has_work or later:
        for msg in later.pop(step, []):
            sched.add_request(msg)
        for token in sched.step():
            out[token.uid].append((step, token))
        if on_step is not None:
            on_step(sched)
        step += 1
        assert step < max_steps, f"still busy after {max_steps} steps: the scheduler hangs"
    return out


def tokens(out: dict[int, list[tuple[int, TokenMsg]]], uid: int) -> tuple[list[int], str | None]:
    """A request's tokens and finish reason, checking exactly one finished message, last."""
    msgs = [m for _, m in out[uid]]
    assert msgs, f"request {uid} got no token at all"
    flags = [m.finished for m in msgs]
    assert flags.count(True) == 1, f"request {uid}: {flags.count(True)} finished messages"
    assert flags[-1], f"request {uid} got tokens after its finished message: {flags}"
    assert all(m.uid == uid for m in msgs)
    return [m.token for m in msgs], msgs[-1].finish_reason


def assert_idle(sched: Scheduler) -> None:
    """Nothing running, nothing waiting, every row and every page back where it started."""
    assert not sched.has_work
    sched.check_integrity()
    assert not sched.reqs, f"requests left behind: {list(sched.reqs.values())}"
    rows, total = sched.limits.max_running_req, sched.limits.num_pages
    assert sched.table.available == rows, f"{rows - sched.table.available} rows still taken"
    pages = sched.cache.allocator.num_free
    assert pages == total, f"{total - pages} pages not freed"


# ---- outputs ----------------------------------------------------------------------------


def test_batch_of_different_lengths_equals_hf_alone(sched: Scheduler, prompts) -> None:
    lengths = [1, 3, 8, 5, 8, 6]
    msgs = [request(ids, max_tokens=n, ignore_eos=True) for ids, n in zip(prompts, lengths)]
    out = run(sched, msgs)
    for msg, ids, n in zip(msgs, prompts, lengths):
        got, reason = tokens(out, msg.uid)
        assert got == reference(ids, n), f"prompt of {len(ids)} tokens differs from HF alone"
        assert reason == "length"
        assert all(m.cached_tokens == 0 for _, m in out[msg.uid]), "naive cache caches nothing"
    assert_idle(sched)


def test_requests_added_between_steps(sched: Scheduler, prompts) -> None:
    first = [request(prompts[5], ignore_eos=True), request(prompts[0], ignore_eos=True)]
    second = [request(prompts[2], max_tokens=6, ignore_eos=True), request(prompts[4], max_tokens=4)]
    third = [request(prompts[3], max_tokens=2, ignore_eos=True)]
    out = run(sched, first, later={2: second, 3: third})
    for msg in first + second + third:
        got, _ = tokens(out, msg.uid)
        n = msg.sampling_params.max_tokens
        assert got == reference(msg.input_ids, n), f"request {msg.uid} differs from HF alone"
    # Continuous batching: the late requests ran alongside the first ones, not after them.
    first_done = min(out[m.uid][-1][0] for m in first)
    late_start = max(out[m.uid][0][0] for m in second + third)
    assert late_start < first_done, "late requests waited for the running ones to finish"
    assert_idle(sched)


# ---- finishing --------------------------------------------------------------------------


def test_finishes_on_eos(sched: Scheduler, chat: list[int]) -> None:
    ref = reference(chat, MAX_NEW)
    assert EOS in ref[:-1], f"the premise is gone: HF's answer {ref} has no early EOS"
    expected = ref[: ref.index(EOS) + 1]
    msg = request(chat)
    out = run(sched, [msg])
    got, reason = tokens(out, msg.uid)
    assert got == expected, f"EOS should end the request: got {got}, HF {ref}"
    assert reason == "stop"
    assert_idle(sched)


def test_ignore_eos_goes_past_eos(sched: Scheduler, chat: list[int]) -> None:
    msg = request(chat, ignore_eos=True)
    got, reason = tokens(run(sched, [msg]), msg.uid)
    assert got == reference(chat, MAX_NEW)
    assert EOS in got[:-1], "the output never went past an EOS"
    assert reason == "length"
    assert_idle(sched)


def test_stop_token_ids(sched: Scheduler, prompts) -> None:
    ids = prompts[2]
    ref = reference(ids, MAX_NEW)
    # The first token HF produces mid-sequence that it did not produce before.
    k = next(i for i in range(1, MAX_NEW - 1) if ref[i] not in ref[:i])
    stop = ref[k]
    msg = request(ids, stop_token_ids=[stop], ignore_eos=True)
    plain = request(ids, max_tokens=k + 2, ignore_eos=True)  # same prompt, no stop token
    out = run(sched, [msg, plain])
    got, reason = tokens(out, msg.uid)
    assert got == ref[: k + 1], f"should stop right after token {stop}: got {got}, HF {ref}"
    assert reason == "stop"
    assert tokens(out, plain.uid) == (ref[: k + 2], "length")
    assert_idle(sched)


def test_max_tokens_one(sched: Scheduler, prompts) -> None:
    msgs = [request(ids, max_tokens=1, ignore_eos=True) for ids in prompts[:3]]
    out = run(sched, msgs)
    for msg in msgs:
        assert tokens(out, msg.uid) == (reference(msg.input_ids, 1), "length")
    assert_idle(sched)


def test_prompt_longer_than_the_prefill_budget_still_runs(prompts) -> None:
    # max_prefill_length is the token budget of one prefill batch. A prompt over it must still
    # run to the end (whole, or in pieces where the scheduler knows how): never be dropped.
    sched = make_scheduler(max_running_req=2, num_page_override=128, max_prefill_length=8)
    long_msg = request(prompts[5], max_tokens=3, ignore_eos=True)  # 31 tokens, budget 8
    short = request(prompts[3], max_tokens=3, ignore_eos=True)
    out = run(sched, [long_msg, short])
    assert tokens(out, short.uid) == (reference(short.input_ids, 3), "length")
    assert out[long_msg.uid], (
        f"BUG: a prompt of {len(long_msg.input_ids)} tokens with max_prefill_length 8 never got "
        f"a token, yet has_work is False ({len(sched.reqs)} request(s) stuck in sched.reqs): the "
        "prompt was cut to the budget but nothing continues it"
    )
    assert tokens(out, long_msg.uid) == (reference(long_msg.input_ids, 3), "length")
    assert_idle(sched)
    sched.shutdown()


# ---- refused requests -------------------------------------------------------------------


LIMITS = EngineLimits(max_seq_len=40, num_pages=25, page_size=4, max_running_req=8, vocab_size=100)


def test_limits_are_the_engines_and_travel_as_plain_msgpack(sched: Scheduler) -> None:
    engine = sched.engine
    assert sched.limits == engine.limits == engine.shape.limits(engine.num_pages)
    assert (sched.limits.max_seq_len, sched.limits.num_pages) == (MAX_SEQ_LEN, 512)
    assert sched.limits.max_kv_tokens == engine.num_pages * engine.page_size
    assert sched.limits.max_running_req == sched.table.available == 8
    assert sched.limits.vocab_size == engine.model_config.vocab_size
    data = msgpack.packb(LIMITS.to_dict())
    assert msgpack.unpackb(data) == {
        "max_seq_len": 40,
        "num_pages": 25,
        "page_size": 4,
        "max_running_req": 8,
        "vocab_size": 100,
    }
    assert EngineLimits.from_dict(msgpack.unpackb(data)) == LIMITS
    with pytest.raises(dataclasses.FrozenInstanceError):
        LIMITS.num_pages = 1  # type: ignore[misc]


def test_check_prompt_accepts_what_fits() -> None:
    LIMITS.check_prompt([1])
    LIMITS.check_prompt(list(range(LIMITS.max_seq_len - 1)))  # room for one generated token
    LIMITS.check_prompt([0, LIMITS.vocab_size - 1])
    kv = dataclasses.replace(LIMITS, max_seq_len=1000)  # the KV cache is the tighter limit
    kv.check_prompt([1] * (kv.max_kv_tokens - 1))
    assert kv.max_req_len == kv.max_kv_tokens == 100 and LIMITS.max_req_len == 40


@pytest.mark.parametrize(
    "limits,ids,words,too_long",
    [
        (LIMITS, [], ["empty"], False),
        (LIMITS, [1] * 50, ["50 tokens", "context is 40 tokens"], True),
        (LIMITS, [1] * 40, ["40 tokens", "context is 40", "one generated token"], True),
        (dataclasses.replace(LIMITS, max_seq_len=1000), [1] * 100, ["KV cache holds 100"], True),
        (LIMITS, [5, 100], ["vocabulary [0, 100)"], False),
        (LIMITS, [-1], ["vocabulary"], False),
    ],
    ids=["empty", "longer-than-context", "no-room-to-generate", "kv-cache", "id-big", "id-neg"],
)
def test_check_prompt_refuses(limits, ids, words, too_long) -> None:
    with pytest.raises(ValueError) as e:
        limits.check_prompt(ids)
    for word in words:
        assert word in str(e.value), str(e.value)
    assert isinstance(e.value, PromptTooLong) == too_long
    assert getattr(e.value, "code", None) == ("context_length_exceeded" if too_long else None)


def test_validate_refuses_what_can_never_run(sched: Scheduler, prompts) -> None:
    with pytest.raises(ValueError, match="empty"):
        sched.validate(request([]))
    with pytest.raises(PromptTooLong) as err:
        sched.validate(request([42] * (MAX_SEQ_LEN + 7)))
    assert str(err.value) == (
        f"the prompt has {MAX_SEQ_LEN + 7} tokens; this model's context is {MAX_SEQ_LEN} "
        "tokens, including at least one generated token"
    )
    # The context must hold one generated token too: a prompt of exactly max_seq_len is refused.
    with pytest.raises(ValueError, match=str(MAX_SEQ_LEN)):
        sched.validate(request([42] * MAX_SEQ_LEN))
    sched.validate(request([42] * (MAX_SEQ_LEN - 1)))  # the longest that may run
    vocab = sched.limits.vocab_size
    for bad in (vocab, vocab + 100, -1):
        with pytest.raises(ValueError, match="vocabulary"):
            sched.validate(request([1, 2, bad, 3]))
    sched.validate(request([0, vocab - 1]))
    # add_request refuses the same way and queues nothing.
    with pytest.raises(ValueError):
        sched.add_request(request([vocab]))
    assert not sched.has_work
    assert_idle(sched)
    # ... and the scheduler keeps working.
    msg = request(prompts[0], max_tokens=3, ignore_eos=True)
    assert tokens(run(sched, [msg]), msg.uid) == (reference(prompts[0], 3), "length")
    assert_idle(sched)


def test_prompt_larger_than_the_kv_pool_is_refused(small_pool: Scheduler, prompts) -> None:
    capacity = small_pool.limits.max_kv_tokens  # 8 pages of 4 tokens
    assert capacity == 32 and small_pool.limits.max_req_len == capacity
    small_pool.validate(request([42] * (capacity - 1)))
    with pytest.raises(PromptTooLong) as err:
        small_pool.add_request(request([42] * capacity))
    assert f"the prompt has {capacity} tokens; the KV cache holds {capacity} tokens" in str(
        err.value
    )
    assert not small_pool.has_work
    msg = request(prompts[1], max_tokens=4, ignore_eos=True)
    assert tokens(run(small_pool, [msg]), msg.uid) == (reference(prompts[1], 4), "length")
    assert_idle(small_pool)


# ---- a KV pool smaller than the demand ---------------------------------------------------


def test_small_pool_preempts_and_outputs_still_equal_hf(small_pool: Scheduler, prompts) -> None:
    before = small_pool.num_preemptions
    msgs = [request(ids, ignore_eos=True) for ids in prompts[:4]]  # ~16 pages wanted, 8 exist
    seen_full = []

    def check(s: Scheduler) -> None:
        s.check_integrity()
        seen_full.append(s.cache.allocator.num_free == 0)

    out = run(small_pool, msgs, on_step=check)
    assert small_pool.num_preemptions > before, "the pool was never short: the test proves nothing"
    assert any(seen_full)
    for msg in msgs:
        got, reason = tokens(out, msg.uid)
        ref = reference(msg.input_ids, MAX_NEW)
        assert got == ref, f"request {msg.uid} differs from HF after preemption"
        assert reason == "length"
    assert_idle(small_pool)


def test_request_longer_than_the_pool_does_not_hang(small_pool: Scheduler, prompts) -> None:
    # The prompt fits the pool (validate accepts it) but prompt + max_tokens does not: once the
    # pool is full the request must end (or be refused up front), not loop forever.
    capacity = small_pool.limits.max_kv_tokens
    ids = prompts[5][:20]
    msg = request(ids, max_tokens=capacity, ignore_eos=True)
    try:
        small_pool.validate(msg)
    except ValueError:
        return  # refused up front: fine
    small_pool.add_request(msg)
    got: list[TokenMsg] = []
    for _ in range(4 * capacity):
        if not small_pool.has_work:
            break
        got += small_pool.step()
    else:
        waiting = [len(p.input_ids) for p in small_pool.prefill.pending]
        small_pool.abort(AbortMsg(msg.uid))  # leave the scheduler clean for the other tests
        pytest.fail(
            f"BUG: prompt of {len(ids)} tokens, max_tokens {capacity}, KV pool of {capacity} "
            f"tokens: after {len(got)} tokens the request was preempted and re-queued with "
            f"{waiting} tokens, which can never be admitted again; has_work stays True forever. "
            "It should finish with 'length' once the pool is full, or be refused by validate."
        )
    assert [m.finished for m in got].count(True) == 1 and got[-1].finished
    assert [m.token for m in got][:MAX_NEW] == reference(ids, MAX_NEW)
    assert got[-1].finish_reason == "length" and len(ids) + len(got) <= capacity + 1
    assert_idle(small_pool)


# ---- abort and row limits ---------------------------------------------------------------


def test_abort_waiting_and_running(sched: Scheduler, prompts) -> None:
    waiting = request(prompts[0])
    running = request(prompts[5], ignore_eos=True)
    other = request(prompts[2], ignore_eos=True)
    sched.add_request(waiting)
    sched.abort(AbortMsg(waiting.uid))  # never started
    sched.add_request(running)
    sched.add_request(other)
    out: dict[int, list[TokenMsg]] = defaultdict(list)
    for _ in range(3):
        for m in sched.step():
            out[m.uid].append(m)
    assert running.uid in sched.reqs and len(out[running.uid]) >= 2, "not running yet"
    sched.abort(AbortMsg(running.uid))
    sched.check_integrity()
    assert running.uid not in sched.reqs
    while sched.has_work:
        for m in sched.step():
            out[m.uid].append(m)
    assert waiting.uid not in out, "an aborted waiting request produced tokens"
    n = len(out[running.uid])
    assert n < MAX_NEW and not any(m.finished for m in out[running.uid])
    assert [m.token for m in out[running.uid]] == reference(running.input_ids, n)
    assert [m.token for m in out[other.uid]] == reference(other.input_ids, MAX_NEW)
    assert out[other.uid][-1].finished
    sched.abort(AbortMsg(running.uid))  # aborting twice, or an unknown uid, is harmless
    sched.abort(AbortMsg(10**9))
    assert_idle(sched)


def test_two_rows_five_requests(two_rows: Scheduler, prompts) -> None:
    lengths = [4, 2, 5, 1, 3]
    msgs = [request(ids, max_tokens=n, ignore_eos=True) for ids, n in zip(prompts, lengths)]
    in_use = []

    def check(s: Scheduler) -> None:
        in_use.append(len(s.reqs))
        assert len(s.reqs) <= 2 and s.table.available == 2 - len(s.reqs)

    out = run(two_rows, msgs, on_step=check)
    assert max(in_use) == 2
    for msg, n in zip(msgs, lengths):
        assert tokens(out, msg.uid) == (reference(msg.input_ids, n), "length")
    assert_idle(two_rows)


def test_abort_request_waiting_for_a_row(two_rows: Scheduler, prompts) -> None:
    msgs = [request(ids, max_tokens=3, ignore_eos=True) for ids in prompts[:3]]
    for msg in msgs:
        two_rows.add_request(msg)
    out: dict[int, list[TokenMsg]] = defaultdict(list)
    for m in two_rows.step():
        out[m.uid].append(m)
    assert msgs[2].uid not in two_rows.reqs, "the third request should wait for a row"
    two_rows.abort(AbortMsg(msgs[2].uid))
    while two_rows.has_work:
        for m in two_rows.step():
            out[m.uid].append(m)
    assert msgs[2].uid not in out
    for msg in msgs[:2]:
        assert [m.token for m in out[msg.uid]] == reference(msg.input_ids, 3)
    assert_idle(two_rows)
