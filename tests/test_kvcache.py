"""Chapter 3: the paged KV pool (shapes, dummy page, store and gather) and the page allocator."""

from __future__ import annotations

import random

import pytest
import torch

from minisgl.kvcache.allocator import PageAllocator, page_slots
from minisgl.kvcache.mha_pool import MHAKVCache

CPU = torch.device("cpu")
LAYERS, KV_HEADS, HEAD_DIM = 3, 2, 8


def _pool(num_pages: int, page_size: int, dtype: torch.dtype = torch.float32) -> MHAKVCache:
    return MHAKVCache(LAYERS, num_pages, page_size, KV_HEADS, HEAD_DIM, dtype, CPU)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_shapes(page_size: int, dtype: torch.dtype) -> None:
    pool = _pool(10, page_size, dtype)
    assert pool.dummy_page == 10
    assert pool.num_slots == 11 * page_size  # ten real pages plus the dummy page
    for layer in range(LAYERS):
        for cache in (pool.k_cache(layer), pool.v_cache(layer)):
            assert cache.shape == (11 * page_size, KV_HEADS, HEAD_DIM)
            assert cache.dtype == dtype
            assert not cache.any(), "a fresh pool must be zeros (stale slots are masked, not NaN)"
    total = sum(pool.k_cache(i).nbytes + pool.v_cache(i).nbytes for i in range(LAYERS))
    per_page = MHAKVCache.bytes_per_page(LAYERS, page_size, KV_HEADS, HEAD_DIM, dtype)
    assert total == per_page * (10 + 1)


def test_pool_rejects_empty_shapes() -> None:
    with pytest.raises(ValueError, match="num_pages"):
        _pool(0, 16)
    with pytest.raises(ValueError, match="page_size"):
        _pool(4, 0)


@pytest.mark.parametrize("page_size", [1, 16])
def test_store_then_gather(page_size: int) -> None:
    num_pages = 64 // page_size + 2
    pool = _pool(num_pages, page_size)
    rng = random.Random(page_size)
    pages = rng.sample(range(num_pages), 3)  # scattered, out of order
    slots = page_slots(pages, page_size)[: 2 * page_size + 1]  # last page only partly used
    g = torch.Generator().manual_seed(0)
    k = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=g)
    pool.store_kv(k, v, slots, layer_id=1)

    torch.testing.assert_close(pool.k_cache(1)[slots.long()], k, rtol=0, atol=0)
    torch.testing.assert_close(pool.v_cache(1)[slots.long()], v, rtol=0, atol=0)
    # nothing else moved: other layers, and every other slot of this layer, are still zero
    for layer in (0, 2):
        assert not pool.k_cache(layer).any() and not pool.v_cache(layer).any()
    untouched = torch.ones(pool.num_slots, dtype=torch.bool)
    untouched[slots.long()] = False
    assert not pool.k_cache(1)[untouched].any()
    assert not pool.v_cache(1)[untouched].any()
    # the slot view is the pool: a page's rows are consecutive slots of that page
    page = pages[0]
    rows = pool.k_cache(1)[page * page_size : (page + 1) * page_size]
    torch.testing.assert_close(rows, k[:page_size], rtol=0, atol=0)


def test_store_overwrites_in_place() -> None:
    pool = _pool(4, 4)
    slots = page_slots([2], 4)
    pool.store_kv(torch.ones(4, KV_HEADS, HEAD_DIM), torch.ones(4, KV_HEADS, HEAD_DIM), slots, 0)
    view = pool.k_cache(0)
    pool.store_kv(
        torch.full((1, KV_HEADS, HEAD_DIM), 7.0),
        torch.zeros(1, KV_HEADS, HEAD_DIM),
        slots[1:2],
        0,
    )
    # a view taken before the store sees the new value: k_cache is not a copy
    assert view[int(slots[1])].eq(7.0).all()
    assert view[int(slots[0])].eq(1.0).all()
    assert pool.v_cache(0)[int(slots[1])].eq(0.0).all()


