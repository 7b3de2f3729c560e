"""Chapter 4: attention over pages. Requests, a batch, and the reference backend, checked
against plain causal attention over each whole sequence.

Run from the repo root: python examples/ch04_paged_attention.py
"""

import torch
import torch.nn.functional as F

from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.core import Batch, Context, Req, SamplingParams, set_global_ctx
from minisgl.kvcache.allocator import PageAllocator, page_slots
from minisgl.kvcache.mha_pool import MHAKVCache
from minisgl.layers.attention import AttentionLayer
from minisgl.layers.rotary import get_rope

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 4, 2, 16, 4
cpu = torch.device("cpu")
torch.manual_seed(0)

# What the engine will set up for us later: a pool, a page table, a backend, a context.
pool = MHAKVCache(1, 16, PAGE_SIZE, KV_HEADS, HEAD_DIM, torch.float32, cpu)
page_table = torch.zeros((2, 16), dtype=torch.int32)
backend = TorchAttnBackend(pool, page_table, scale=HEAD_DIM**-0.5, num_qo_heads=HEADS)
ctx = Context(backend)
set_global_ctx(ctx)
rope = get_rope(HEAD_DIM, 10000.0, 64, cpu)
layer = AttentionLayer(0, HEADS, KV_HEADS, HEAD_DIM, rope)

# Two sequences of projected q|k|v rows; A will have 5 prompt tokens, B 10, plus one decode each.
lengths = {"A": 6, "B": 11}  # uid 0 is A, uid 1 is B
qkv = {n: torch.randn(L, (HEADS + 2 * KV_HEADS) * HEAD_DIM) for n, L in lengths.items()}
alloc = PageAllocator(pool.num_pages)
for row, L in enumerate(lengths.values()):
    slots = page_slots(alloc.alloc(-(-L // PAGE_SIZE)), PAGE_SIZE)
    page_table[row, : len(slots)] = slots
print(f"page table rows:\n{page_table}")


def run(reqs: list[Req], phase: str) -> torch.Tensor:
    """One attention forward for the new tokens [cached_len, device_len) of each request."""
    batch = Batch(reqs, phase)
    positions = torch.cat([torch.arange(r.cached_len, r.device_len) for r in reqs])
    rows = torch.cat([torch.full((r.extend_len,), r.table_idx) for r in reqs])
    batch.positions = positions.to(torch.int32)
    batch.out_loc = page_table[rows, positions]  # the slot each new token's K/V goes to
    backend.prepare_metadata(batch)
    new_qkv = torch.cat([qkv["AB"[r.uid]][r.cached_len : r.device_len] for r in reqs])
    with ctx.forward_batch(batch):
        return layer(new_qkv)


def ids(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int32)  # token ids do not matter to attention


# B's first 6 tokens were computed earlier (think: a shared system prompt); store them alone.
greedy = SamplingParams()
prefix = Req(ids(6), table_idx=1, cached_len=0, output_len=1, uid=1, sampling_params=greedy)
run([prefix], "prefill")
# Prefill: A from scratch (5 tokens), B extends its cached prefix of 6 by 4 new tokens.
a = Req(ids(5), table_idx=0, cached_len=0, output_len=1, uid=0, sampling_params=greedy)
b = Req(ids(10), table_idx=1, cached_len=6, output_len=1, uid=1, sampling_params=greedy)
md_batch = Batch([a, b], "prefill")
backend.prepare_metadata(md_batch)
md = md_batch.attn_metadata
print(
    f"prefill metadata: cu_seqlens_q={md.cu_seqlens_q.tolist()} "
    f"cache_seqlens={md.cache_seqlens.tolist()} last={md.get_last_indices().tolist()}"
)
out_prefill = run([a, b], "prefill")
# Decode: each request's next token, one query each, attending over all its pages.
for r in (a, b):
    r.complete_one()
print(f"after the prefill: {a}, {b}")
out_decode = run([a, b], "decode")


def dense(name: str) -> torch.Tensor:
    """Plain causal attention over the whole sequence, no cache, no pages."""
    q, k, v = qkv[name].split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
    L = len(q)
    q, k = rope(torch.arange(L), q.view(L, HEADS, -1), k.view(L, KV_HEADS, -1))
    v = v.view(L, KV_HEADS, -1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    )
    return out.transpose(0, 1).reshape(L, -1)


ref_a, ref_b = dense("A"), dense("B")
checks = {
    "prefill A (positions 0-4)": (out_prefill[:5], ref_a[0:5]),
    "prefill B (positions 6-9, 0-5 cached)": (out_prefill[5:], ref_b[6:10]),
    "decode A (position 5)": (out_decode[0], ref_a[5]),
    "decode B (position 10)": (out_decode[1], ref_b[10]),
}
worst = 0.0
for what, (ours, ref) in checks.items():
    diff = (ours - ref).abs().max().item()
    worst = max(worst, diff)
    print(f"{what:<38} max |paged - dense| = {diff:.2e}")
if worst > 1e-5:
    raise SystemExit("paged attention differs from dense causal attention")
print("paged attention equals dense causal attention")
