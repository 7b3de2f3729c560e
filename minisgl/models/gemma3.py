"""Gemma 3 (text): a Llama-shaped decoder with Gemma's own norms, MLP and scalings.

What differs from Llama (models/llama.py), each a few lines here:
- the RMSNorm scales by (1 + w), computed in fp32 before rounding, and a layer has four of
  them: before and after attention, before and after the MLP (the output of each block is
  normalised before it joins the residual stream);
- q and k heads are normalised (as in Qwen3), with that norm;
- the MLP's gate is GELU (tanh approximation) instead of SiLU;
- embeddings are multiplied by sqrt(hidden_size), rounded to the model's dtype;
- attention scores are scaled by query_pre_attn_scalar^-1/2 (the engine's softmax scale);
- five sliding layers to one global, each kind with its own RoPE base
  (`families.layer_rope`, the backends' windows);
- the logits may be soft-capped: cap * tanh(logits / cap).

`Gemma3ForConditionalGeneration` checkpoints hold the same text model next to a vision
tower; `models/families.py` reads their text config and renames their tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MethodType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.core import get_global_ctx
from minisgl.layers.embedding import LMHead, VocabEmbedding
from minisgl.layers.linear import Linear
from minisgl.models.base import BaseLLMModel
from minisgl.models.config import ModelConfig
from minisgl.models.llama import LlamaAttention, LlamaMLP

if TYPE_CHECKING:
    from minisgl.layers.kernel_plan import KernelPlan


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w). The weight is kept in fp32 and holds 1 + w once loaded, so the
    fused rotary kernel, which reads a norm's weight, multiplies by the right factor."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=torch.float32))
        self.eps = eps

    def after_load(self) -> None:
        with torch.no_grad():
            self.weight.add_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight).to(x.dtype)  # rounded after the scaling, as Gemma does

    def forward_add(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual). May overwrite both inputs."""
        residual = x + residual
        return self(residual), residual

    def install_kernels(self, plan: KernelPlan) -> None:
        """What the kernel plan (layers/kernel_plan.py) runs for this norm: one fused
        Triton kernel where fused kernels run (bf16/fp16 on CUDA), this torch code elsewhere."""
        if plan.fused and (kernels := _gemma_norm_kernels()) is not None:
            norm, add_norm = kernels

            def fused(x: torch.Tensor) -> torch.Tensor:
                return norm(x, self.weight, self.eps)

            def fused_add(x: torch.Tensor, residual: torch.Tensor):
                return add_norm(x, residual, self.weight, self.eps)

            self.forward, self.forward_add = fused, fused_add
        else:
            self.forward = MethodType(type(self).forward, self)
            self.forward_add = MethodType(type(self).forward_add, self)


def _gemma_norm_kernels():
    try:  # triton may be missing
        from minisgl.kernels.gemma_norm import gemma_fused_add_rmsnorm, gemma_rmsnorm
    except ImportError:
        return None
    return gemma_rmsnorm, gemma_fused_add_rmsnorm


def gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GELU (tanh approximation) of gate, times up: Gemma's gate, in torch."""
    return F.gelu(gate, approximate="tanh") * up


def gelu_mul_kernel() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`gelu_mul` in one Triton kernel (kernels/gemma_norm.py), or in torch without triton."""
    try:
        from minisgl.kernels.gemma_norm import gelu_and_mul
    except ImportError:
        return gelu_mul
    return gelu_and_mul


class Gemma3MLP(LlamaMLP):
    gate_up = Linear  # GeLU-tanh after it, not SiLU: a plain projection
    act = staticmethod(gelu_mul)  # the kernel plan's choice once installed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate, up))

    def install_kernels(self, plan: KernelPlan) -> None:
        """One kernel for the gate where fused kernels run; torch's two elsewhere."""
        self.act = gelu_mul_kernel() if plan.fused else gelu_mul


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        c = config
        self.self_attn = LlamaAttention(c, layer_id, c.attention_bias, qk_norm=True)
        self.self_attn.attn.q_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps)
        self.self_attn.attn.k_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps)
        self.mlp = Gemma3MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it is added), as Llama's."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.forward_add(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h))
        h, residual = self.pre_feedforward_layernorm.forward_add(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x, residual = x * torch.tensor(self.embed_scale, dtype=x.dtype), None
        for layer in self.layers:
            x, residual = layer(x, residual)
        return self.norm.forward_add(x, residual)[0]


class SoftCappedLMHead(LMHead):
    def __init__(self, vocab_size: int, hidden_size: int, cap: float | None) -> None:
        super().__init__(vocab_size, hidden_size)
        self.cap = cap

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().project(hidden)
        return logits if self.cap is None else torch.tanh(logits / self.cap) * self.cap


class Gemma3ForCausalLM(BaseLLMModel):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.model = Gemma3Model(config)
        cap = config.final_logit_softcapping
        self.lm_head = SoftCappedLMHead(config.vocab_size, config.hidden_size, cap)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self) -> torch.Tensor:
        return self.lm_head(self.model(get_global_ctx().batch.input_ids))


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text model of a multimodal Gemma 3 checkpoint; its vision tower is not loaded."""
