"""The Llama decoder, which Qwen2, Qwen3, Qwen3-MoE and Mistral reuse with small changes.

A decoder layer is: x += attn(norm(x)); x += mlp(norm(x)). The variants differ only in
a bias on q/k/v (Qwen2), a norm on each q/k head (Qwen3), and the MLP (MoE); those are
the class attributes and the `make_mlp` hook below.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.core import get_global_ctx
from minisgl.distributed import Split, rank_heads  # [ch21]
from minisgl.layers.attention import AttentionLayer
from minisgl.layers.embedding import LMHead, VocabEmbedding
from minisgl.layers.linear import GatedLinear, Linear
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import get_rope
from minisgl.models.base import BaseLLMModel
from minisgl.models.config import ModelConfig
from minisgl.models.families import layer_rope  # [ch29]


class LlamaMLP(nn.Module):
    gate_up: type[Linear] = GatedLinear  # gate_up and silu(gate) * up, in one projection

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = self.gate_up(
            hidden_size,
            2 * intermediate_size,
            split=Split.even(0, intermediate_size, intermediate_size),  # [ch21]
        )
        self.down_proj = Linear(
            intermediate_size,
            hidden_size,
            split=Split.even(1, intermediate_size),  # [ch21]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        c = config
        qkv_size = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        self.qkv_proj = Linear(
            c.hidden_size,
            qkv_size,
            bias=qkv_bias,
            split=Split.qkv(c.num_heads, c.num_kv_heads, c.head_dim),  # [ch21]
        )
        rope = get_rope(
            c.head_dim,
            c.rope_theta,
            c.max_position_embeddings,
            _device(),
            layer_rope(c, layer_id),  # its variant, or a sliding layer's own  # [ch29]
        )
        eps = c.rms_norm_eps if qk_norm else None
        heads, kv_heads = c.num_heads, c.num_kv_heads
        heads, kv_heads = rank_heads(heads, kv_heads)  # this rank's share of them  # [ch21]
        self.attn = AttentionLayer(layer_id, heads, kv_heads, c.head_dim, rope, eps)
        self.o_proj = Linear(
            c.num_heads * c.head_dim,
            c.hidden_size,
            split=Split.even(1, c.num_heads * c.head_dim),  # [ch21]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attn(self.qkv_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, self_attn: nn.Module, mlp: nn.Module, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.input_layernorm.into_gemv = True  # it feeds qkv  # [ch20]
        self.post_attention_layernorm.into_gemv = isinstance(mlp, LlamaMLP)  # [ch20]

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it is added): the add of the
        output is left to the next norm, where a fused kernel does both at once."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.forward_add(x, residual)
        h, residual = self.post_attention_layernorm.forward_add(self.self_attn(h), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, layers: list[LlamaDecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual)
        return self.norm.forward_add(x, residual)[0]


class LlamaForCausalLM(BaseLLMModel):
    qkv_bias = False
    qk_norm = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        layers = [
            LlamaDecoderLayer(
                LlamaAttention(config, i, self.qkv_bias or config.attention_bias, self.qk_norm),
                self.make_mlp(config, i),
                config,
            )
            for i in range(config.num_layers)
        ]
        self.model = LlamaModel(config, layers)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_mlp(self, config: ModelConfig, layer_id: int) -> nn.Module:
        return LlamaMLP(config.hidden_size, config.intermediate_size)

    def forward(self) -> torch.Tensor:
        return self.lm_head(self.model(get_global_ctx().batch.input_ids))


def _device() -> torch.device:
    # Models are built under `with torch.device(...)`; the rotary table must live there too.
    return torch.empty(0).device
