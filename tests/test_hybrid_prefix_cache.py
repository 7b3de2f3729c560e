"""Prefix caching for a hybrid model: radix hits that resume from a saved recurrent state.

A tiny random Qwen3.5 (tests/test_qwen3_5.py's: 3 linear layers and 1 attention layer, fp32,
CPU) runs the same workloads with the radix cache and with the naive cache, and the greedy
tokens must be equal: the same prompt again, a multi-turn conversation (each turn's prompt
the last one's, its answer and a new message), prompts whose shared prefix splits a node,
chunked prefill, pages of 4 tokens, preemption, too few snapshots or KV pages for everything,
and two tensor-parallel ranks. Each run also counts its hits, so that a cache that never hit
cannot pass; and a run whose hits skip the copy of the saved state must come out different.
The hit-rate tool runs small.

The first tests take the snapshot store and the cut-back match apart, on a tree built by hand.
"""

from __future__ import annotations

import shutil
import sys
from typing import Any

import pytest
import torch
from helpers import ROOT, TINY, need
from test_qwen3_5 import TEXT, _perturb, token_ids

from minisgl.core import SamplingParams
from minisgl.env import ENV
from minisgl.kvcache.radix_cache import RadixCache
from minisgl.kvcache.state_pool import RecurrentStatePool
from minisgl.llm import LLM
from minisgl.models.families import LinearAttention
from minisgl.scheduler.hybrid_cache import BRANCH_MIN, HybridCacheManager

PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)
SERVE: dict[str, Any] = dict(device="cpu", dtype="float32", max_running_req=4,
                             num_page_override=512)  # fmt: skip
SHAPE = LinearAttention(1, 1, 2, 2, 4)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny text-only Qwen3.5, with a tokenizer for the offline API (prompts are ids)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    root = tmp_path_factory.mktemp("qwen3_5_text")
    torch.manual_seed(0)
    text = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TEXT, tie_word_embeddings=True))
    _perturb(text.float())
    text.save_pretrained(root)
    tok = need(TINY["llama"])
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tok / f).is_file():
            shutil.copy(tok / f, root / f)
    return str(root)


# ---- the snapshot store and the match, by hand -------------------------------------------


def manager(num_snapshots: int, page_size: int = 1) -> HybridCacheManager:
    pool = RecurrentStatePool(1, 3, SHAPE, torch.float32, torch.device("cpu"), num_snapshots)
    pool.ssm[0] = torch.arange(3.0)[:, None, None, None]  # slot i's state: all i
    return HybridCacheManager(64, page_size, torch.zeros(3, 64, dtype=torch.int32), pool)


def seq(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int32)


