"""`--quantization fp8`: a loaded model's projections turned into FP8, one scale per row.

Which layers: the four projections of every decoder layer (qkv, o, gate_up, down). They
hold nearly all of a dense model's weights, and a decode step reads every one of them. The
embedding, the LM head, the norms and a mixture of experts' router stay in the model dtype,
as in the FP8 checkpoints that are published; so do the experts themselves, because
chapter 22's fused MoE kernel reads bf16.

The model is built and loaded in its dtype as always, then converted layer by layer, so
the loader is unchanged and each tensor-parallel rank quantises the slice it holds. A
checkpoint saved in FP8 is loaded as it is instead (quant/load.py), and a flag asking for
FP8 on it changes nothing: its own choice of layers and scales stands.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from minisgl.layers.linear import Linear
from minisgl.quant.config import check_method
from minisgl.quant.fp8 import check_device, is_fp8, quantize_rows, set_fp8_weight

logger = logging.getLogger(__name__)

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def projections(model: nn.Module) -> list[tuple[str, Linear]]:
    """The Linear layers that may hold FP8 weights, by name."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS
    ]


def quantize_model(model: nn.Module, method: str | None) -> None:
    """Quantise the model's projections as `method` asks ("fp8"; None leaves the model)."""
    check_method(method)
    if method is None:
        return
    layers = [layer for _, layer in projections(model)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no projections that FP8 weights can replace")
    if any(is_fp8(layer) for layer in layers):
        logger.info("FP8 weights: the checkpoint's own, used as they are")
        return
    check_device(layers[0].weight.device)
    before = after = 0
    with torch.no_grad():
        for layer in layers:
            w = layer.weight
            before += w.numel() * w.element_size()
            q, scale = quantize_rows(w)
            set_fp8_weight(layer, q, scale, (1, w.size(1)))
            after += q.numel() + scale.numel() * scale.element_size()
    if layers[0].weight.is_cuda:  # hand the old weights back, so the KV budget sees the room
        torch.cuda.empty_cache()
    logger.info(
        "FP8 weights: %d projections quantised per row, %.2f GB -> %.2f GB",
        len(layers),
        before / 1e9,
        after / 1e9,
    )
