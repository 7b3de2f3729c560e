"""An FP8 KV cache's scales: one for the keys and one for the values of each layer.

e4m3 holds magnitudes from 2^-6 to 448 with 3 bits of mantissa, and from 2^-9 up to 2^-6
with fewer (its subnormals). Keys and values stored as they are (a scale of 1.0, the default, as in
vLLM) lose precision where they are small and saturate beyond 448. A scale moves a layer's
range onto e4m3's: the cache holds x / scale and reads back stored * scale, so a scale of
max|x| / 448, measured on sample text, fills the format. One number per layer, not per
head, so every rank of tensor parallelism takes the same.

Calibration tools write the scales into the checkpoint, each a single fp32 number, the
multiplier (x = stored * scale), under one of two names:

    model.layers.N.self_attn.k_scale / v_scale                compressed-tensors (llm-compressor)
    model.layers.N.self_attn.k_proj.k_scale / v_proj.v_scale  NVIDIA ModelOpt

The loader hands each such tensor to `KVScales.take` instead of a parameter, and hangs
what it found on the model; the engine gives them to an FP8 cache (`use_kv_scales`) and
ignores them, saying so once, for a cache in the model's dtype. The cache (`MHAKVCache`)
holds them, every path that writes it divides by them, and every path that reads it
multiplies: `widen` is how the reference backend reads.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from minisgl.quant.fp8 import FP8

if TYPE_CHECKING:
    from minisgl.kvcache.mha_pool import MHAKVCache

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k_proj\.k|v_proj\.v|k|v)_scale$")


@dataclass
class KVScales:
    """The KV-cache scales of a checkpoint, by layer, as the loader meets them."""

    num_layers: int
    k: dict[int, float] = field(default_factory=dict)
    v: dict[int, float] = field(default_factory=dict)

    def take(self, f: Any, name: str) -> bool:
        """Keep checkpoint tensor `name` (from the open file f) if it is a KV-cache scale:
        whether it was. A scale that is not one finite positive number is refused."""
        m = _NAME.match(name)
        if m is None:
            return False
        layer, found = int(m[1]), (self.k if m[2][-1] == "k" else self.v)
        tensor = f.get_tensor(name)
        if tensor.numel() != 1:
            raise ValueError(
                f"{name} has {tensor.numel()} values: a KV-cache scale here is one number per "
                "layer (per-head scales are not supported)"
            )
        value = float(tensor.float().item())
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} is {value}: a KV-cache scale must be finite and > 0")
        if layer >= self.num_layers or layer in found:
            why = "given twice" if layer in found else f"the model has {self.num_layers} layers"
            raise ValueError(f"{name}: {why}")
        found[layer] = value
        return True

    def done(self, model: nn.Module) -> None:
        """After the last file: the scales on the model (`model.kv_scales`), a pair for
        each layer given one (a layer that keeps no KV has none: `use_kv_scales` checks
        that every layer the cache stores has its pair)."""
        if not self.k and not self.v:
            return
        missing = [
            f"{kind}_scale of layer {i}"
            for i in sorted(self.k.keys() | self.v.keys())
            for kind, found in (("k", self.k), ("v", self.v))
            if i not in found
        ]
        if missing:
            more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
            raise ValueError(
                f"the checkpoint has KV-cache scales for some layers only: no "
                f"{', '.join(missing[:4])}{more}"
            )
        model.kv_scales = self


def use_kv_scales(model: nn.Module, cache: MHAKVCache) -> None:
    """The checkpoint's scales (if it has them) into an FP8 cache; a cache in the model's
    dtype stores keys and values as they are, and is left at 1.0."""
    scales: KVScales | None = getattr(model, "kv_scales", None)
    if scales is None:
        return
    if cache.dtype != FP8:
        logger.info(
            "the checkpoint's KV-cache scales are not used: the KV cache is %s, not FP8 "
            "(kv_cache_dtype fp8_e4m3 uses them)",
            cache.dtype,
        )
        return
    # The cache's layer l stores model layer stored[l]: the same but where some layers keep
    # no KV of their own (kvcache/layout.py numbers the ones that do).
    stored = getattr(cache, "stored_layers", range(scales.num_layers))
    if missing := [i for i in stored if i not in scales.k]:
        raise ValueError(f"the checkpoint has no KV-cache scales for layers {missing}")
    k, v = [scales.k[i] for i in stored], [scales.v[i] for i in stored]
    cache.k_scale, cache.v_scale = k, v  # before the first forward: a graph keeps its numbers
    logger.info(
        "FP8 KV cache with the checkpoint's scales: k_scale %.3g-%.3g, v_scale %.3g-%.3g",
        min(k), max(k), min(v), max(v),
    )  # fmt: skip


def widen(
    keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype, scales: tuple[float, float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values as read from the cache, in `dtype`: an FP8 cache's stored * scale."""
    if keys.dtype == dtype:  # a cache in the model's dtype holds them as they are
        return keys, values
    return keys.to(dtype) * scales[0], values.to(dtype) * scales[1]
