"""Gemma's RMSNorm in one kernel (kernels/gemma_norm.py) equals the layers' torch code, and
the kernel plan gives it to Gemma 3, Gemma 4 and Qwen3.5's norms where fused kernels run; so do
Gemma 4's block ends, the GELU gate, and its head norms with the rotary (kernels/gemma4_rope.py:
against the layer's torch code, Gemma's norm then layers/rotary.py's reference, for a plain
RoPE table and a proportional one, whose pairs past a share have zero angles).

Gemma's norm scales by a float32 weight before it rounds (Llama's rounds, then scales), so
its bf16 and fp16 results differ from chapter 20's kernel's in the last place: these tests
hold the kernel to Gemma's rounding (chapter 20's tolerance, helpers.assert_ulps: one unit in
fp16, three in bf16 where the interpreter truncates its casts).
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import DEV, DTYPES, assert_ulps, ours_only

from minisgl.kernels.gemma4_rope import norm_rope
from minisgl.kernels.gemma_norm import (
    gelu_and_mul,
    gemma_fused_add_rmsnorm,
    gemma_norm_add,
    gemma_rmsnorm,
)
from minisgl.layers import activation
from minisgl.layers.rope_scaling import RopeScaling
from minisgl.layers.rotary import RotaryEmbedding, _rotate_half
from minisgl.models.gemma3 import GemmaRMSNorm, gelu_mul
from minisgl.models.gemma4 import Gemma4RMSNorm, UnscaledRMSNorm

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or Triton's interpreter",
)


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)


def _gemma(n: int, seed: int) -> GemmaRMSNorm:
    norm = GemmaRMSNorm(n, 1e-6).to(DEV)
    norm.weight.data = _randn(n, dtype=torch.float32, seed=seed) * 0.5
    norm.after_load()  # holds 1 + w, as a loaded checkpoint's
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 64), (5, 96), (3, 1000)])
def test_norm_and_add_norm_equal_gemmas(rows: int, n: int, dtype: torch.dtype) -> None:
    norm = _gemma(n, seed=n)
    x, r = _randn(rows, n, dtype=dtype, seed=1), _randn(rows, n, dtype=dtype, seed=2)
    assert_ulps(gemma_rmsnorm(x, norm.weight, norm.eps), norm(x))
    want_y, want_r = GemmaRMSNorm.forward_add(norm, x.clone(), r.clone())
    xs, rs = x.clone(), r.clone()
    got_y, got_r = gemma_fused_add_rmsnorm(xs, rs, norm.weight, norm.eps)
    assert got_y is xs and got_r is rs  # in place
    assert_ulps(got_r, want_r)
    assert_ulps(got_y, want_y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_heads_read_where_they_lie_and_the_unscaled_norm(dtype: torch.dtype) -> None:
    """Gemma 4's q/k norms over [tokens, heads, head_dim] views of a wider qkv, and its
    value norm, whose weight is ones it never loads."""
    qkv = _randn(4, 3 * 2 * 32, dtype=dtype, seed=3)
    k = qkv[:, 64:128].view(4, 2, 32)
    norm = _gemma(32, seed=4)
    assert_ulps(gemma_rmsnorm(k, norm.weight, norm.eps), norm(k))
    unscaled = UnscaledRMSNorm(32, 1e-6).to(DEV)
    assert "weight" not in unscaled.state_dict()  # nothing to load
    v = qkv[:, 128:].view(4, 2, 32)
    x32 = v.float()
    want = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert_ulps(unscaled(v), want)
    assert_ulps(gemma_rmsnorm(v, unscaled.weight, unscaled.eps), want)


def test_the_plan_installs_the_kernel_and_takes_it_back(monkeypatch) -> None:
    from minisgl.kernels import gemma_norm

    calls, real = [], gemma_norm.gemma_rmsnorm
    monkeypatch.setattr(gemma_norm, "gemma_rmsnorm", lambda *a: calls.append(1) or real(*a))
    norm = Gemma4RMSNorm(16, 1e-6).to(DEV)
    norm.weight.data = _randn(16, dtype=torch.float32, seed=5)
    x = _randn(2, 16, dtype=torch.float16, seed=6)
    want = norm(x)
    plan = ours_only(torch.float16)
    plan.install(norm)
    assert norm.forward.__name__ == "fused"
    assert_ulps(norm(x), want)
    assert calls == [1]
    plan.fused = False  # a CPU's plan: the torch code again
    plan.install(norm)
    assert norm.forward.__func__ is Gemma4RMSNorm.forward
    activation.use_silu_and_mul(activation.silu_and_mul_reference)  # as a CPU engine has it


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaled,then", [(False, True), (True, False), (False, False)])
def test_norm_add_equals_gemma4s_torch_steps(dtype: torch.dtype, scaled: bool, then: bool):
    """Gemma 4's block ends: x + norm(y), times the layer's scalar at the layer's end, and the
    next block's norm of the sum (after attention), each rounded as torch rounds them."""
    norm, nxt = _gemma(96, seed=7), _gemma(96, seed=8)
    y, x = _randn(5, 96, dtype=dtype, seed=9), _randn(5, 96, dtype=dtype, seed=10)
    scale = (_randn(1, dtype=torch.float32, seed=11) + 2.0).to(dtype) if scaled else None
    want = x + norm(y)
    if scale is not None:
        want = want * scale
    got, normed = gemma_norm_add(y, x, norm.weight, norm.eps, scale, nxt.weight if then else None)
    # a sum that cancels is many of its own last places off for one of its terms': the
    # bound is a few last places of the terms (the norm's reduction order differs)
    terms = (x.float().abs() + norm(y).float().abs()) * (scale.float().abs() if scaled else 1)
    assert got.dtype == want.dtype
    assert ((got.float() - want.float()).abs() <= 4 * torch.finfo(dtype).eps * terms).all()
    if then:
        assert normed is not None
        assert_ulps(normed, nxt(got))
    else:
        assert normed is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_and_mul_equals_torchs(dtype: torch.dtype) -> None:
    """The MLP's halves of one gate_up, and one layer's slice of [tokens, layers, dim]
    per-layer inputs (rows far apart), across more than one block of columns."""

    def close(g: torch.Tensor, u: torch.Tensor) -> bool:
        # torch forms 1 + tanh(z), which cancels where tanh is near -1 (large negative g):
        # its own error there is a few last places of 0.5 g; the kernel's form does not
        # cancel. The bound: a few last places of the product, or of 0.5 g u.
        want = gelu_mul(g, u).float()
        bound = 4 * torch.finfo(dtype).eps * (want.abs() + (0.5 * g.float() * u.float()).abs())
        return bool(((gelu_and_mul(g, u).float() - want).abs() <= bound).all())

    gate_up = _randn(3, 2 * 1300, dtype=dtype, seed=12) * 3
    assert close(*gate_up.chunk(2, dim=-1))
    per_layer = _randn(3, 4, 40, dtype=dtype, seed=13)[:, 2]
    assert close(_randn(3, 40, dtype=dtype, seed=14) * 3, per_layer)


