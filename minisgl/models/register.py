"""From an `architectures` name in config.json to the class that builds it."""

from __future__ import annotations

import importlib

from minisgl.models.base import BaseLLMModel
from minisgl.models.config import ModelConfig

_MODELS = {
    "LlamaForCausalLM": "minisgl.models.llama",
    "Qwen2ForCausalLM": "minisgl.models.qwen2",
    "Qwen3ForCausalLM": "minisgl.models.qwen3",
    "Qwen3MoeForCausalLM": "minisgl.models.qwen3_moe",
    "MistralForCausalLM": "minisgl.models.mistral",
    # >>> ch29
    "Gemma3ForCausalLM": "minisgl.models.gemma3",
    "Gemma3ForConditionalGeneration": "minisgl.models.gemma3",
    "Gemma4ForCausalLM": "minisgl.models.gemma4",
    "Gemma4ForConditionalGeneration": "minisgl.models.gemma4",
    "Phi3ForCausalLM": "minisgl.models.phi3",
    # <<< ch29
    # >>> ch31 hybrids: linear-attention layers with a recurrent state
    "Qwen3_5ForCausalLM": "minisgl.models.qwen3_5",
    "Qwen3_5ForConditionalGeneration": "minisgl.models.qwen3_5",
    "Qwen3_5MoeForCausalLM": "minisgl.models.qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "minisgl.models.qwen3_5",
    "Qwen3NextForCausalLM": "minisgl.models.qwen3_next",
    # <<< ch31
}


def create_model(config: ModelConfig) -> BaseLLMModel:
    module = _MODELS.get(config.architecture)
    if module is None:
        raise ValueError(
            f"architecture {config.architecture!r} is not supported; supported: {sorted(_MODELS)}"
        )
    return getattr(importlib.import_module(module), config.architecture)(config)
