"""The fused q/k-norm + rotary + KV-store kernel equals the layers it replaces.

On CPU it runs in Triton's interpreter (tests/conftest.py turns it on without a GPU).
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import TINY, need

from minisgl.core import SamplingParams
from minisgl.kernels.rope_store import qk_rope_store
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rope_scaling import RopeScaling  # [ch29]
from minisgl.layers.rotary import RotaryEmbedding
from minisgl.llm import LLM

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or Triton's interpreter",
)
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def unfused(qkv, positions, rope, q_norm, k_norm, k_cache, v_cache, out_loc, hq, hkv, d):
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.reshape(-1, hq, d), k.reshape(-1, hkv, d), v.reshape(-1, hkv, d)
    if q_norm is not None:
        q, k = q_norm.reference(q), k_norm.reference(k)
    q, k = rope.reference(positions, q, k)
    k_cache[out_loc], v_cache[out_loc] = k, v
    return q


CASES = [  # (q heads, kv heads, head_dim, qk norm, rotated channels)
    (4, 2, 16, True, 16),
    (6, 2, 24, False, 24),  # half a head not a power of two
    (8, 8, 64, True, 64),
    (4, 2, 32, True, 24),  # partial rotary (Phi-4-mini turns 3/4 of a head)  # [ch29]
    (6, 2, 40, False, 16),  # [ch29]
]


def rotary(d: int, rot: int) -> RotaryEmbedding:
    if rot == d:
        return RotaryEmbedding(d, 10000.0, 512, DEV)
    # a scaled variant too: the attention factor scales cos and sin  # [ch29]
    yarn = RopeScaling("yarn", 10000.0, rot, 512, factor=4.0, original_max_position=128)  # [ch29]
    return RotaryEmbedding(d, 10000.0, 512, DEV, yarn.for_context(512))  # [ch29]


@pytest.mark.parametrize(("hq", "hkv", "d", "norm", "rot"), CASES)
def test_kernel_equals_the_layers_it_replaces(
    hq: int, hkv: int, d: int, norm: bool, rot: int
) -> None:
    gen = torch.Generator().manual_seed(hq * d)
    dtypes = [torch.float32] + ([torch.bfloat16] if DEV.type == "cuda" else [])
    for dtype in dtypes:
        tokens, slots = 7, 40
        qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(DEV, dtype)
        positions = torch.randint(0, 500, (tokens,), generator=gen).to(DEV, torch.int32)
        out_loc = torch.randperm(slots, generator=gen)[:tokens].to(DEV, torch.int32)
        rope = rotary(d, rot)
        q_norm = k_norm = None
        if norm:
            q_norm, k_norm = RMSNorm(d, 1e-6).to(DEV, dtype), RMSNorm(d, 1e-6).to(DEV, dtype)
            with torch.no_grad():
                q_norm.weight.copy_(torch.rand(d, generator=gen) + 0.5)
                k_norm.weight.copy_(torch.rand(d, generator=gen) + 0.5)
        caches = [torch.zeros(slots, hkv, d, dtype=dtype, device=DEV) for _ in range(4)]
        with torch.no_grad():
            want = unfused(qkv, positions.long(), rope, q_norm, k_norm, *caches[:2],
                           out_loc.long(), hq, hkv, d)  # fmt: skip
            got = qk_rope_store(
                qkv, positions, rope.cos_sin,
                q_norm.weight if norm else None, k_norm.weight if norm else None, 1e-6,
                caches[2], caches[3], out_loc, hq, hkv, d,
            )  # fmt: skip
        tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.02, atol=0.02)
        torch.testing.assert_close(got, want, **tol)
        torch.testing.assert_close(caches[2], caches[0], **tol)  # keys, rotated, in their slots
        torch.testing.assert_close(caches[3], caches[1], rtol=0, atol=0)  # values as they were
        untouched = torch.ones(slots, dtype=torch.bool)
        untouched[out_loc.cpu().long()] = False
        assert (caches[2][untouched.to(DEV)] == 0).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU test: the GPU has tests/test_gpu.py")
def test_llm_with_the_fused_kernel_gives_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the whole model: Qwen3 (head norms) with the kernel forced on for CPU tensors."""
    import minisgl.layers.triton_ops as triton_ops

    prompts = [[5, 17, 300, 41, 8, 99, 23], [7, 7, 120]]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    out = []
    for fused in (False, True):
        if fused:
            monkeypatch.setattr(triton_ops, "rope_store_kernel", lambda x: qk_rope_store)
        llm = LLM(str(need(TINY["qwen3"])), device="cpu", max_running_req=2, cuda_graph_max_bs=0,
                  num_page_override=64, max_seq_len_override=32)  # fmt: skip
        out.append([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.shutdown()
    assert out[0] == out[1]