def test_bad_input_is_refused_with_a_reason() -> None:
    w = torch.ones(8, device=DEV)
    with pytest.raises(ValueError, match="does not fit"):
        gemma_rmsnorm(torch.ones(2, 9, device=DEV), w, 1e-6)
    with pytest.raises(ValueError, match="one 2-D shape"):
        gemma_fused_add_rmsnorm(torch.ones(2, 8, device=DEV), torch.ones(3, 8, device=DEV), w, 1e-6)
    with pytest.raises(ValueError, match="one 2-D shape"):
        gemma_norm_add(torch.ones(2, 8, device=DEV), torch.ones(3, 8, device=DEV), w, 1e-6)
    with pytest.raises(ValueError, match="one 2-D shape"):
        gelu_and_mul(torch.ones(2, 8, device=DEV), torch.ones(2, 9, device=DEV))
    with pytest.raises(ValueError, match="one number"):
        gemma_norm_add(torch.ones(2, 8, device=DEV), torch.ones(2, 8, device=DEV), w, 1e-6, w)


def _gemma4(dim: int, seed: int) -> Gemma4RMSNorm:
    norm = Gemma4RMSNorm(dim, 1e-6).to(DEV)
    norm.weight.data = _randn(dim, dtype=torch.float32, seed=seed) * 0.5 + 1.0
    return norm


TABLES = {
    "plain": lambda dim: RotaryEmbedding(dim, 10000.0, 64, DEV),
    "proportional": lambda dim: RotaryEmbedding(
        dim, 1e6, 64, DEV, RopeScaling("proportional", 1e6, dim, 64, turned=0.25)
    ),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("table", sorted(TABLES))
def test_norm_rope_equals_the_layers_torch_code(dtype: torch.dtype, table: str) -> None:
    """Query heads read where they lie in a wider qkv, at scattered positions."""
    dim, heads = 32, 3
    rotary = TABLES[table](dim)
    assert rotary.cos_sin.size(-1) == dim  # every pair in the table (some with zero angles)
    qkv = _randn(5, (heads + 2) * dim, dtype=dtype, seed=1) * 2
    q = qkv[:, : heads * dim].view(5, heads, dim)
    positions = torch.tensor([0, 7, 3, 63, 20], device=DEV)
    norm = _gemma4(dim, seed=2)
    normed = norm(q)
    want, _ = rotary.reference(positions, normed, normed[:, :0])
    got = norm_rope(q, norm.weight, norm.eps, rotary.cos_sin, positions)
    assert got.shape == want.shape and got.dtype == want.dtype
    # a sum of two rounded products cancels: the bound is a few last places of its terms
    cos = rotary.cos[positions].to(dtype)[:, None, :].float()
    sin = rotary.sin[positions].to(dtype)[:, None, :].float()
    terms = (normed.float() * cos).abs() + (_rotate_half(normed).float() * sin).abs()
    assert ((got.float() - want.float()).abs() <= 4 * torch.finfo(dtype).eps * terms).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_value_norm_alone(dtype: torch.dtype) -> None:
    """No table: the heads normalised and not turned (the value norm's weight is ones)."""
    v = _randn(4, 2, 32, dtype=dtype, seed=3)
    unscaled = UnscaledRMSNorm(32, 1e-6).to(DEV)
    assert_ulps(norm_rope(v, unscaled.weight, unscaled.eps), unscaled(v))


def test_norm_rope_refuses_bad_input_with_a_reason() -> None:
    w = torch.ones(8, device=DEV)
    with pytest.raises(ValueError, match="tokens, heads, head_dim"):
        norm_rope(torch.ones(2, 8, device=DEV), w, 1e-6)
    table = torch.ones(4, 6, device=DEV)
    with pytest.raises(ValueError, match="as wide as the head"):
        norm_rope(torch.ones(2, 1, 8, device=DEV), w, 1e-6, table, torch.zeros(2, device=DEV))
