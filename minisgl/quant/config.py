"""Which quantisation a model runs with: asked for by a flag, or stated by its checkpoint.

There are two ways to FP8 weights. `--quantization fp8` (`EngineConfig.quantization`)
quantises a bf16, fp16 or fp32 checkpoint's projections once they are loaded, with one
scale per output row. A checkpoint saved in FP8 says so in its config.json, in the layout
Hugging Face's fine-grained FP8 uses (DeepSeek-V3, Qwen3-*-FP8):

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                            "activation_scheme": "dynamic", "weight_block_size": [128, 128]}

with each quantised weight stored as float8_e4m3fn and, beside it, `<name>.weight_scale_inv`:
one multiplier per block of 128 x 128 weights. Such a folder loads as it is, with no flag.
A compressed-tensors config that quantises the KV cache alone (`kv_cache_scheme`, no
`config_groups`: llm-compressor's FP8 KV recipe) has plain weights and loads too; its
scales serve `kv_cache_dtype fp8_e4m3` (quant/kv_scales.py).
Anything else in `quantization_config` is refused here, by name, before a tensor is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METHODS = ("fp8",)
KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3"}  # name -> canonical


@dataclass(frozen=True)
class Fp8Checkpoint:
    """What config.json says of an FP8 checkpoint: how many weights share one scale."""

    block: tuple[int, int]  # rows (output features) x columns (input features)


@dataclass(kw_only=True)
class QuantConfig:
    """The engine's quantisation settings (EngineConfig's)."""

    quantization: str | None = None  # "fp8": FP8 projections, one scale per row
    kv_cache_dtype: str = "auto"  # "fp8_e4m3" (or "fp8"): keys and values in e4m3

    def check_quantization(self, attention_backend: str) -> None:
        """Raise ValueError for a method or cache dtype we do not run, or a cache dtype the
        attention backend cannot read; the cache dtype takes its canonical name."""
        check_method(self.quantization)
        self.kv_cache_dtype = check_kv_cache_dtype(self.kv_cache_dtype, attention_backend)


def check_method(method: str | None) -> None:
    """Raise ValueError unless `method` is a quantisation we run (None: none asked)."""
    if method is not None and method not in METHODS:
        raise ValueError(
            f"quantization {method!r} is not supported: choose {' or '.join(METHODS)}, or none"
        )


def check_checkpoint_quantization(method: str | None, model_path: str) -> None:
    """Raise ValueError unless the model in `model_path` can take `method`: before anything
    is loaded or any process started."""
    config = Path(model_path) / "config.json"
    if method is not None and config.is_file():
        parse_quantization_config(json.loads(config.read_text()).get("quantization_config"))


def check_kv_cache_dtype(name: str, attention_backend: str) -> str:
    """The canonical name of a KV-cache dtype ("auto": the model's; "fp8_e4m3"), or a
    ValueError for one we do not store or an attention backend that cannot read it."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype {name!r} is not supported: choose auto (the model's dtype) or fp8_e4m3"
        )
    if KV_CACHE_DTYPES[name] == "auto":
        return "auto"
    from minisgl.attention.registry import reads_fp8_kv  # the backends' classes, and torch

    if not reads_fp8_kv(attention_backend):
        raise ValueError(
            f"attention backend {attention_backend!r} does not read an FP8 KV cache: use "
            "triton (GPU), torch or auto with kv_cache_dtype fp8_e4m3"
        )
    return KV_CACHE_DTYPES[name]


def parse_quantization_config(raw: dict[str, Any] | None) -> Fp8Checkpoint | None:
    """The checkpoint's own quantisation from config.json's `quantization_config`, or None
    for a checkpoint in plain floating point. Raises ValueError for what cannot be loaded."""
    if raw is None or _kv_cache_only(raw):
        return None
    method = raw.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"the checkpoint is quantised with {method!r}; only Hugging Face's block-scaled "
            "'fp8' checkpoints load (or a bf16/fp16/fp32 one with quantization 'fp8')"
        )
    if raw.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"FP8 format {raw['fmt']!r} is not supported: only e4m3 weights load")
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"activation_scheme {raw['activation_scheme']!r} is not supported: activations "
            "are scaled as they come ('dynamic'), so static input scales have no use here"
        )
    block = raw.get("weight_block_size")
    if block is None:
        raise ValueError(
            "an FP8 checkpoint without weight_block_size (one scale per tensor) is not "
            "supported: only block-scaled ones load"
        )
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"weight_block_size must be two positive integers, got {block!r}")
    return Fp8Checkpoint((block[0], block[1]))


def _kv_cache_only(raw: dict[str, Any]) -> bool:
    """Whether a `quantization_config` quantises nothing but the KV cache, in FP8 with one
    static scale per layer; a KV scheme we do not store is refused."""
    scheme = raw.get("kv_cache_scheme")
    if raw.get("quant_method") != "compressed-tensors" or raw.get("config_groups") or not scheme:
        return False
    fp8 = scheme.get("type") == "float" and scheme.get("num_bits") == 8
    if not fp8 or scheme.get("strategy", "tensor") != "tensor" or scheme.get("dynamic"):
        raise ValueError(
            f"kv_cache_scheme {scheme} is not supported: only FP8 (type float, 8 bits) with "
            "one static scale per layer (strategy 'tensor') loads"
        )
    return True
