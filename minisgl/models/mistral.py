"""Mistral: the Llama architecture; a sliding window, where its config has one, is the
attention backends' to apply."""

from minisgl.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
