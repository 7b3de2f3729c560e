"""Chapter 2: the building blocks of a Llama layer, each checked against transformers' own.

Run from the repo root: python examples/ch02_layers.py
"""

import torch
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama as hf

from minisgl.layers.activation import silu_and_mul
from minisgl.layers.embedding import LMHead, VocabEmbedding
from minisgl.layers.linear import Linear
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import get_rope
from minisgl.models.config import ModelConfig

torch.manual_seed(0)
c = ModelConfig.from_path("models/SmolLM2-135M-Instruct")  # real shapes, random weights
H, T = c.hidden_size, 7  # hidden size, tokens
hf_config = LlamaConfig(
    hidden_size=H,
    intermediate_size=c.intermediate_size,
    num_attention_heads=c.num_heads,
    num_key_value_heads=c.num_kv_heads,
    head_dim=c.head_dim,
    rms_norm_eps=c.rms_norm_eps,
    max_position_embeddings=c.max_position_embeddings,
    vocab_size=c.vocab_size,
    rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
)
results = {}

# RMSNorm
ours = RMSNorm(H, c.rms_norm_eps)
ref = hf.LlamaRMSNorm(H, eps=c.rms_norm_eps)
torch.nn.init.normal_(ours.weight)
ref.weight.data.copy_(ours.weight)
x = torch.randn(T, H)
results["RMSNorm"] = (ours(x) - ref(x)).abs().max().item()

# Rotary embedding: positions need not be 0..T-1 (a decode step sits far into the sequence).
positions = torch.tensor([0, 1, 2, 3, 100, 101, 4000])
rope = get_rope(c.head_dim, c.rope_theta, c.max_position_embeddings, torch.device("cpu"))
assert rope is get_rope(c.head_dim, c.rope_theta, c.max_position_embeddings, torch.device("cpu"))
q, k = torch.randn(T, c.num_heads, c.head_dim), torch.randn(T, c.num_kv_heads, c.head_dim)
q1, k1 = rope(positions, q, k)
cos, sin = hf.LlamaRotaryEmbedding(hf_config)(x[None], positions[None])  # [1, T, head_dim]
q2, k2 = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
results["rotary q"] = (q1 - q2[0].transpose(0, 1)).abs().max().item()
results["rotary k"] = (k1 - k2[0].transpose(0, 1)).abs().max().item()

# The gated MLP: our gate and up projections are one merged Linear.
mlp = hf.LlamaMLP(hf_config)
gate_up = Linear(H, 2 * c.intermediate_size)
down = Linear(c.intermediate_size, H)
gate_up.weight.data.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
down.weight.data.copy_(mlp.down_proj.weight)
results["gated MLP"] = (down(silu_and_mul(gate_up(x))) - mlp(x)).abs().max().item()

# Embedding in, LM head out (tied weights, as SmolLM2 has them).
embed = VocabEmbedding(c.vocab_size, H)
torch.nn.init.normal_(embed.weight, std=0.02)
head = LMHead(c.vocab_size, H)
head.weight = embed.weight
ids = torch.tensor([1, 42, 9000, 49151])
ref_embed = torch.nn.Embedding.from_pretrained(embed.weight.detach())
results["embedding"] = (embed(ids) - ref_embed(ids)).abs().max().item()
logits = head.project(x)
results["LM head"] = (logits - x @ embed.weight.T).abs().max().item()
print(f"LM head: hidden {tuple(x.shape)} -> logits {tuple(logits.shape)} {logits.dtype}")

for name, diff in results.items():
    print(f"{name:<10} max |ours - transformers| = {diff:.2e}")
bad = [name for name, diff in results.items() if diff > 1e-4]
if bad:
    raise SystemExit(f"differs from transformers: {bad}")
print("all layers match")