@pytest.mark.parametrize("page_size", [1, 16])
def test_dummy_page_is_separate(page_size: int) -> None:
    pool = _pool(3, page_size)
    real = page_slots(list(range(3)), page_size)
    dummy = page_slots([pool.dummy_page], page_size)
    assert set(real.tolist()).isdisjoint(dummy.tolist())
    assert int(dummy.max()) == pool.num_slots - 1
    # Padding writes go to the dummy page (every padded token may share one slot).
    junk = torch.full((5, KV_HEADS, HEAD_DIM), 9.0)
    pad_loc = torch.full((5,), int(dummy[0]), dtype=torch.int32)
    pool.store_kv(junk, junk, pad_loc, layer_id=0)
    assert not pool.k_cache(0)[real.long()].any(), "a dummy write leaked into a real page"
    assert pool.k_cache(0)[int(dummy[0])].eq(9.0).all()


# ---------------------------------------------------------------- allocator


def test_allocator_hands_out_distinct_real_pages() -> None:
    alloc = PageAllocator(8)
    assert alloc.num_free == 8
    a, b = alloc.alloc(3), alloc.alloc(5)
    assert alloc.num_free == 0
    pages = a + b
    assert sorted(pages) == list(range(8)), "every page once, and never the dummy page (8)"


def test_allocator_exhaustion_message() -> None:
    alloc = PageAllocator(5)
    alloc.alloc(3)
    with pytest.raises(MemoryError, match=r"asked for 4 KV pages, only 2 free"):
        alloc.alloc(4)
    assert alloc.num_free == 2, "a failed alloc must not take pages"
    assert len(alloc.alloc(2)) == 2
    with pytest.raises(MemoryError, match=r"asked for 1 KV pages, only 0 free"):
        alloc.alloc(1)


def test_allocator_free_and_reuse() -> None:
    alloc = PageAllocator(6)
    first = alloc.alloc(4)
    alloc.free(first[1:3])
    assert alloc.num_free == 4
    again = alloc.alloc(4)
    assert set(again) == set(range(6)) - {first[0], first[3]}
    assert set(again).isdisjoint({first[0], first[3]})
    alloc.free(again)
    alloc.free([first[0], first[3]])
    assert sorted(alloc.alloc(6)) == list(range(6))


def test_allocator_alloc_zero() -> None:
    alloc = PageAllocator(2)
    assert alloc.alloc(0) == []
    assert alloc.num_free == 2


def test_allocator_random_churn() -> None:
    # Whatever the order of allocs and frees, no page is ever held twice or lost.
    rng = random.Random(0)
    alloc = PageAllocator(32)
    held: list[list[int]] = []
    for _ in range(300):
        if held and (rng.random() < 0.5 or alloc.num_free == 0):
            alloc.free(held.pop(rng.randrange(len(held))))
        else:
            held.append(alloc.alloc(rng.randint(1, alloc.num_free)))
        owned = [p for pages in held for p in pages]
        assert len(owned) == len(set(owned))
        assert alloc.num_free + len(owned) == 32
        assert all(0 <= p < 32 for p in owned)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_page_slots(page_size: int) -> None:
    pages = [5, 0, 3]
    slots = page_slots(pages, page_size)
    assert slots.dtype == torch.int32
    expected = [p * page_size + off for p in pages for off in range(page_size)]
    assert slots.tolist() == expected
    assert page_slots([], page_size).numel() == 0


def test_page_table_row_gathers_a_sequence() -> None:
    # A sequence written through its page-table row reads back in token order, whatever pages.
    page_size, seq_len = 4, 11
    pool, alloc = _pool(8, page_size), PageAllocator(8)
    alloc.alloc(2)  # someone else holds the first pages, so ours are not 0, 1, 2
    pages = alloc.alloc(-(-seq_len // page_size))
    pages.reverse()
    row = page_slots(pages, page_size)[:seq_len]
    k = torch.arange(seq_len, dtype=torch.float32)[:, None, None].expand(
        seq_len, KV_HEADS, HEAD_DIM
    )
    pool.store_kv(k, -k, row, layer_id=2)
    got = pool.k_cache(2)[row.long()][:, 0, 0]
    assert got.tolist() == list(range(seq_len))
    assert pool.v_cache(2)[row.long()][:, 0, 0].tolist() == [-float(i) for i in range(seq_len)]
