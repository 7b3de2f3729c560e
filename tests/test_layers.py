"""Chapter 2: each layer against the Hugging Face (or plain torch) module it stands in for."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minisgl.layers.activation import silu_and_mul
from minisgl.layers.embedding import LMHead, VocabEmbedding
from minisgl.layers.linear import Linear
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import get_rope

CPU = torch.device("cpu")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_rmsnorm_matches_llama_rmsnorm(dtype: torch.dtype, eps: float) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = _gen(0)
    x = (torch.randn(7, 3, 96, generator=g) * 5).to(dtype)
    weight = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    ours, ref = RMSNorm(96, eps).to(dtype), LlamaRMSNorm(96, eps=eps).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        ref.weight.copy_(weight)
        out, expected = ours(x), ref(x)
    assert out.dtype == expected.dtype == dtype
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def _hf_rope(head_dim: int, theta: float, max_pos: int, q, k, positions):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    config = LlamaConfig(
        hidden_size=head_dim * q.size(1),
        num_attention_heads=q.size(1),
        head_dim=head_dim,
        num_key_value_heads=k.size(1),
        max_position_embeddings=max_pos,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
    )
    rope = LlamaRotaryEmbedding(config)
    # HF layout: [batch, heads, seq, head_dim]; one batch row holding our tokens in order.
    cos, sin = rope(q, positions[None, :].long())
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return q_hf[0].transpose(0, 1), k_hf[0].transpose(0, 1)


@pytest.mark.parametrize(
    "head_dim,theta", [(16, 10000.0), (32, 1e6), (64, 100000.0)], ids=["16", "32", "64"]
)
@pytest.mark.parametrize(
    "positions", [[0, 5, 1000], [2047, 3, 3, 0, 17, 512]], ids=["sparse", "unordered"]
)
def test_rope_matches_transformers(head_dim: int, theta: float, positions: list[int]) -> None:
    g = _gen(1)
    pos = torch.tensor(positions, dtype=torch.int32)
    q = torch.randn(len(positions), 4, head_dim, generator=g)
    k = torch.randn(len(positions), 2, head_dim, generator=g)
    rope = get_rope(head_dim, theta, 2048, CPU)
    q_out, k_out = rope(pos, q, k)
    q_ref, k_ref = _hf_rope(head_dim, theta, 2048, q, k, pos)
    torch.testing.assert_close(q_out, q_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_out, k_ref, rtol=1e-6, atol=1e-6)


def test_rope_bf16_matches_transformers() -> None:
    g = _gen(2)
    pos = torch.tensor([0, 5, 1000, 4000], dtype=torch.int32)
    q = torch.randn(4, 9, 64, generator=g).bfloat16()
    k = torch.randn(4, 3, 64, generator=g).bfloat16()
    q_out, k_out = get_rope(64, 100000.0, 8192, CPU)(pos, q, k)
    q_ref, k_ref = _hf_rope(64, 100000.0, 8192, q, k, pos)
    assert q_out.dtype == k_out.dtype == torch.bfloat16
    torch.testing.assert_close(q_out, q_ref)
    torch.testing.assert_close(k_out, k_ref)


def test_rope_is_per_position() -> None:
    # Each token is rotated by its own position only: a batch equals the tokens one by one.
    g = _gen(3)
    rope = get_rope(32, 10000.0, 2048, CPU)
    pos = torch.tensor([9, 0, 1000, 9], dtype=torch.int32)
    q, k = torch.randn(4, 4, 32, generator=g), torch.randn(4, 2, 32, generator=g)
    q_all, k_all = rope(pos, q, k)
    for i in range(4):
        q_one, k_one = rope(pos[i : i + 1], q[i : i + 1], k[i : i + 1])
        torch.testing.assert_close(q_all[i : i + 1], q_one, rtol=0, atol=0)
        torch.testing.assert_close(k_all[i : i + 1], k_one, rtol=0, atol=0)
    # position 0 is the identity; rotation keeps each pair's norm
    torch.testing.assert_close(q_all[1], q[1], rtol=0, atol=0)
    torch.testing.assert_close(q_all.norm(dim=-1), q.norm(dim=-1))


def test_get_rope_is_shared() -> None:
    assert get_rope(16, 10000.0, 64, CPU) is get_rope(16, 10000.0, 64, CPU)
    assert get_rope(16, 10000.0, 64, CPU) is not get_rope(16, 500.0, 64, CPU)


def test_silu_and_mul_in_llama_mlp() -> None:
    # Our MLP = down(silu_and_mul(gate_up(x))) with gate_up = cat(gate, up) must equal HF's.
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(4)
    ref = LlamaMLP(LlamaConfig(hidden_size=48, intermediate_size=80, num_attention_heads=4)).eval()
    gate_up, down = Linear(48, 160), Linear(80, 48)
    with torch.no_grad():
        gate_up.weight.copy_(torch.cat([ref.gate_proj.weight, ref.up_proj.weight]))
        down.weight.copy_(ref.down_proj.weight)
        x = torch.randn(5, 48)
        out = down(silu_and_mul(gate_up(x)))
        expected = ref(x)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_silu_and_mul_shape_and_halves() -> None:
    g = _gen(5)
    gate, up = torch.randn(3, 2, 10, generator=g), torch.randn(3, 2, 10, generator=g)
    out = silu_and_mul(torch.cat([gate, up], dim=-1))
    assert out.shape == (3, 2, 10)
    torch.testing.assert_close(out, nn.SiLU()(gate) * up, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_nn_linear(bias: bool) -> None:
    torch.manual_seed(6)
    ref = nn.Linear(24, 40, bias=bias)
    ours = Linear(24, 40, bias=bias)
    assert (ours.bias is not None) == bias
    assert dict(ours.named_parameters()).keys() == dict(ref.named_parameters()).keys()
    with torch.no_grad():
        ours.weight.copy_(ref.weight)
        if bias:
            ours.bias.copy_(ref.bias)
        x = torch.randn(3, 5, 24)
        torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)


def test_linear_bias_matches_qwen2_projection() -> None:
    # Qwen2's q/k/v projections carry a bias; merged into one Linear they give the same rows.
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

    torch.manual_seed(7)
    cfg = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    attn = Qwen2Attention(cfg, layer_idx=0)
    with torch.no_grad():
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.bias.normal_()
        qkv = Linear(64, 64 + 2 * 32, bias=True)
        qkv.weight.copy_(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        qkv.bias.copy_(torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
        x = torch.randn(6, 64)
        q, k, v = qkv(x).split([64, 32, 32], dim=-1)
        torch.testing.assert_close(q, attn.q_proj(x), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(k, attn.k_proj(x), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(v, attn.v_proj(x), rtol=1e-6, atol=1e-6)


def test_vocab_embedding_matches_nn_embedding() -> None:
    torch.manual_seed(8)
    ref = nn.Embedding(100, 16)
    ours = VocabEmbedding(100, 16)
    with torch.no_grad():
        ours.weight.copy_(ref.weight)
    ids = torch.tensor([0, 99, 5, 5, 42], dtype=torch.int32)
    torch.testing.assert_close(ours(ids), ref(ids.long()), rtol=0, atol=0)
    assert ours(ids.view(1, 5)).shape == (1, 5, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_project_is_fp32(dtype: torch.dtype) -> None:
    torch.manual_seed(9)
    ref = nn.Linear(32, 300, bias=False).to(dtype)
    head = LMHead(300, 32).to(dtype)
    with torch.no_grad():
        head.weight.copy_(ref.weight)
        hidden = torch.randn(4, 32).to(dtype)
        logits = head.project(hidden)
        expected = ref(hidden).float()
    assert logits.dtype == torch.float32
    assert logits.shape == (4, 300)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


def test_lm_head_tied_to_embedding() -> None:
    # Tying is sharing the Parameter: an update to the embedding shows in the logits.
    emb, head = VocabEmbedding(50, 8), LMHead(50, 8)
    head.weight = emb.weight
    with torch.no_grad():
        emb.weight.copy_(torch.randn(50, 8, generator=_gen(10)))
        hidden = emb(torch.tensor([3]))
        logits = head.project(hidden)
    torch.testing.assert_close(logits, F.linear(hidden, emb.weight))
    assert head.weight.data_ptr() == emb.weight.data_ptr()
