"""Chapter 20: FlashAttention in Triton - online softmax, tiling, split-KV decode.

First the online softmax by hand: attention over keys seen one block at a time equals
attention over all of them at once. Then our two Triton kernels on a paged KV cache,
checked against plain torch. Without a GPU they run in Triton's interpreter (slowly).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined

import torch.nn.functional as F  # noqa: E402

from minisgl.kernels.attention import decode_num_splits  # noqa: E402
from minisgl.kernels.decode_attention import decode_attention  # noqa: E402
from minisgl.kernels.extend_attention import extend_attention  # noqa: E402

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"

# ---- the online softmax, one block of keys at a time ----------------------------------
q, keys, values = torch.randn(8), torch.randn(40, 8), torch.randn(40, 8)
m, total, acc = float("-inf"), 0.0, torch.zeros(8)
for start in range(0, 40, 16):
    s = keys[start : start + 16] @ q
    m_new = max(m, s.max().item())
    alpha = torch.exp(torch.tensor(m - m_new))  # rescales what was summed so far
    p = torch.exp(s - m_new)
    total, acc, m = total * alpha + p.sum(), acc * alpha + p @ values[start : start + 16], m_new
    print(f"keys [{start:2d}, {min(start + 16, 40):2d}): running max {m:.3f}, sum {total:.3f}")
full = torch.softmax(keys @ q, 0) @ values
print("blockwise equals all at once:", torch.allclose(acc / total, full, atol=1e-6))

# ---- the kernels on a paged cache -----------------------------------------------------
PAGE, HEADS, KV_HEADS, DIM = 4, 8, 2, 32
slots = 64 * PAGE
k_cache = torch.randn(slots, KV_HEADS, DIM, device=device)
v_cache = torch.randn(slots, KV_HEADS, DIM, device=device)
pages = torch.randperm(64)
table = (pages.view(2, 32)[..., None] * PAGE + torch.arange(PAGE)).view(2, 128)
table = table.to(device, torch.int32)
seq_lens = [11, 37]  # request 0 ends mid-page
rows = torch.tensor([0, 1], dtype=torch.int32, device=device)
lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
print("page table row 0 starts", table[0, :12].tolist())


def reference(q: torch.Tensor, qo: list[int]) -> torch.Tensor:
    out = torch.empty_like(q)
    for i, n_kv in enumerate(seq_lens):
        idx = table[i, :n_kv].long()
        n_q = qo[i + 1] - qo[i]
        visible = (
            torch.arange(n_kv, device=device)[None]
            <= torch.arange(n_kv - n_q, n_kv, device=device)[:, None]
        )
        out[qo[i] : qo[i + 1]] = F.scaled_dot_product_attention(
            q[qo[i] : qo[i + 1]].transpose(0, 1),
            k_cache[idx].transpose(0, 1),
            v_cache[idx].transpose(0, 1),
            attn_mask=visible,
            enable_gqa=True,
        ).transpose(0, 1)
    return out


q = torch.randn(2, HEADS, DIM, device=device)
out = decode_attention(q, k_cache, v_cache, table, rows, lens, DIM**-0.5)
print(f"decode: {decode_num_splits(2, KV_HEADS)} splits per request, GQA group {HEADS // KV_HEADS}")
print("  max error vs torch:", f"{(out - reference(q, [0, 1, 2])).abs().max().item():.1e}")

qo = [0, 5, 5 + 37]  # request 0: 5 new tokens over a 6-token prefix; request 1: a whole prompt
q = torch.randn(qo[-1], HEADS, DIM, device=device)
qo_t = torch.tensor(qo, dtype=torch.int32, device=device)
out = extend_attention(q, k_cache, v_cache, table, rows, lens, qo_t, 37, DIM**-0.5)
print("extend: max error vs torch:", f"{(out - reference(q, qo)).abs().max().item():.1e}")
