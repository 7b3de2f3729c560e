"""ModelConfig: the handful of numbers from config.json that decide the model's shapes.

Checkpoints spell the same fact in different ways (rope_theta at the top level or inside
`rope_parameters`; `num_experts` or `num_local_experts`); this is the one place that knows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minisgl.layers.rope_scaling import ROPE_ALIASES, ROPE_TYPES, RopeScaling  # [ch29]
from minisgl.models import families  # [ch29]
from minisgl.quant.config import Fp8Checkpoint, parse_quantization_config  # [ch28]

SUPPORTED_ACTIVATIONS: tuple[str, ...] = ("silu",)
SUPPORTED_ACTIVATIONS += ("gelu_pytorch_tanh",)  # Gemma's GELU, tanh-approximated  # [ch29]
SUPPORTED_ROPE: tuple[str, ...] = ("default",)
SUPPORTED_ROPE = (*ROPE_TYPES, *ROPE_ALIASES)  # scaled variants  # [ch29]


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_step: int  # every `sparse_step`-th layer is MoE ...
    dense_layers: tuple[int, ...]  # ... except these, which keep a dense MLP
    shared_size: int = 0  # a shared expert's width beside the routed ones (0: none)  # [ch29]

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id not in self.dense_layers and (layer_id + 1) % self.sparse_step == 0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    dtype: str | None  # the checkpoint's own dtype, e.g. "bfloat16"
    sliding_window: int | None  # Mistral-style local attention: the last this many positions
    moe: MoEConfig | None
    quantization: Fp8Checkpoint | None = None  # the checkpoint's own (FP8 weights)  # [ch28]
    # >>> ch29 more model families
    rope: RopeScaling | None = None  # the full-attention layers' RoPE (its variant, its channels)
    local_rope: RopeScaling | None = None  # the sliding layers' own, where it differs (Gemma 3)
    layer_types: tuple[str, ...] = ()  # "sliding_attention", "full_attention" or "linear_attention"
    linear: families.LinearAttention | None = None  # a hybrid's Gated DeltaNet layers (Qwen3.5)
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by its -1/2 power
    final_logit_softcapping: float | None = None  # Gemma: logits = cap * tanh(logits / cap)
    rope_context: int = 0  # positions the RoPE tables serve: set by the engine to its context
    gemma4: families.Gemma4Text | None = None  # two KV geometries, shared KV, per-layer embeddings
    # <<< ch29

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        raw = families.text_model_config(raw)  # Gemma's defaults, a multimodal one's text  # [ch29]
        archs = raw.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures': cannot tell which model to build")
        num_heads = raw["num_attention_heads"]
        hidden_size = raw["hidden_size"]
        head_dim = raw.get("head_dim") or hidden_size // num_heads
        act = raw.get("hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported: only {SUPPORTED_ACTIVATIONS}")
        sliding_window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        return cls(
            architecture=archs[0],
            vocab_size=raw["vocab_size"],
            hidden_size=hidden_size,
            intermediate_size=raw.get("intermediate_size") or raw.get("moe_intermediate_size", 0),
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", False),
            dtype=raw.get("dtype") or raw.get("torch_dtype"),
            sliding_window=sliding_window,
            moe=_moe(raw),
            quantization=parse_quantization_config(raw.get("quantization_config")),  # [ch28]
            **families.family_fields(raw, head_dim, sliding_window),  # [ch29]
        )

    @classmethod
    def from_path(cls, model_path: str | Path) -> ModelConfig:
        path = Path(model_path) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: is {model_path} a model folder?")
        return cls.from_dict(json.loads(path.read_text()))


def _rope_theta(raw: dict[str, Any]) -> float:
    # transformers 5 writes `rope_parameters: {rope_theta, rope_type}`; older configs use
    # a top-level `rope_theta` and maybe `rope_scaling`.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    params = params.get("full_attention", params)  # one per layer type: the global one  # [ch29]
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in SUPPORTED_ROPE:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE}")
    return float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))


def _moe(raw: dict[str, Any]) -> MoEConfig | None:
    num_experts = raw.get("num_experts") or raw.get("num_local_experts")
    if not num_experts:
        return None
    return MoEConfig(
        num_experts=num_experts,
        top_k=raw["num_experts_per_tok"],
        intermediate_size=raw.get("moe_intermediate_size") or raw["intermediate_size"],
        norm_topk_prob=raw.get("norm_topk_prob", False),
        sparse_step=raw.get("decoder_sparse_step", 1) or 1,
        dense_layers=tuple(raw.get("mlp_only_layers") or ()),
        shared_size=raw.get("shared_expert_intermediate_size") or 0,  # [ch29]
    )
