"""Qwen3.5 (dense, text): a hybrid of Gated DeltaNet layers and gated full attention.

Three of every four layers are linear attention (layers/gated_deltanet.py): a fixed-size
recurrent state per request in the state pool, no KV pages. The fourth attends, with three
changes from Qwen3's attention:
- q_proj is twice as wide: per head, the query and then an output gate; the attention's
  output is multiplied by sigmoid(gate) before o_proj;
- RoPE turns only the first quarter of each head's channels (partial_rotary_factor 0.25);
  the three mrope sections of the vision model all see the same position for text, so this
  is plain partial RoPE;
- the q/k norms, like every norm of the decoder (not the gated one), scale by (1 + w).
The MLP is Llama's; Qwen3.5-MoE's is a mixture of experts beside a shared expert
(`SharedExpertMoE`). Only the attention layers are in the KV pool: the k-th of them is the
pool's layer k (`families.attention_layers`).

Tensor parallelism cuts the attention by heads (each rank whole (query, gate) pairs), the
linear layers by their key and value heads (layers/gated_deltanet.py), the MLPs as Llama's.

What this model cannot run yet is refused by name: prefill graphs on the linear layers'
torch path (engine/hybrid.py), prefix caching needs state snapshots (the engine runs it
with the naive cache). Speculative decoding rolls the linear layers' state back to the
accepted drafts (kvcache/state_pool.py `keep_accepted`).
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.core import get_global_ctx
from minisgl.distributed import Split, rank_heads
from minisgl.layers.attention import AttentionLayer
from minisgl.layers.embedding import LMHead, VocabEmbedding
from minisgl.layers.gated_deltanet import GatedDeltaNet
from minisgl.layers.linear import Linear
from minisgl.layers.moe import MoEBlock
from minisgl.layers.rotary import get_rope
from minisgl.models.base import BaseLLMModel
from minisgl.models.config import ModelConfig, MoEConfig
from minisgl.models.families import LINEAR, layer_rope
from minisgl.models.gemma3 import GemmaRMSNorm
from minisgl.models.llama import LlamaMLP


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, kv_layer: int) -> None:
        super().__init__()
        c = config
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        # q_proj's rows are (query, gate) per head: cut as twice the heads, a rank keeps whole
        # pairs; the KV heads as Llama's (shared by neighbouring ranks when fewer than them).
        split = Split.qkv(2 * c.num_heads, c.num_kv_heads, c.head_dim)
        self.qkv_proj = Linear(
            c.hidden_size, 2 * q_size + 2 * kv_size, c.attention_bias, split=split
        )
        heads, kv_heads = rank_heads(c.num_heads, c.num_kv_heads)  # this rank's share
        self.q_size, self.kv_size = heads * c.head_dim, kv_heads * c.head_dim
        device = torch.empty(0).device  # where the model is being built
        rope = get_rope(
            c.head_dim, c.rope_theta, c.max_position_embeddings, device, layer_rope(c, layer_id)
        )
        self.attn = AttentionLayer(kv_layer, heads, kv_heads, c.head_dim, rope)
        self.attn.q_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps)
        self.attn.k_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps)
        self.o_proj = Linear(q_size, c.hidden_size, split=Split.even(1, q_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q_gate, kv = self.qkv_proj(x).split([2 * self.q_size, 2 * self.kv_size], dim=-1)
        q, gate = q_gate.view(x.size(0), -1, 2 * self.attn.head_dim).chunk(2, dim=-1)
        out = self.attn(torch.cat([q.reshape(-1, self.q_size), kv], dim=-1))
        return self.o_proj(out * torch.sigmoid(gate.reshape(-1, self.q_size)))


class SharedExpertMoE(MoEBlock):
    """The routed experts plus one MLP that every token passes through, its output scaled
    per token by sigmoid(shared_expert_gate(x)). Over several ranks the shared MLP is cut as
    any MLP is, and its gate (one output) is whole on every rank."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__(hidden_size, moe)
        self.shared_expert = LlamaMLP(hidden_size, moe.shared_size)
        self.shared_expert_gate = Linear(hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert(x) * torch.sigmoid(self.shared_expert_gate(x))
        return super().forward(x) + shared


def make_mlp(config: ModelConfig, layer_id: int) -> nn.Module:
    """Llama's MLP, or on a MoE model's sparse layers the experts (and a shared one)."""
    c = config
    if c.moe is None or not c.moe.is_moe_layer(layer_id):
        return LlamaMLP(c.hidden_size, c.intermediate_size)
    return (
        SharedExpertMoE(c.hidden_size, c.moe)
        if c.moe.shared_size
        else MoEBlock(c.hidden_size, c.moe)
    )


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_id: int, index: int, linear_cls: type[GatedDeltaNet]
    ) -> None:
        """`index`: the layer's place among its kind (linear layers or attention layers)."""
        super().__init__()
        c = config
        if c.layer_types[layer_id] == LINEAR:
            assert c.linear is not None, "linear_attention layers need the linear_* fields"
            self.linear_attn = linear_cls(c.hidden_size, c.linear, c.rms_norm_eps, index)
        else:
            self.self_attn = GatedAttention(c, layer_id, index)
        self.is_linear = c.layer_types[layer_id] == LINEAR
        self.mlp = make_mlp(c, layer_id)
        self.input_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it is added), as Llama's."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.forward_add(x, residual)
        h = self.linear_attn(h) if self.is_linear else self.self_attn(h)
        h, residual = self.post_attention_layernorm.forward_add(h, residual)
        return self.mlp(h), residual


class Qwen3_5Model(nn.Module):
    def __init__(self, config: ModelConfig, linear_cls: type[GatedDeltaNet]) -> None:
        super().__init__()
        c = config
        self.embed_tokens = VocabEmbedding(c.vocab_size, c.hidden_size)
        kinds = [t == LINEAR for t in c.layer_types]
        index = [kinds[:i].count(kinds[i]) for i in range(c.num_layers)]
        self.layers = nn.ModuleList(
            Qwen3_5DecoderLayer(c, i, index[i], linear_cls) for i in range(c.num_layers)
        )
        self.norm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual)
        return self.norm.forward_add(x, residual)[0]


class Qwen3_5ForCausalLM(BaseLLMModel):
    linear_attention = GatedDeltaNet  # Qwen3-Next's loads its projections fused

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.model = Qwen3_5Model(config, self.linear_attention)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self) -> torch.Tensor:
        return self.lm_head(self.model(get_global_ctx().batch.input_ids))


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The text model of a Qwen3.5 checkpoint; its vision tower and MTP head are not loaded."""


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE: every MLP is routed experts beside a gated shared expert."""


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForCausalLM):
    """The text model of a Qwen3.5-MoE checkpoint (experts stored fused, as we keep them)."""
