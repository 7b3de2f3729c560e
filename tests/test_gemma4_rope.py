"""Gemma 4's head norms and rotary in one kernel (kernels/gemma4_rope.py) against the layer's
torch code (models/gemma4.py `prepare`: Gemma's norm, then layers/rotary.py's reference),
for a plain RoPE table and a proportional one (the global layers': a share of the pairs turn,
the rest have zero angles), in the model dtypes."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import DEV, DTYPES, assert_ulps

from minisgl.kernels.gemma4_rope import norm_rope
from minisgl.layers.rope_scaling import RopeScaling
from minisgl.layers.rotary import RotaryEmbedding, _rotate_half
from minisgl.models.gemma4 import Gemma4RMSNorm, UnscaledRMSNorm

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or Triton's interpreter",
)


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)


def _norm(dim: int, seed: int) -> Gemma4RMSNorm:
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
    norm = _norm(dim, seed=2)
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


def test_bad_input_is_refused_with_a_reason() -> None:
    w = torch.ones(8, device=DEV)
    with pytest.raises(ValueError, match="tokens, heads, head_dim"):
        norm_rope(torch.ones(2, 8, device=DEV), w, 1e-6)
    table = torch.ones(4, 6, device=DEV)
    with pytest.raises(ValueError, match="as wide as the head"):
        norm_rope(torch.ones(2, 1, 8, device=DEV), w, 1e-6, table, torch.zeros(2, device=DEV))
