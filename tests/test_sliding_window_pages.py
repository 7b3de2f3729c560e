"""Sliding layers in pages of their own, given back as a request moves on (window_pages.py).

Three tiny random models (seed 0, fp32) whose sliding layers keep a windowed pool far smaller
than the sequences: Gemma 4 shaped like E2B (sliding, full and KV-shared layers, window 8),
Gemma 3 (a sliding and a full layer of one shape, window 12) and Mistral (every layer slides,
window 8: full pages are page ids only). With pages of 1 and 4 tokens:
- under teacher forcing, through the cache manager that frees windowed pages (a prompt 5x the
  window in two chunks, then twice the window of decode steps), the logits equal
  transformers'; the windowed free list gets pages back during decode, a request never holds
  more than its window's pages, and once the request is done and the cache flushed both free
  lists are full;
- through the offline API (the radix cache, chunked prefill, emulated decode graphs, and
  overlap scheduling), greedy tokens equal transformers', and a second turn that extends
  each conversation hits the cache at its full length and still equals transformers'.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import all_logits, make_engine, windowed_models
from helpers import windowed_token_ids as token_ids

from minisgl.core import Batch, Req, SamplingParams
from minisgl.env import ENV
from minisgl.kvcache.window_pages import WindowedKVCache, store_slots
from minisgl.llm import LLM
from minisgl.scheduler.window_cache import WindowCacheManager

TOL = 1e-4
WINDOWS = {"gemma4": 8, "gemma3": 12, "mistral": 8}  # helpers.windowed_configs' windows


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return windowed_models(tmp_path_factory.mktemp("swa"))


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens, each from a whole forward over the sequence so far (no cache)."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]


# ---- teacher forcing through the cache manager --------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(
    ("name", "backend"),
    [("gemma4", "torch"), ("gemma3", "torch"), ("mistral", "torch"), ("gemma4", "triton")],
)
def test_teacher_forced_logits_with_pages_given_back(folders, name, backend, page_size) -> None:
    window = WINDOWS[name]
    decode, chunk = 2 * window, 2 * window + 3
    ids = token_ids(1, 5 * window + decode)
    if backend == "triton":  # the interpreter is slow: fewer steps
        ids, decode = ids[: 3 * window + 4], 4
    # the running request's share of windowed pages (its longer chunk), and little more
    window_pages = -(-(window + max(chunk, len(ids) - decode - chunk)) // page_size) + 3
    engine = make_engine(folders[name], page_size=page_size, attention_backend=backend,
                         window_pages=window_pages, num_page_override=128 // page_size)  # fmt: skip
    pool = engine.kv_cache
    assert isinstance(pool, WindowedKVCache) and pool.num_window_pages == window_pages
    sliding = [k.size(1) for k, g in zip(pool.group_k, _groups(engine)) if g.window]
    assert sliding and all(n == window_pages + 1 for n in sliding)  # and the dummy page
    cm = WindowCacheManager(engine.num_pages, page_size, engine.page_table, "radix", pool)
    n = len(ids) - decode
    req = Req(torch.tensor(ids[:n], dtype=torch.int32), 0, 0, decode + 1, 0,
              SamplingParams(max_tokens=decode + 1))  # fmt: skip
    engine.token_pool[0, :n] = req.input_ids
    cm.attach(req, cm.match(req.input_ids))
    given = count_given_back(cm)
    out = []
    for end in (chunk, n):
        req.device_len = end
        cm.allocate([req])
        out.append(all_logits(engine, [req], "prefill"))
        cm.cache_req(req, finished=False)
        cm.check_integrity([req])
    for pos in range(n, len(ids)):
        engine.token_pool[0, pos] = ids[pos]  # the reference's next token
        req.append_host(ids[pos])
        cm.allocate([req])
        held = sum(r > 0 for r in cm.refs)
        assert held <= -(-window // page_size) + 1, f"{held} windowed pages held"
        out.append(all_logits(engine, [req], "decode"))
        cm.check_integrity([req])
    want = hf_model(folders[name])(torch.tensor([ids])).logits[0].float().detach()
    got = torch.cat(out)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= TOL
    # pages that fell out of the window went back to the free list (the prompt's stay idle
    # on their cached pages until the free list runs short), and were taken again
    assert len(given) >= (len(ids) - chunk) // page_size - 2 * (window // page_size) - 2
    cm.cache_req(req, finished=True)
    cm.check_integrity([])
    assert cm.idle  # the sequence's last window stays with the cached pages
    cm._free_slots(cm.cache.evict(cm.cache.evictable_tokens))  # a flush
    cm.check_integrity([])
    assert cm.allocator.num_free == engine.num_pages
    assert cm.window_free == window_pages


def test_kernels_that_store_keys_themselves_get_the_windowed_slots(folders) -> None:
    """The fused rotary-and-store kernel (a GPU's) writes where `store_slots` says: a sliding
    layer's windowed slots, a full layer's own."""
    engine = make_engine(folders["gemma3"], page_size=4, window_pages=6)
    pool = engine.kv_cache
    assert isinstance(pool, WindowedKVCache) and pool.windowed == {0}
    pool.window_map[:3] = torch.tensor([5, 0, 2], dtype=torch.int32)
    slots = torch.tensor([0, 3, 4, 9, 11], dtype=torch.int32)
    assert store_slots(pool, slots, 0).tolist() == [20, 23, 0, 9, 11]
    assert store_slots(pool, slots, 1) is slots


def _groups(engine) -> list:
    from minisgl.kvcache.layout import KVLayout

    return list(KVLayout.of(engine.model_config, engine.max_seq_len).groups)


def test_a_model_without_a_window_keeps_its_pool(folders) -> None:
    """Windows no shorter than the context, or `window_pages=0`: one page id space, as
    before (Mistral's every layer in chapter 3's pool)."""
    from minisgl.kvcache.mha_pool import MHAKVCache

    for kw in (dict(max_seq_len_override=8), dict(window_pages=0)):
        engine = make_engine(folders["mistral"], **kw)
        assert type(engine.kv_cache) is MHAKVCache
        assert not hasattr(engine.attn_backend, "window_table")


# ---- served: radix cache, chunks, graphs, overlap -----------------------------------------


def count_given_back(cm: WindowCacheManager) -> list[int]:
    """The windowed pages given back to the free list from now on, in order."""
    given: list[int] = []
    free = cm.window_pages.free
    cm.window_pages.free = lambda pages: (given.extend(pages), free(pages))[1]  # type: ignore
    return given


class FreeCounter:
    """At each decode step, how many windowed pages went back to the free list so far; and
    the pools checked, every step."""

    def __init__(self, llm: LLM) -> None:
        self.llm, self.decode_given = llm, []
        self.given = count_given_back(llm.scheduler.cache)  # type: ignore[arg-type]

    def forward_begins(self, batch: Batch) -> None:
        self.llm.scheduler.check_integrity()
        if batch.is_decode:
            self.decode_given.append(len(self.given))

    def forward_launched(self, batch: Batch) -> None:
        pass


PARAMS = SamplingParams(max_tokens=14, ignore_eos=True)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(("name", "page_size"), [("gemma4", 4), ("gemma3", 1), ("mistral", 4)])
def test_served_turns_equal_transformers(folders, name, page_size, overlap, monkeypatch) -> None:
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", not overlap)
    window = WINDOWS[name]
    prompts = [token_ids(10 + i, k * window + i) for i, k in enumerate((3, 4, 6))]
    model = hf_model(folders[name])
    want = [hf_greedy(model, p, PARAMS.max_tokens) for p in prompts]
    turn2 = [p + w + token_ids(20 + i, 5) for i, (p, w) in enumerate(zip(prompts, want))]
    want2 = [hf_greedy(model, p, PARAMS.max_tokens) for p in turn2]
    running = 3 * (-(-window // page_size) + 2) + -(-7 // page_size)
    llm = LLM(str(folders[name]), device="cpu", dtype="float32", max_running_req=3,
              page_size=page_size, num_page_override=512 // page_size, max_prefill_length=7,
              cuda_graph_max_bs=2, cache_type="radix", window_pages=running + 6)  # fmt: skip
    counter = FreeCounter(llm)
    llm.scheduler.listeners.append(counter)
    try:
        assert sorted(llm.engine.graph_runner.graph_map) == [1, 2]
        first = llm.generate(prompts, PARAMS, use_tqdm=False)
        second = llm.generate(turn2, PARAMS, use_tqdm=False)
        cache = llm.scheduler.cache
        assert isinstance(cache, WindowCacheManager)
        cache._free_slots(cache.cache.evict(cache.cache.evictable_tokens))  # a flush
        llm.scheduler.check_integrity()
        assert cache.allocator.num_free == cache.num_pages
        assert cache.window_free == cache.pool.num_window_pages < 3 * max(map(len, turn2))
    finally:
        llm.shutdown()
    assert [o["token_ids"] for o in first] == want
    assert [o["token_ids"] for o in second] == want2
    # the next turn finds the whole previous sequence (but its last sampled token, never
    # forwarded), its last window's pages kept
    for out, p, w in zip(second, prompts, want):
        assert out["cached_tokens"] == (len(p) + len(w) - 1) // page_size * page_size
    given = counter.decode_given
    assert any(b > a for a, b in zip(given, given[1:])), f"none given back in decode: {given}"


def test_a_tight_windowed_pool_runs_fewer_at_once_and_leaks_nothing(folders) -> None:
    """Windowed pages for little more than one request: admission waits for them (the three
    prompts never all run at once), the tokens are transformers', every step's pools add up,
    and a flush leaves both free lists full."""
    prompts = [token_ids(30 + i, 3 * 8 + 5 * i) for i in range(3)]
    model = hf_model(folders["gemma4"])
    want = [hf_greedy(model, p, PARAMS.max_tokens) for p in prompts]
    llm = LLM(str(folders["gemma4"]), device="cpu", dtype="float32", max_running_req=3,
              page_size=4, num_page_override=128, max_prefill_length=7, cuda_graph_max_bs=0,
              window_pages=7)  # fmt: skip
    counter, sizes = FreeCounter(llm), []
    llm.scheduler.listeners.append(counter)
    counter.forward_launched = lambda batch: sizes.append(len(llm.scheduler.reqs))  # type: ignore
    try:
        got = [o["token_ids"] for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
        cache = llm.scheduler.cache
        cache._free_slots(cache.cache.evict(cache.cache.evictable_tokens))  # a flush
        llm.scheduler.check_integrity()
        assert cache.allocator.num_free == cache.num_pages and cache.window_free == 7
    finally:
        llm.shutdown()
    assert got == want
    assert max(sizes) < 3


@pytest.mark.parametrize("kind", ["full", "breakable"])
def test_prefill_graphs_equal_transformers(folders, kind) -> None:
    """Chunked prompts through emulated prefill graphs (whole, or broken at attention): the
    sliding layers' metadata goes through their own static buffers too."""
    prompts = [token_ids(40 + i, 4 * 8 + 3 * i) for i in range(2)]
    model = hf_model(folders["gemma4"])
    want = [hf_greedy(model, p, PARAMS.max_tokens) for p in prompts]
    llm = LLM(str(folders["gemma4"]), device="cpu", dtype="float32", max_running_req=2,
              page_size=4, num_page_override=64, max_prefill_length=8, cuda_graph_max_bs=2,
              prefill_graph=kind, prefill_graph_tokens=[8], window_pages=16)  # fmt: skip
    try:
        assert llm.engine.graph_runner.graphs("prefill")
        got = [o["token_ids"] for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
        llm.scheduler.check_integrity()
    finally:
        llm.shutdown()
    assert got == want
