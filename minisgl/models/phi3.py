"""Phi-3 and Phi-4-mini: the Llama architecture with q/k/v and gate/up stored fused in the
checkpoint (loaded as they are: they are our merged layers), longrope and partial rotary."""

from minisgl.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    pass
