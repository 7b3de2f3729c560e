"""ModelConfig: the handful of numbers from config.json that decide the model's shapes.

Checkpoints spell the same fact in different ways (rope_theta at the top level or inside
`rope_parameters`; `num_experts` or `num_local_experts`); this is the one place that knows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minisgl.quant.config import Fp8Checkpoint, parse_quantization_config  # [ch28]


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_step: int  # every `sparse_step`-th layer is MoE ...
    dense_layers: tuple[int, ...]  # ... except these, which keep a dense MLP

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
    # Mistral-style local attention; we attend globally, so contexts are capped at this.
    sliding_window: int | None
    moe: MoEConfig | None
    quantization: Fp8Checkpoint | None = None  # the checkpoint's own (FP8 weights)  # [ch28]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures': cannot tell which model to build")
        num_heads = raw["num_attention_heads"]
        hidden_size = raw["hidden_size"]
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        return cls(
            architecture=archs[0],
            vocab_size=raw["vocab_size"],
            hidden_size=hidden_size,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden_size // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", False),
            dtype=raw.get("dtype") or raw.get("torch_dtype"),
            sliding_window=raw.get("sliding_window")
            if raw.get("use_sliding_window", True)
            else None,
            moe=_moe(raw),
            quantization=parse_quantization_config(raw.get("quantization_config")),  # [ch28]
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
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope type {rope_type!r} is not supported (only plain RoPE)")
    return float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))


def _moe(raw: dict[str, Any]) -> MoEConfig | None:
    num_experts = raw.get("num_experts") or raw.get("num_local_experts")
    if not num_experts:
        return None
    return MoEConfig(
        num_experts=num_experts,
        top_k=raw["num_experts_per_tok"],
        intermediate_size=raw.get("moe_intermediate_size", raw["intermediate_size"]),
        norm_topk_prob=raw.get("norm_topk_prob", False),
        sparse_step=raw.get("decoder_sparse_step", 1) or 1,
        dense_layers=tuple(raw.get("mlp_only_layers") or ()),
    )
