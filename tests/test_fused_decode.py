"""Decode attention from qkv in one kernel equals the three kernels it replaces.

`kernels/fused_decode.py` rotates (and norms) q and the new key, stores the key and value,
attends over the pages and merges its splits in the last program of each (request, KV
head). Against `qk_rope_store` followed by `decode_attention`, on CPU in Triton's
interpreter (tests/conftest.py turns it on without a GPU): the output, the KV pool
(written where the new tokens go and nowhere else) and the split counters, which must be
zero again after every call or the next step (or graph replay) would merge too early.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import TINY, need

from minisgl.core import SamplingParams
from minisgl.env import ENV
from minisgl.kernels import fused_decode
from minisgl.kernels.attention import decode_num_splits
from minisgl.kernels.decode_attention import decode_attention
from minisgl.kernels.fused_decode import decode_attention_qkv
from minisgl.kernels.rope_store import qk_rope_store
from minisgl.layers.rotary import RotaryEmbedding
from minisgl.llm import LLM

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or Triton's interpreter",
)
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CASES = [  # (q heads, kv heads, head_dim, qk norm, batch, longest context)
    (4, 2, 16, True, 3, 160),
    (6, 2, 24, False, 2, 160),  # half a head not a power of two
    (8, 8, 64, False, 1, 160),  # many splits
    (8, 8, 16, True, 64, 24),  # one split: no partials, no merge
]


@pytest.mark.parametrize(("hq", "hkv", "d", "norm", "bs", "width"), CASES)
def test_one_kernel_equals_rope_store_then_decode_attention(hq, hkv, d, norm, bs, width) -> None:
    gen = torch.Generator().manual_seed(hq * d + bs)
    slots = width * bs + 1
    # each request's positions in their own slots, in a shuffled order
    table = torch.randperm(slots - 1, generator=gen)[: bs * width].reshape(bs, width)
    table = table.to(torch.int32)
    seq_lens = torch.randint(1, width + 1, (bs,), generator=gen)
    seq_lens[0] = width - 30 if bs == 1 else width  # a long one: several splits hold keys
    rows = torch.arange(bs, dtype=torch.int32)
    positions = (seq_lens - 1).to(torch.int32)
    out_loc = table[torch.arange(bs), positions.long()]
    qkv = torch.randn(bs, (hq + 2 * hkv) * d, generator=gen)
    weights = [torch.rand(d, generator=gen) + 0.5 for _ in range(2)] if norm else [None, None]
    rope = RotaryEmbedding(d, 10000.0, width, torch.device("cpu"))
    k_cache = torch.randn(slots, hkv, d, generator=gen)
    v_cache = torch.randn(slots, hkv, d, generator=gen)
    scale = d**-0.5

    def run(fused: bool, dtype: torch.dtype = torch.float32):
        kc, vc = k_cache.clone().to(DEV, dtype), v_cache.clone().to(DEV, dtype)
        args = [qkv.to(DEV, dtype), positions.to(DEV), rope.cos_sin.to(DEV)]
        w = [t.to(DEV, dtype) if t is not None else None for t in weights]
        meta = [t.to(DEV) for t in (out_loc, table, rows, seq_lens.to(torch.int32))]
        if fused:
            out = decode_attention_qkv(*args, *w, 1e-6, kc, vc, *meta, scale, hq, hkv, d)
        else:
            q = qk_rope_store(*args, *w, 1e-6, kc, vc, meta[0], hq, hkv, d)
            out = decode_attention(q, kc, vc, *meta[1:], scale)
        return out.cpu(), kc.cpu(), vc.cpu()

    want, got = run(False), run(True)
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)  # the rotated new keys
    torch.testing.assert_close(got[2], want[2], atol=0, rtol=0)  # values, as they were
    changed = (got[1] != k_cache).any(-1).any(-1)
    assert changed.nonzero().flatten().tolist() == sorted(out_loc.tolist())
    if decode_num_splits(bs, hkv) > 1:
        assert not any(c.any() for c in fused_decode._counters.values()), "zero again"
    if DEV.type == "cuda":  # the model dtype, as a GPU runs it
        want, got = run(False, torch.bfloat16), run(True, torch.bfloat16)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU test: the GPU has tests/test_gpu.py")
def test_llm_decodes_the_same_tokens_through_the_one_kernel(monkeypatch) -> None:
    """Through the whole model: Qwen3 (head norms) on the Triton backend with the kernel
    forced on for CPU tensors, emulated decode graphs included, against the reference
    backend's tokens."""
    from minisgl.layers import kernel_plan

    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].size(0))
        return decode_attention_qkv(*args, **kwargs)

    monkeypatch.setattr(kernel_plan, "rope_store_kernel", lambda fused: qk_rope_store)
    monkeypatch.setattr(fused_decode, "decode_attention_qkv", counted)
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", True)
    prompts = [[5, 17, 300, 41, 8, 99, 23], [9] * 20]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    out = {}
    for attn, graphs in (("torch", 0), ("triton", 2)):
        llm = LLM(str(need(TINY["qwen3"])), device="cpu", attention_backend=attn,
                  max_running_req=2, cuda_graph_max_bs=graphs, num_page_override=128,
                  max_seq_len_override=48)  # fmt: skip
        out[attn] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    assert out["triton"] == out["torch"]
    assert calls and set(calls) <= {1, 2}, "decode steps, padded to the graphs' sizes"
