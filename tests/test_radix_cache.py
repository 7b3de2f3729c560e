"""The radix prefix cache: first on its own, then under the Scheduler.

The unit tests build small trees by hand (page sizes 1 and 4) and check matching, edge
splitting, the lock counts and the token accounting, LRU eviction and the integrity check.
The scheduler tests check that shared prompt prefixes really come from the cache, and that
what comes out is still Hugging Face's greedy output for each request alone.
"""

from __future__ import annotations

import inspect
import itertools
import json.decoder
from collections import defaultdict

import pytest
import torch
from helpers import SMOL, hf_greedy, need

from minisgl.core import SamplingParams
from minisgl.kvcache.radix_cache import RadixCache
from minisgl.message.backend import TokenMsg, UserMsg
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler
from minisgl.tokenizer.tokenizer import Tokenizer

MAX_NEW = 4
_uids = itertools.count()


def ids(*tokens: int) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.int32)


def seq(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int32)


def slots_of(node) -> list[int]:
    return node.value.tolist()


def edges(cache: RadixCache) -> list[list[int]]:
    """Every edge of the tree as its token list, sorted: the tree's shape."""
    out, stack = [], [cache.root]
    while stack:
        node = stack.pop()
        if not node.is_root:
            out.append(node.key.tolist())
        stack.extend(node.children.values())
    return sorted(out)


# ---- the cache on its own ---------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
def test_match_on_an_empty_tree(page_size: int) -> None:
    cache = RadixCache(page_size)
    match = cache.match_prefix(seq(1, 8))
    assert match.length == 0 and len(match.slots) == 0 and match.node is cache.root
    assert cache.match_prefix(ids()).length == 0
    assert (cache.evictable_tokens, cache.protected_tokens) == (0, 0)
    assert len(cache.all_slots()) == 0 and len(cache.evict(100)) == 0
    cache.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4])
def test_insert_then_match_prefixes(page_size: int) -> None:
    cache = RadixCache(page_size)
    tokens, slots = seq(1, 8), seq(100, 8)
    assert cache.insert(tokens, slots) == 0
    assert cache.evictable_tokens == 8 and cache.protected_tokens == 0
    full = cache.match_prefix(tokens)
    assert full.length == 8 and full.slots.tolist() == slots.tolist()
    # A longer query matches what is cached; a shorter one matches its whole pages.
    assert cache.match_prefix(torch.cat([tokens, ids(77, 78, 79)])).length == 8
    for n in range(9):
        m = cache.match_prefix(tokens[:n])
        assert m.length == n // page_size * page_size, f"prefix of {n} tokens"
        assert m.slots.tolist() == slots[: m.length].tolist()
    # A query that differs in its first token matches nothing.
    assert cache.match_prefix(ids(9, 2, 3, 4, 5, 6, 7, 8)).length == 0
    # Divergence inside a page: only the whole pages before it match.
    m = cache.match_prefix(ids(1, 2, 3, 4, 5, 99, 7, 8))
    assert m.length == 5 // page_size * page_size
    assert (cache.evictable_tokens, cache.protected_tokens) == (8, 0)  # matching moves nothing
    assert sorted(cache.all_slots().tolist()) == slots.tolist()
    cache.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4])
def test_insert_returns_the_cached_length(page_size: int) -> None:
    cache = RadixCache(page_size)
    assert cache.insert(seq(1, 8), seq(100, 8)) == 0
    assert cache.insert(seq(1, 8), seq(200, 8)) == 8  # all of it was here
    assert cache.insert(seq(1, 4), seq(300, 4)) == 4
    assert cache.insert(seq(1, 12), seq(400, 12)) == 8  # only the new tail is added
    m = cache.match_prefix(seq(1, 12))
    # The first copy of each token's KV stays; the caller frees its own duplicate.
    assert m.slots.tolist() == seq(100, 8).tolist() + seq(408, 4).tolist()
    assert cache.evictable_tokens == 12
    cache.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4])
def test_split_in_the_middle_of_an_edge(page_size: int) -> None:
    cache = RadixCache(page_size)
    cache.insert(seq(1, 8), seq(100, 8))
    # Differs from the cached edge at token 5 (index 5): the edge splits after whole pages.
    other = ids(1, 2, 3, 4, 5, 60, 61, 62)
    at = 5 // page_size * page_size
    assert cache.insert(other, seq(200, 8)) == at
    assert edges(cache) == sorted(
        [list(range(1, at + 1)), list(range(at + 1, 9)), other[at:].tolist()]
    )
    for key in edges(cache):
        assert len(key) % page_size == 0
    assert cache.match_prefix(seq(1, 8)).slots.tolist() == seq(100, 8).tolist()
    expected = seq(100, at).tolist() + seq(200 + at, 8 - at).tolist()
    assert cache.match_prefix(other).slots.tolist() == expected
    assert cache.evictable_tokens == 8 + 8 - at
    cache.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4])
