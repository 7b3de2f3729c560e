"""Qwen3: Llama with an RMSNorm on every query and key head, applied before RoPE."""

from minisgl.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
