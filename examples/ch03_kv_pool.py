"""Chapter 3: the paged KV pool. Two requests of different lengths share one pool of pages.

Run from the repo root: python examples/ch03_kv_pool.py
"""

import torch

from minisgl.kvcache.allocator import PageAllocator, page_slots
from minisgl.kvcache.mha_pool import MHAKVCache

LAYERS, PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM = 2, 8, 4, 2, 3
pool = MHAKVCache(LAYERS, PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
alloc = PageAllocator(PAGES)
print(
    f"pool: {PAGES} pages of {PAGE_SIZE} tokens + dummy page {pool.dummy_page}, "
    f"{pool.num_slots} slots; k_cache(0) is {tuple(pool.k_cache(0).shape)}"
)
print(
    f"bytes per page (fp32): "
    f"{MHAKVCache.bytes_per_page(LAYERS, PAGE_SIZE, KV_HEADS, HEAD_DIM, torch.float32)}"
)

# One page-table row per request; one column per token position, holding that token's slot.
lengths = {"A": 6, "B": 9}
page_table = torch.full((len(lengths), 12), -1, dtype=torch.int32)
owned, kv = {}, {}
torch.manual_seed(0)
for row, (name, n) in enumerate(lengths.items()):
    owned[name] = alloc.alloc(-(-n // PAGE_SIZE))  # ceil(n / page_size) pages
    slots = page_slots(owned[name], PAGE_SIZE)
    page_table[row, : len(slots)] = slots
    print(f"request {name}: {n} tokens -> pages {owned[name]} -> slots {slots.tolist()}")
    # Store K/V of every layer for the request's tokens at the slots of positions 0..n-1.
    kv[name] = torch.randn(2, LAYERS, n, KV_HEADS, HEAD_DIM)
    for layer in range(LAYERS):
        pool.store_kv(kv[name][0, layer], kv[name][1, layer], page_table[row, :n], layer)
# A grows by 3 tokens (6 -> 9): a third page, wherever one is free; its slots need not follow.
extra = torch.randn(2, LAYERS, 3, KV_HEADS, HEAD_DIM)
owned["A"] += alloc.alloc(1)
page_table[0, 8:12] = page_slots(owned["A"][2:], PAGE_SIZE)
for layer in range(LAYERS):
    pool.store_kv(extra[0, layer], extra[1, layer], page_table[0, 6:9], layer)
kv["A"], lengths["A"] = torch.cat([kv["A"], extra], dim=2), 9
print(f"request A grows to 9 tokens -> pages {owned['A']}")
print(f"page table (-1 = unused):\n{page_table}")
print(f"free pages left: {alloc.num_free}")

# Gather each request's K/V back through its page-table row: it comes back in token order.
for row, (name, n) in enumerate(lengths.items()):
    slots = page_table[row, :n].long()
    for layer in range(LAYERS):
        k_ok = torch.equal(pool.k_cache(layer)[slots], kv[name][0, layer])
        v_ok = torch.equal(pool.v_cache(layer)[slots], kv[name][1, layer])
        if not (k_ok and v_ok):
            raise SystemExit(f"request {name}, layer {layer}: K/V read back differ")
print("gathered K/V equal what was stored, for both requests and every layer")

# Padding requests write into the dummy page; no real request can ever own it.
dummy_slots = page_slots([pool.dummy_page], PAGE_SIZE)
pool.store_kv(torch.ones(4, KV_HEADS, HEAD_DIM), torch.ones(4, KV_HEADS, HEAD_DIM), dummy_slots, 0)
still = all(
    torch.equal(pool.k_cache(0)[page_table[r, :n].long()], kv[name][0, 0])
    for r, (name, n) in enumerate(lengths.items())
)
print(
    f"dummy page {pool.dummy_page} = slots {dummy_slots.tolist()}; "
    f"real requests untouched after writing there: {still}"
)
assert still

# Finishing request A returns its pages; the next request reuses them.
alloc.free(owned.pop("A"))
print(f"A finished: free pages {alloc.num_free}; next request of 5 tokens gets {alloc.alloc(2)}")
try:
    alloc.alloc(alloc.num_free + 1)
except MemoryError as e:
    print(f"asking for too many pages: MemoryError({e})")
