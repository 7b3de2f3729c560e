"""Loading a checkpoint saved in FP8, in Hugging Face's block-scaled layout, as it is.

Each quantised weight comes with `<name>.weight_scale_inv`, [ceil(rows / 128),
ceil(columns / 128)] fp32 multipliers: one per block of config.json's weight_block_size.
The loader of chapter 5 merges q/k/v and gate/up into one tensor, and chapter 21's cuts
every tensor into one slice per rank; the scales must follow their rows. A block of the
checkpoint can follow only if its rows stay together: q with 64 rows on top of k, or a
rank whose slice starts at row 96, would put rows of two checkpoint blocks into one of
ours. So for each parameter the loader finds the largest block of rows (and of columns)
that every merged piece and every slice keeps whole, and repeats the checkpoint's scales
down to it. For real models (sides that are multiples of 128) nothing changes; for tiny
ones the blocks shrink, and the product stays exact.

Our projections (qkv, o, gate_up, down) that the checkpoint stores in FP8 become FP8.
Any other FP8 tensor (the experts of a mixture, which chapter 22's kernel reads in bf16)
is dequantised to the model dtype as it loads.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from minisgl.distributed import get_tp_info
from minisgl.models.config import ModelConfig
from minisgl.quant.fp8 import FP8, blockwise_mm, check_device, is_fp8, set_fp8_weight
from minisgl.quant.quantize import projections

SUFFIX = "_scale_inv"
Key = tuple[int | None, int | None]  # (expert, part), as the loader places a tensor


class Fp8Loader:
    """The scales of an FP8 checkpoint, collected as the loader meets them, and put to use
    as each parameter is assembled (`prepare`)."""

    def __init__(self, model: nn.Module, block: tuple[int, int], place: Callable) -> None:
        self.model, self.block, self.place = model, block, place
        self.scales: dict[str, dict[Key, torch.Tensor]] = defaultdict(dict)

    @classmethod
    def open(
        cls, model: nn.Module, model_path: str | Path, files: list[Path], place: Callable
    ) -> Fp8Loader | None:
        """None for a checkpoint that is not FP8. Else its loader, with every projection that
        the checkpoint stores in FP8 already made FP8 in the model. `place` is the loader's
        map from a checkpoint name to (our parameter, expert, part)."""
        checkpoint = ModelConfig.from_path(model_path).quantization
        if checkpoint is None:
            return None
        layers = dict(projections(model))
        check_device(next(model.parameters()).device)
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    target, expert, _ = place(name.removesuffix(SUFFIX))
                    layer = layers.get(target.removesuffix(".weight"))
                    if name.endswith(SUFFIX) and expert is None and layer and not is_fp8(layer):
                        empty = torch.empty_like(layer.weight, dtype=FP8)
                        set_fp8_weight(layer, empty, torch.empty(0), checkpoint.block)
        return cls(model, checkpoint.block, place)

    def take(self, f: Any, name: str) -> bool:
        """Keep checkpoint tensor `name` (from the open file f) if it is a scale: whether it was.
        Scales are small and read whole; a rank picks its rows of them in `prepare`."""
        if not name.endswith(SUFFIX):
            return False
        target, expert, part = self.place(name.removesuffix(SUFFIX))
        self.scales[target][expert, part] = f.get_tensor(name).float()
        return True

    def prepare(self, name: str, pieces: dict[Key, torch.Tensor], param: nn.Parameter) -> None:
        """Before parameter `name` is assembled from its checkpoint `pieces`: an FP8
        projection gets its scales, merged and sliced as its rows are; FP8 pieces of any
        other parameter are dequantised (in `pieces`) to the parameter's dtype."""
        scales = self.scales.get(name, {})
        if param.dtype == FP8:
            layer = self.model.get_submodule(name.rsplit(".", 1)[0])
            scale, block = self._merge(name, pieces, scales, param)
            layer.register_buffer("weight_scale", scale.to(param.device))
            layer.fp8_block = block
            if param.is_cuda and block == (128, 128):
                blockwise_mm(param.device)  # try the library's kernel now, not in a graph
            return
        for key, piece in pieces.items():
            if piece.dtype == FP8:
                row_ids, col_ids = self._blocks(name, key, piece, scales, param)
                s = scales[key][row_ids][:, col_ids]
                pieces[key] = (piece.float() * s).to(param.dtype)

    def _merge(
        self, name: str, pieces: dict[Key, torch.Tensor], scales: dict, param: nn.Parameter
    ) -> tuple[torch.Tensor, tuple[int, int]]:
        """The scales of an FP8 parameter made of `pieces` (in the loader's order of parts),
        at the coarsest block that every piece and slice keeps whole."""
        keys = sorted(pieces, key=lambda key: -1 if key[1] is None else key[1])
        rows, ids, col_ids = [], [], None
        for i, key in enumerate(keys):
            row_ids, col_ids = self._blocks(name, key, pieces[key], scales, param)
            rows.append(scales[key][row_ids])
            ids.append(row_ids + i * (1 << 32))  # the blocks of two pieces never merge
        per_row = torch.cat(rows)
        bn, bk = _coarsest(torch.cat(ids), self.block[0]), _coarsest(col_ids, self.block[1])
        return per_row[::bn][:, col_ids[::bk]].contiguous(), (bn, bk)

    def _blocks(
        self, name: str, key: Key, piece: torch.Tensor, scales: dict, param: nn.Parameter
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For each row and column of `piece` as this rank holds it, the checkpoint block it
        falls in: which row and column of the piece's scales apply to it."""
        if piece.dtype != FP8 or key not in scales:
            raise ValueError(
                f"{name}: the checkpoint stores a piece of it ({_describe(key)}) "
                f"{'without a weight_scale_inv' if piece.dtype == FP8 else 'not in FP8'}, "
                "but the others in FP8: every piece must be FP8, with its scales"
            )
        rows, cols = _indices(param, key, piece.shape)
        row_ids, col_ids = rows // self.block[0], cols // self.block[1]
        s = scales[key]
        if s.dim() != 2 or row_ids[-1] >= s.size(0) or col_ids[-1] >= s.size(1):
            raise ValueError(
                f"{name}: weight_scale_inv of shape {tuple(s.shape)} does not cover its weight "
                f"in blocks of {self.block[0]} x {self.block[1]} (up to row {rows[-1].item()},"
                f" column {cols[-1].item()})"
            )
        return row_ids, col_ids


def _indices(param: nn.Parameter, key: Key, shape: torch.Size) -> tuple[torch.Tensor, ...]:
    """Where each row and column of a piece (as this rank read it) lies in the checkpoint's
    tensor: the rank's slices of the dimension its layer is split along, the rest whole."""
    rows, cols = torch.arange(shape[0]), torch.arange(shape[1])
    split = getattr(param, "tp_split", None)
    if split is None or get_tp_info().size == 1:
        return rows, cols
    expert, part = key
    held = range(len(split.parts)) if part is None else (part,)
    sliced = torch.cat([torch.arange(a, b) for a, b in split.ranges(held)])
    return (sliced, cols) if split.dim - (expert is not None) == 0 else (rows, sliced)


def _coarsest(ids: torch.Tensor, block: int) -> int:
    """The largest divisor g of `block` such that every aligned run of g entries of `ids`
    holds one value: the coarsest block of scales that loses nothing."""
    for g in range(block, 0, -1):
        if block % g == 0:
            runs = F.pad(ids, (0, -len(ids) % g), value=int(ids[-1])).view(-1, g)
            if bool((runs == runs[:, :1]).all()):
                return g
    return 1


def _describe(key: Key) -> str:
    expert, part = key
    where = [] if expert is None else [f"expert {expert}"]
    return ", ".join(where + ([] if part is None else [f"part {part}"])) or "the whole tensor"
