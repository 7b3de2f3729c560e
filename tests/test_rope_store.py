"""The fused q/k-norm + rotary + KV-store kernel equals the layers it replaces.

On CPU it runs in Triton's interpreter (tests/conftest.py turns it on without a GPU).
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import TINY, need

from minisgl.core import SamplingParams
from minisgl.kernels import rope_store
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


def inputs(hq: int, hkv: int, d: int, norm: bool, tokens: int, dtype, gen) -> tuple:
    """(qkv, positions, out_loc, q_norm, k_norm, slots): tokens scattered over a pool of more
    slots, as any page layout puts them."""
    slots = tokens + 40
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(DEV, dtype)
    positions = torch.randint(0, 500, (tokens,), generator=gen).to(DEV, torch.int32)
    out_loc = torch.randperm(slots, generator=gen)[:tokens].to(DEV, torch.int32)
    q_norm = k_norm = None
    if norm:
        q_norm, k_norm = RMSNorm(d, 1e-6).to(DEV, dtype), RMSNorm(d, 1e-6).to(DEV, dtype)
        with torch.no_grad():
            q_norm.weight.copy_(torch.rand(d, generator=gen) + 0.5)
            k_norm.weight.copy_(torch.rand(d, generator=gen) + 0.5)
    return qkv, positions, out_loc, q_norm, k_norm, slots


def fused(qkv, positions, rope, q_norm, k_norm, k_cache, v_cache, out_loc, hq, hkv, d):
    weights = (q_norm.weight, k_norm.weight) if q_norm is not None else (None, None)
    with torch.no_grad():
        return qk_rope_store(qkv, positions, rope.cos_sin, *weights, 1e-6, k_cache, v_cache,
                             out_loc, hq, hkv, d)  # fmt: skip


def check(hq: int, hkv: int, d: int, norm: bool, rot: int, tokens: int, dtype, gen) -> None:
    qkv, positions, out_loc, q_norm, k_norm, slots = inputs(hq, hkv, d, norm, tokens, dtype, gen)
    rope = rotary(d, rot)
    caches = [torch.zeros(slots, hkv, d, dtype=dtype, device=DEV) for _ in range(4)]
    with torch.no_grad():
        want = unfused(qkv, positions.long(), rope, q_norm, k_norm, *caches[:2],
                       out_loc.long(), hq, hkv, d)  # fmt: skip
    got = fused(qkv, positions, rope, q_norm, k_norm, *caches[2:], out_loc, hq, hkv, d)
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.02, atol=0.02)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(caches[2], caches[0], **tol)  # keys, rotated, in their slots
    torch.testing.assert_close(caches[3], caches[1], rtol=0, atol=0)  # values as they were
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[out_loc.cpu().long()] = False
    assert (caches[2][untouched.to(DEV)] == 0).all()
    assert (caches[3][untouched.to(DEV)] == 0).all()


# One token a program up to 63 tokens, then tiles of 8: 130 ends in a partial one.
TOKENS = [1, 3, 17, 64, 130]


@pytest.mark.parametrize(("hq", "hkv", "d", "norm", "rot"), CASES)
def test_kernel_equals_the_layers_it_replaces(
    hq: int, hkv: int, d: int, norm: bool, rot: int
) -> None:
    gen = torch.Generator().manual_seed(hq * d)
    dtypes = [torch.float32] + ([torch.bfloat16] if DEV.type == "cuda" else [])
    for dtype in dtypes:
        for tokens in TOKENS:
            check(hq, hkv, d, norm, rot, tokens, dtype, gen)


@pytest.mark.parametrize("block_t", [8, 32])
def test_each_tile_with_a_partial_last_tile(block_t: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's tiles of several tokens (one token a program is tested above), forced
    on 37 tokens (the last tile not full) and on 3 (fewer than one tile), for every case."""
    monkeypatch.setattr(rope_store, "tile_tokens", lambda tokens: block_t)
    gen = torch.Generator().manual_seed(block_t)
    for case in CASES:
        for tokens in (37, 3):
            check(*case, tokens, torch.float32, gen)


# >>> ch28 an FP8 cache
@pytest.mark.parametrize("block_t", [1, 32])
def test_an_fp8_cache_holds_the_keys_and_values_as_torch_casts_them(
    block_t: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same kernel into an fp32 and an e4m3 cache, head norms on: what the e4m3 cache
    holds is the fp32 cache saturated at 448 and cast, bit for bit, in every tile."""
    monkeypatch.setattr(rope_store, "tile_tokens", lambda tokens: block_t)
    gen = torch.Generator().manual_seed(8)
    hq, hkv, d, tokens = 4, 2, 16, 37
    qkv, positions, out_loc, q_norm, k_norm, slots = inputs(
        hq, hkv, d, True, tokens, torch.float32, gen
    )
    qkv *= 300  # the values (not normed) beyond e4m3's 448
    rope = rotary(d, d)
    wide = [torch.zeros(slots, hkv, d, device=DEV) for _ in range(2)]
    fp8 = [torch.zeros(slots, hkv, d, dtype=torch.float8_e4m3fn, device=DEV) for _ in range(2)]
    for caches in (wide, fp8):
        fused(qkv, positions, rope, q_norm, k_norm, *caches, out_loc, hq, hkv, d)
    assert wide[1].abs().max() > 448
    for got, want in zip(fp8, wide, strict=True):
        want = want.clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


# <<< ch28


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU test: the GPU has tests/test_gpu.py")
def test_llm_with_the_fused_kernel_gives_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the whole model: Qwen3 (head norms) with the kernel forced on for CPU tensors."""
    from minisgl.layers import kernel_plan

    prompts = [[5, 17, 300, 41, 8, 99, 23], [7, 7, 120]]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    out = []
    for fused in (False, True):
        if fused:
            monkeypatch.setattr(kernel_plan, "rope_store_kernel", lambda fused: qk_rope_store)
        llm = LLM(str(need(TINY["qwen3"])), device="cpu", max_running_req=2, cuda_graph_max_bs=0,
                  num_page_override=64, max_seq_len_override=32)  # fmt: skip
        out.append([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.shutdown()
    assert out[0] == out[1]
