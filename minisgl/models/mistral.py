"""Mistral: the Llama architecture (its sliding window is handled by capping the context)."""

from minisgl.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