def insert(cm: HybridCacheManager, ids: torch.Tensor, slot: int) -> Any:
    """Cache `ids` on fresh pages and save slot `slot`'s state at their end; their node."""
    ps = cm.page_size
    pages = torch.tensor(cm.allocator.alloc(len(ids) // ps), dtype=torch.int32)
    cm.cache.insert(ids, (pages[:, None] * ps + torch.arange(ps, dtype=torch.int32)).flatten())
    node = cm.cache.match_prefix(ids).node
    cm.snapshots.save(node, slot)
    return node


def test_a_match_stops_at_the_deepest_snapshot_and_a_split_keeps_it_below() -> None:
    cm = manager(num_snapshots=2)
    long = insert(cm, seq(0, 50), slot=1)
    ids = torch.cat([seq(0, 40), seq(100, 5)])  # shares 40 tokens: the node splits there
    match = cm.match(ids)
    assert (match.length, match.node, match.stop) == (0, cm.cache.root, 40)
    assert cm.snapshots.held == {long: 0} and len(long.key) == 10  # the lower half keeps it
    whole = cm.match(torch.cat([seq(0, 50), seq(100, 3)]))
    assert (whole.length, whole.node, whole.stop) == (50, long, None)
    short = cm.match(seq(0, 20))  # K/V for 19 tokens, fewer than BRANCH_MIN: no stop
    assert (short.length, short.stop) == (0, None) and BRANCH_MIN > 19
    cm.check_integrity([])


def test_with_larger_pages_a_next_turn_stops_at_its_last_page_boundary() -> None:
    """Pages of 16: a prompt going on from a cached sequence's end stops where its own last
    page ends (its state saved there serves its next turn), BRANCH_MIN past the snapshot; a
    prompt that parts stops where it parts; one that matches nothing does not stop."""
    cm = manager(num_snapshots=2, page_size=16)
    assert cm.match(seq(0, 70)).stop is None  # an empty cache: nothing to go on from
    first = insert(cm, seq(0, 32), slot=1)
    turn = cm.match(seq(0, 75))  # 75 tokens: the last page boundary at 64
    assert (turn.length, turn.node, turn.stop) == (32, first, 64)
    assert cm.match(seq(0, 60)).stop is None  # 48 is only 16 past the snapshot
    assert cm.match(seq(0, 64)).stop == 64  # ends on a boundary: no step more
    fork = cm.match(torch.cat([seq(0, 16), seq(100, 50)]))  # parts at 16, under the snapshot
    assert (fork.length, fork.stop) == (0, None)
    cm.check_integrity([])


def test_eviction_frees_snapshots_and_spares_the_locked_ones() -> None:
    cm = manager(num_snapshots=1)
    first = insert(cm, seq(0, 8), slot=1)
    cm.cache.lock(first)  # a running request resumes from it
    second = insert(cm, seq(100, 8), slot=2)
    assert cm.snapshots.held == {first: 0}  # no snapshot free, and the only one is held
    cm.cache.unlock(first)
    cm.snapshots.save(second, slot=2)
    assert cm.snapshots.held == {second: 0}  # the least recent unlocked one was dropped
    assert first in cm.cache.root.children.values()  # its node keeps its K/V
    cm.check_integrity([])
    cm.snapshots.restore(second, 0)
    assert (cm.snapshots.pool.ssm[0, 0] == 2).all()  # slot 2's state, copied into slot 0
    cm._free_slots(cm.cache.evict(16))  # both leaves go, and the snapshot with its node
    assert cm.snapshots.held == {} and cm.snapshots.free == [0]
    cm.check_integrity([])


# ---- through the offline API: the radix cache's tokens are the naive cache's -------------


def chat(llm: LLM, convs: int = 3, turns: int = 3, first: int = 34) -> list[list[tuple]]:
    """Conversations run side by side, turn by turn: each turn's prompt is the last turn's,
    its answer and a new message. Per turn, per conversation: (prompt, tokens, cached)."""
    prompts = [token_ids(100 + c, first) for c in range(convs)]
    rounds = []
    for t in range(turns):
        out = llm.generate(prompts, PARAMS, use_tqdm=False)
        rounds.append([(p, o["token_ids"], o["cached_tokens"]) for p, o in zip(prompts, out)])
        llm.scheduler.check_integrity()
        prompts = [p + o["token_ids"] + token_ids(200 + 10 * t + c, 6)
                   for c, (p, o) in enumerate(zip(prompts, out))]  # fmt: skip
    return rounds


def serve(model: str, cache: str, run, **kwargs: Any) -> Any:
    llm = LLM(model, cache_type=cache, **{**SERVE, **kwargs})
    try:
        return run(llm), llm.scheduler
    finally:
        llm.shutdown()


def tokens(rounds: list[list[tuple]]) -> list[list[list[int]]]:
    return [[t for _, t, _ in r] for r in rounds]


def cached(rounds: list[list[tuple]]) -> list[list[int]]:
    return [[c for _, _, c in r] for r in rounds]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_conversation_resumes_each_turn_where_the_last_one_ended(model, monkeypatch, overlap):
    """With pages of one token, each turn finds the last one's sequence and its state, but
    for the token sampled last (never forwarded); overlap scheduling runs a step ahead."""
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", not overlap)
    want, _ = serve(model, "naive", chat)
    got, s = serve(model, "radix", chat)
    assert s.overlap == overlap
    assert tokens(got) == tokens(want)
    assert cached(got)[0] == [0, 0, 0]
    for before, now in zip(got, got[1:]):
        assert [c for _, _, c in now] == [len(p) + len(t) - 1 for p, t, _ in before]


def test_the_same_prompt_again_stops_at_its_last_token_then_resumes_there(model) -> None:
    """The first run caches the prompt and its answer, with the state at the answer's end;
    the second finds K/V for all but the last prompt token and no state before it, so its
    first forward stops there to save one; the third resumes there."""
    prompt = token_ids(7, 40)

    def thrice(llm: LLM) -> list[tuple]:
        out = [llm.generate([prompt], PARAMS, use_tqdm=False)[0] for _ in range(3)]
        llm.scheduler.check_integrity()
        return [(o["token_ids"], o["cached_tokens"]) for o in out]

    want, _ = serve(model, "naive", thrice)
    got, s = serve(model, "radix", thrice)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [c for _, c in got] == [0, 0, 39]
    assert len(s.cache.snapshots.held) == 2  # the last prompt token, the answers' end


@pytest.mark.parametrize("page_size", [1, 4])
def test_prompts_sharing_a_prefix_resume_at_the_branch(model, page_size: int) -> None:
    """Three prompts share 36 tokens (a system prompt), one after another: the second splits
    the first's node there and saves the state at the split; the third resumes there."""
    system = token_ids(8, 36)
    prompts = [system + token_ids(30 + i, 9) for i in range(3)]

    def one_by_one(llm: LLM) -> list[tuple]:
        out = [llm.generate([p], PARAMS, use_tqdm=False)[0] for p in prompts]
        llm.scheduler.check_integrity()
        return [(o["token_ids"], o["cached_tokens"]) for o in out]

    want, _ = serve(model, "naive", one_by_one, page_size=page_size)
    got, _ = serve(model, "radix", one_by_one, page_size=page_size)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [c for _, c in got] == [0, 0, 36]


def test_chunked_prefill_with_hits(model) -> None:
    """Prompts cut into chunks of 5 tokens: the state goes on from a restored snapshot."""
    want, _ = serve(model, "naive", chat, max_prefill_length=5)
    got, _ = serve(model, "radix", chat, max_prefill_length=5)
    assert tokens(got) == tokens(want)
    assert min(cached(got)[2]) > 34


def test_pages_of_four_tokens(model) -> None:
    """A turn's first forward stops at its prompt's last page boundary to save the state
    there (a sequence seldom leaves on one); the next turn resumes there."""
    want, _ = serve(model, "naive", lambda llm: chat(llm, turns=4), page_size=4)
    got, _ = serve(model, "radix", lambda llm: chat(llm, turns=4), page_size=4)
    assert tokens(got) == tokens(want)
    hits = [c for r in cached(got)[1:] for c in r]
    assert all(c % 4 == 0 for c in hits) and max(hits) > 0
    for before, now in zip(got[1:], got[2:]):  # from the third turn: at least the last
        # prompt's last boundary (more where the last turn left on one)
        assert all(c >= len(p) // 4 * 4 for (p, _, _), (_, _, c) in zip(before, now))


def test_too_few_snapshots_drop_the_least_recent(model) -> None:
    """One snapshot for three conversations: each turn only the one that finished last
    resumes; the others recompute, and every answer stays the same."""
    want, _ = serve(model, "naive", chat)
    got, s = serve(model, "radix", chat, state_snapshots=1)
    assert tokens(got) == tokens(want)
    for turn in cached(got)[1:]:
        assert sorted(turn)[:2] == [0, 0] and max(turn) > 0
    assert len(s.cache.snapshots.held) == 1


def test_too_few_pages_evict_nodes_with_their_snapshots(model) -> None:
    """A KV pool of 150 tokens for three conversations of up to 61: the radix cache evicts
    nodes and their snapshots go back (the integrity check after each turn says so); the
    conversation admitted first still hits."""
    evicted = []
    evict = RadixCache.evict

    def counting(self: RadixCache, num_tokens: int) -> torch.Tensor:
        freed = evict(self, num_tokens)
        evicted.append(len(freed))
        return freed

    want, _ = serve(model, "naive", chat, num_page_override=150)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RadixCache, "evict", counting)
        got, _ = serve(model, "radix", chat, num_page_override=150)
    assert tokens(got) == tokens(want)
    assert sum(evicted) > 0 and max(c for r in cached(got) for c in r) > 0


def test_preempted_requests_give_the_same_tokens(model, monkeypatch) -> None:
    """Too few pages for three long answers at once: the newest is preempted (its state saved
    as it leaves, and dropped with its pages when the others need them) and comes back."""
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", True)
    prompts = [token_ids(40 + i, 20) for i in range(3)]
    params = SamplingParams(max_tokens=30, ignore_eos=True)

    def run(llm: LLM) -> list[list[int]]:
        out = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.scheduler.check_integrity()
        return out

    want, _ = serve(model, "naive", run, num_page_override=110)
    got, s = serve(model, "radix", run, num_page_override=110)
    assert s.num_preemptions > 0
    assert got == want


def test_two_ranks_hit_alike(model) -> None:
    """Tensor parallelism: every rank runs the same scheduler over its own state pool, so
    each saves, drops and restores the same snapshots; the tokens are one rank's."""
    want, _ = serve(model, "naive", chat)
    got, _ = serve(model, "radix", chat, tp_size=2)
    assert tokens(got) == tokens(want)
    assert min(cached(got)[2]) > 0


def test_a_hit_that_skips_the_restore_goes_wrong(model, monkeypatch) -> None:
    """The control: if a hit starts from a zero state, as a miss does, the tokens change."""
    want, _ = serve(model, "naive", chat)

    def zero(self: RecurrentStatePool, snapshot: int, slot: int) -> None:
        self.conv[:, slot], self.ssm[:, slot] = 0, 0

    monkeypatch.setattr(RecurrentStatePool, "restore", zero)
    got, _ = serve(model, "radix", chat)
    assert max(cached(got)[1]) > 0
    assert tokens(got) != tokens(want)


def test_naive_cache_and_no_snapshots(model, caplog) -> None:
    """Asked for, the naive cache keeps no snapshot; with state_snapshots 0 the radix cache
    would find no state: the naive cache runs instead, and says why."""
    llm = LLM(model, cache_type="naive", **SERVE)
    assert llm.engine.state_pool.num_snapshots == 0
    assert type(llm.scheduler.cache) is not HybridCacheManager
    llm.shutdown()
    with caplog.at_level("INFO"):
        llm = LLM(model, state_snapshots=0, **SERVE)
    assert type(llm.scheduler.cache) is not HybridCacheManager
    assert "state_snapshots is 0" in caplog.text
    llm.shutdown()
    with pytest.raises(ValueError, match="state_snapshots must be >= 0"):
        LLM(model, state_snapshots=-1, **SERVE)


def test_snapshot_pool_size(model, caplog, monkeypatch) -> None:
    """As many snapshots as asked for, beside the running slots, and logged; by default a
    quarter of the memory budget the running states leave, but no more than a full KV pool
    has pages (each snapshot sits on a node of one page or more)."""
    with caplog.at_level("INFO"):
        llm = LLM(model, state_snapshots=6, **SERVE)
    pool = llm.engine.state_pool
    assert pool.saved_ssm.shape[:2] == (3, 6) and pool.ssm.shape[:2] == (3, 5)
    assert "and 6 prefix-cache snapshots" in caplog.text
    assert "with 6 recurrent-state snapshots" in caplog.text
    llm.shutdown()
    per_slot = pool.bytes // (5 + 6)
    default = {**SERVE, "num_page_override": None}
    llm = LLM(model, **default)  # 512 MB: far more than 4 rows x 128 pages can carry
    assert llm.engine.state_pool.num_snapshots == llm.engine.config.state_snapshots == 512
    llm.shutdown()
    monkeypatch.setattr(ENV.CPU_KV_CACHE_MB, "value", 1)
    llm = LLM(model, **default)
    quarter = int((2**20 - 5 * per_slot) * 0.25) // per_slot
    assert 0 < llm.engine.state_pool.num_snapshots == quarter < 512
    llm.shutdown()


def test_the_hit_rate_tool_runs(capsys) -> None:
    """tools/bench_prefix_cache_hybrid.py, small and in this process: every run's line, the
    hybrid's tokens the naive cache's, and hits where snapshots are kept."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import bench_prefix_cache_hybrid as bench
    finally:
        sys.path.pop(0)
    bench.main(["--conversations", "2", "--turns", "2", "--system", "36", "--message", "4",
                "--answer", "3"])  # fmt: skip
    out = capsys.readouterr().out
    rates = [float(line.split()[-2].rstrip("%")) for line in out.splitlines() if "%" in line]
    assert len(rates) == 4 and "DIFFER" not in out
    assert rates[0] >= rates[1] > 0 and rates[3] == 0


# ---- the live page's counters: the state pool of a hybrid -----------------------------------


def test_the_live_page_counts_state_slots_and_snapshots(model) -> None:
    """The counters the page reads (chapter 30's snapshot, as it crosses the socket): slots in
    use are the running requests, of max_running_req; snapshots held grow as requests leave."""
    from minisgl.message.backend import UserMsg
    from minisgl.message.codec import decode, encode
    from minisgl.message.dashboard import WatchMsg
    from minisgl.scheduler.observe import Observer

    llm = LLM(model, **SERVE)
    try:
        s = llm.scheduler
        observer = Observer(s)
        observer.receive([WatchMsg(30.0)])
        prompts = [token_ids(300 + i, 20) for i in range(3)]
        msgs = [UserMsg(500 + i, p, PARAMS) for i, p in enumerate(prompts)]
        observer.receive(msgs)
        s.receive(msgs)
        seen = []
        while s.has_work:
            observer.next_at = 0.0  # a snapshot after every step
            if (snap := observer.publish(s.step())) is not None:
                seen.append(decode(encode(snap)).counters)
        pool = llm.engine.state_pool
        assert seen and pool is not None
        for c in seen:
            assert c["state_slots"] == SERVE["max_running_req"]
            assert c["state_slots_in_use"] == c["running"]
            assert c["state_snapshots"] == pool.num_snapshots > 0
        assert max(c["state_slots_in_use"] for c in seen) == len(prompts)
        assert seen[-1]["state_slots_in_use"] == 0
        assert seen[-1]["state_snapshots_held"] == len(prompts)  # one as each request left
    finally:
        llm.shutdown()
