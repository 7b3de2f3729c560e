"""Qwen2: Llama with a bias on the q/k/v projection."""

from minisgl.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