def test_lock_counts_and_token_accounting(page_size: int) -> None:
    cache = RadixCache(page_size)
    cache.insert(seq(1, 8), seq(100, 8))
    handle = cache.match_prefix(seq(1, 8)).node
    cache.lock(handle)
    assert (cache.evictable_tokens, cache.protected_tokens) == (0, 8)
    cache.lock(handle)  # two requests on the same prefix
    assert handle.ref_count == 2 and (cache.evictable_tokens, cache.protected_tokens) == (0, 8)
    # Splitting a locked edge keeps both halves locked, and the handle still unlocks them.
    cache.insert(torch.cat([seq(1, 4), seq(50, 4)]), seq(200, 8))
    upper = handle.parent
    assert not upper.is_root and upper.ref_count == 2 and len(upper.key) == 4
    assert (cache.evictable_tokens, cache.protected_tokens) == (4, 8)
    cache.check_integrity()
    cache.unlock(handle)
    assert (cache.evictable_tokens, cache.protected_tokens) == (4, 8)
    cache.unlock(handle)
    assert (cache.evictable_tokens, cache.protected_tokens) == (12, 0)
    assert handle.ref_count == upper.ref_count == 0
    with pytest.raises(AssertionError):
        cache.unlock(handle)  # more unlocks than locks


def test_lock_and_unlock_of_the_root_are_no_ops() -> None:
    cache = RadixCache(1)
    cache.lock(cache.root)
    cache.unlock(cache.root)
    assert cache.root.ref_count == 1 and (cache.evictable_tokens, cache.protected_tokens) == (0, 0)


@pytest.mark.parametrize("page_size", [1, 4])
def test_evict_is_lru_over_unlocked_leaves(page_size: int) -> None:
    cache = RadixCache(page_size)
    x, y, z = seq(10, 4), seq(20, 4), seq(30, 4)
    cache.insert(x, seq(100, 4))
    cache.insert(y, seq(200, 4))
    cache.insert(z, seq(300, 4))
    cache.match_prefix(x)  # x is now the most recently used
    y_node = cache.match_prefix(y).node
    cache.lock(y_node)  # y is in use
    # z is the least recently used unlocked leaf: it goes first, and only it.
    assert sorted(cache.evict(1).tolist()) == seq(300, 4).tolist()
    assert cache.match_prefix(z).length == 0 and cache.match_prefix(x).length == 4
    # Asking for more than there is frees every unlocked leaf and never the locked path.
    assert sorted(cache.evict(100).tolist()) == seq(100, 4).tolist()
    assert cache.match_prefix(y).length == 4 and cache.match_prefix(x).length == 0
    assert (cache.evictable_tokens, cache.protected_tokens) == (0, 4)
    assert len(cache.evict(100)) == 0
    cache.check_integrity()
    cache.unlock(y_node)
    assert sorted(cache.evict(4).tolist()) == seq(200, 4).tolist()
    assert (cache.evictable_tokens, cache.protected_tokens) == (0, 0)


def test_a_full_cache_evicts_ahead_and_a_small_pool_just_enough() -> None:
    """A full cache frees 1/64 of the pool at once (each eviction walks the whole tree), so
    the next steps find free pages; a pool of fewer than 64 pages evicts what it is short of."""
    from minisgl.scheduler.cache import CacheManager

    for pages, freed in ((256, 4), (32, 1)):
        cm = CacheManager(pages, 1, torch.zeros(2, 8, dtype=torch.int32), "radix")
        for t in range(pages):  # every page a one-token leaf, oldest first
            cm.cache.insert(ids(t), ids(*cm.allocator.alloc(1)))
        assert cm.allocator.num_free == 0
        cm._evict_for(1)
        assert cm.allocator.num_free == freed
        assert [cm.cache.match_prefix(ids(t)).length for t in range(freed + 1)] == [0] * freed + [1]
        cm.check_integrity([])


