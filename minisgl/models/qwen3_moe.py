"""Qwen3-MoE: Qwen3 whose MLPs (all, or every `decoder_sparse_step`-th) are mixtures of experts."""

from __future__ import annotations

from torch import nn

from minisgl.layers.fused_moe import HAS_TRITON  # [ch22]
from minisgl.layers.moe import MoEBlock
from minisgl.models.config import ModelConfig
from minisgl.models.llama import LlamaMLP
from minisgl.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    cuda_graph_blocker = "the reference MoE layer counts tokens per expert on the host"  # [ch18]
    # >>> ch22 on CUDA with Triton the fused MoE runs, which groups tokens on the device
    if HAS_TRITON:
        cuda_graph_blocker = None
    # <<< ch22

    def make_mlp(self, config: ModelConfig, layer_id: int) -> nn.Module:
        if config.moe is None:
            raise ValueError("Qwen3MoeForCausalLM needs num_experts in config.json")
        if config.moe.is_moe_layer(layer_id):
            return MoEBlock(config.hidden_size, config.moe)
        return LlamaMLP(config.hidden_size, config.intermediate_size)
