"""Mistral: the Llama architecture; its sliding window is the attention backends' (ch29)."""

from minisgl.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