@pytest.mark.parametrize("page_size", [1, 4])
def test_evict_reaches_inner_nodes_once_their_children_are_gone(page_size: int) -> None:
    cache = RadixCache(page_size)
    cache.insert(seq(1, 8), seq(100, 8))
    cache.insert(torch.cat([seq(1, 4), seq(50, 4)]), seq(200, 8))  # shares the first 4
    locked = cache.match_prefix(torch.cat([seq(1, 4), seq(50, 4)])).node
    cache.lock(locked)
    freed = cache.evict(100)
    # Only the unlocked branch goes; the shared inner node is on the locked path and stays.
    assert sorted(freed.tolist()) == seq(104, 4).tolist()
    assert edges(cache) == [[1, 2, 3, 4], [50, 51, 52, 53]]
    cache.unlock(locked)
    cache.match_prefix(seq(1, 4))  # touch the inner node: it is still evicted after its child
    freed = cache.evict(100)
    assert sorted(freed.tolist()) == seq(100, 4).tolist() + seq(204, 4).tolist()
    assert edges(cache) == [] and cache.evictable_tokens == 0
    cache.check_integrity()


def test_check_integrity_catches_corruption() -> None:
    cache = RadixCache(4)
    cache.insert(seq(1, 8), seq(100, 8))
    cache.insert(torch.cat([seq(1, 4), seq(50, 4)]), seq(200, 8))
    cache.check_integrity()
    cache.evictable_tokens += 4
    with pytest.raises(AssertionError, match="drifted"):
        cache.check_integrity()
    cache.evictable_tokens -= 4
    leaf = cache.match_prefix(seq(1, 8)).node
    leaf.ref_count = 1  # a locked leaf under an unlocked parent: impossible through lock()
    with pytest.raises(AssertionError):
        cache.check_integrity()


# ---- through the scheduler --------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus() -> list[int]:
    return Tokenizer(need(SMOL)).encode(inspect.getsource(json.decoder))


def reference(tokens: list[int], n: int = MAX_NEW) -> list[int]:
    return hf_greedy(SMOL, tokens, MAX_NEW)[:n]


def make_scheduler(page_size: int, num_pages: int, **kw) -> Scheduler:
    config = SchedulerConfig(
        str(SMOL),
        dtype=torch.float32,
        device="cpu",
        max_seq_len_override=256,
        max_running_req=8,
        page_size=page_size,
        num_page_override=num_pages,
        cache_type="radix",
        **kw,
    )
    return Scheduler(config, {2})


def run(sched: Scheduler, msgs: list[UserMsg]) -> dict[int, list[TokenMsg]]:
    for msg in msgs:
        sched.add_request(msg)
    out: dict[int, list[TokenMsg]] = defaultdict(list)
    for _ in range(500):
        if not sched.has_work:
            break
        for m in sched.step():
            out[m.uid].append(m)
        sched.check_integrity()
    assert not sched.has_work, "the scheduler never finished"
    return out


def result(out: dict[int, list[TokenMsg]], msg: UserMsg) -> tuple[list[int], int]:
    """The request's tokens and its cached_tokens, which every message must agree on."""
    msgs = out[msg.uid]
    assert len(msgs) == msg.sampling_params.max_tokens and msgs[-1].finished
    assert not any(m.finished for m in msgs[:-1])
    cached = {m.cached_tokens for m in msgs}
    assert len(cached) == 1, f"cached_tokens changed during the request: {cached}"
    return [m.token for m in msgs], cached.pop()


def assert_idle(sched: Scheduler) -> None:
    """No request, no lock left: every page is free or evictable cache."""
    assert not sched.has_work and not sched.reqs
    sched.check_integrity()
    radix = sched.cache.cache
    assert radix.protected_tokens == 0, f"{radix.protected_tokens} cached tokens still locked"
    pages = sched.cache.allocator.num_free + radix.evictable_tokens // sched.engine.page_size
    assert pages == sched.engine.num_pages
    assert sched.table.available == sched.engine.config.max_running_req


@pytest.mark.parametrize("page_size", [1, 4])
def test_shared_prefix_is_served_from_the_cache(corpus, page_size: int) -> None:
    prefix = corpus[:50]
    prompts = [prefix + corpus[200 + 10 * i : 203 + 10 * i + i] for i in range(4)]
    sched = make_scheduler(page_size, 1024 // page_size)
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    msgs = [UserMsg(next(_uids), p, params) for p in prompts]
    out = run(sched, msgs)
    for i, (msg, p) in enumerate(zip(msgs, prompts)):
        tokens, cached = result(out, msg)
        assert tokens == reference(p), f"request {i} (shared prefix) differs from HF alone"
        if i == 0:
            assert cached == 0, "the first request found a prefix in an empty cache"
        else:
            assert cached >= len(prefix) // page_size * page_size, (
                f"request {i}: only {cached} of the {len(prefix)} shared tokens came from the cache"
            )
            assert cached <= len(p) - 1
    assert_idle(sched)
    sched.shutdown()


