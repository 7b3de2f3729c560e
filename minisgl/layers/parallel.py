"""Tensor parallelism in the layers: each rank holds a slice of every weight, and reads only it.

A layer is cut one of two ways. Along its outputs (split dim 0, "column parallel"): each rank
computes a slice of the output features from the whole input. Along its inputs (split dim
1, "row parallel"): each rank holds a slice of the input features and computes a partial
sum of the whole output, and an all-reduce adds the partial sums up. A column layer feeding
a row layer (qkv -> o_proj, gate_up -> down) needs one all-reduce for the pair: the slice
that the first computes is exactly the slice of inputs that the second holds.

A layer states its cut with a `Split` (minisgl/distributed/info.py); the helpers here give
it the shape of its slice, mark its parameters with the split, and let the weight loader
read a rank's slice of a checkpoint tensor and nothing more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import Split, all_reduce, get_tp_info
from minisgl.models.families import kv_head_counts  # [ch29]

if TYPE_CHECKING:
    from minisgl.models.config import ModelConfig


def check_tp(config: ModelConfig, tp_size: int) -> None:
    """Raise ValueError, naming each shape, if the model cannot be cut into tp_size shares:
    before anything is loaded or any rank is started."""
    sizes = {"num_attention_heads": config.num_heads, "vocab_size": config.vocab_size}
    moe = config.moe
    if moe is None or any(not moe.is_moe_layer(i) for i in range(config.num_layers)):
        sizes["intermediate_size"] = config.intermediate_size
    if moe is not None:
        sizes["moe_intermediate_size"] = moe.intermediate_size
    problems = [f"{k} {v} is not divisible by {tp_size}" for k, v in sizes.items() if v % tp_size]
    kv_heads = {"num_key_value_heads": config.num_kv_heads}
    kv_heads = kv_head_counts(config)  # and Gemma 4's full layers'  # [ch29]
    for name, kv in kv_heads.items():  # fewer KV heads than ranks: each must serve whole ranks
        if kv % tp_size and tp_size % kv:
            problems.append(f"{name} {kv} neither divides {tp_size} nor is divisible by it")
    if problems:
        raise ValueError(f"cannot split this model over {tp_size} ranks: {'; '.join(problems)}")


def rank_shape(split: Split | None, *shape: int) -> tuple[int, ...]:
    """The shape of this rank's slice of a tensor of `shape` that `split` cuts (all of it
    without a split)."""
    if split is None:
        return shape
    if sum(split.parts) != shape[split.dim]:
        raise ValueError(f"split {split} does not cover {shape[split.dim]} features")
    return (*shape[: split.dim], split.local_size, *shape[split.dim + 1 :])


def mark_split(split: Split | None, weight: nn.Parameter, bias: nn.Parameter | None = None) -> None:
    """Tell the weight loader how a layer's parameters are cut: the weight by `split`, a bias
    like the weight's rows. A row layer has no bias: every rank would add it to its share."""
    weight.tp_split = split
    if bias is not None and split is not None:
        if split.dim != 0:
            raise ValueError("a layer cut along its inputs cannot have a bias")
        bias.tp_split = split


def needs_all_reduce(split: Split | None) -> bool:
    """Whether a layer cut by `split` computes partial sums for an all-reduce to add up."""
    return split is not None and split.dim == 1 and get_tp_info().size > 1


def embed_rank_slice(input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The embedding of `input_ids` when each rank holds `weight`, a contiguous slice of the
    vocabulary's rows: a rank looks up the ids in its slice and gives zeros for the others,
    and the all-reduce then hands every rank each id's row from the rank that holds it."""
    ids = input_ids - get_tp_info().rank * weight.size(0)
    outside = (ids < 0) | (ids >= weight.size(0))
    x = F.embedding(ids.masked_fill(outside, 0), weight)
    return all_reduce(x.masked_fill_(outside[:, None], 0.0))


def read_rank_slice(
    f: Any, name: str, param: nn.Parameter, expert: int | None, part: int | None
) -> torch.Tensor | None:
    """This rank's slices of checkpoint tensor `name` (opened as `f`) for `param`, read from
    the file without the rest; None where the rank holds the whole tensor.
    `expert`, `part`: which expert of a stacked parameter, which of its merged pieces."""
    split = getattr(param, "tp_split", None)
    if split is None or get_tp_info().size == 1:
        return None
    tensor = f.get_slice(name)
    dim = split.dim - (expert is not None)  # one expert's tensor lacks the experts' dim
    held = range(len(split.parts)) if part is None else (part,)
    shape, whole = tensor.get_shape(), sum(split.parts[i] for i in held)
    if len(shape) <= dim or shape[dim] != whole:
        raise ValueError(
            f"{name}: checkpoint shape {tuple(shape)}, the model expects {whole} on dim {dim}"
        )
    before = (slice(None),) * dim
    return torch.cat([tensor[(*before, slice(a, b))] for a, b in split.ranges(held)], dim)