@pytest.mark.parametrize("page_size", [1, 4])
def test_identical_prompt_is_almost_entirely_cached(corpus, page_size: int) -> None:
    p = corpus[300:330]  # 30 tokens: not a multiple of 4, so the page rounding shows
    sched = make_scheduler(page_size, 1024 // page_size)
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    first = UserMsg(next(_uids), p, params)
    tokens, cached = result(run(sched, [first]), first)
    assert tokens == reference(p) and cached == 0
    again = UserMsg(next(_uids), p, params)
    tokens, cached = result(run(sched, [again]), again)
    assert tokens == reference(p), "the cached prompt gives different tokens"
    # Everything but the last prompt token (which must be computed for its logits), in pages.
    assert cached == (len(p) - 1) // page_size * page_size
    # A prompt extending the first request's output finds prompt + output in the cache.
    longer = p + reference(p, MAX_NEW - 1) + corpus[400:403]
    ext = UserMsg(next(_uids), longer, SamplingParams(max_tokens=2, ignore_eos=True))
    tokens, cached = result(run(sched, [ext]), ext)
    assert tokens == hf_greedy(SMOL, longer, 2)
    assert cached >= (len(p) + MAX_NEW - 1) // page_size * page_size
    assert_idle(sched)
    sched.shutdown()


def test_tiny_pool_evicts_to_make_room(corpus) -> None:
    # 20 pages of 4 tokens; each request leaves 8 pages in the cache when it finishes.
    sched = make_scheduler(4, 20)
    capacity = 20 * 4
    prompts = [corpus[500 + 40 * i : 530 + 40 * i] for i in range(5)]  # 30 tokens each
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    for i, p in enumerate(prompts):
        msg = UserMsg(next(_uids), p, params)
        tokens, cached = result(run(sched, [msg]), msg)
        assert tokens == reference(p, 3), f"prompt {i} differs from HF after eviction"
        assert cached == 0
        radix = sched.cache.cache
        assert radix.evictable_tokens + radix.protected_tokens <= capacity
        assert_idle(sched)
    # 5 x 32 cached tokens cannot all be in a pool of 80: the oldest were evicted, LRU first.
    radix = sched.cache.cache
    newest = radix.match_prefix(torch.tensor(prompts[-1], dtype=torch.int32)).length
    oldest = radix.match_prefix(torch.tensor(prompts[0], dtype=torch.int32)).length
    assert newest == 28 and oldest == 0
    # Several at once in the tiny pool: the cache gives way to running requests.
    msgs = [UserMsg(next(_uids), p, params) for p in prompts[1:4]]
    out = run(sched, msgs)
    for msg, p in zip(msgs, prompts[1:4]):
        assert result(out, msg)[0] == reference(p, 3)
    assert_idle(sched)
    sched.shutdown()


def test_cached_tokens_survive_preemption(corpus) -> None:
    # A's prompt is cached; A then runs next to X in a pool too small for both to finish, and
    # A, admitted last, is preempted and recomputed. Its prompt still came from the cache.
    sched = make_scheduler(4, 20)
    a, x = corpus[700:730], corpus[800:830]
    warm = UserMsg(next(_uids), a, SamplingParams(max_tokens=3, ignore_eos=True))
    result(run(sched, [warm]), warm)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    msg_x, msg_a = UserMsg(next(_uids), x, params), UserMsg(next(_uids), a, params)
    out = run(sched, [msg_x, msg_a])
    assert sched.num_preemptions > 0, "the pool was never short: the test proves nothing"
    assert [m.token for m in out[msg_x.uid]] == hf_greedy(SMOL, x, 16)
    assert [m.token for m in out[msg_a.uid]] == hf_greedy(SMOL, a, 16)
    reported = [m.cached_tokens for m in out[msg_a.uid]]
    assert reported[0] == 28, f"A's prompt should have come from the cache: {reported[0]}"
    assert set(reported) == {28}, (
        f"BUG: cached_tokens per message of a preempted request: {reported}. After preemption "
        "the re-admitted request reports 0 (prefill.py _admit: `match.length if "
        "pending.first_admission else 0`), so the final count (what LLM.generate returns) "
        "says none of the prompt came from the cache."
    )
    assert_idle(sched)
    sched.shutdown()
