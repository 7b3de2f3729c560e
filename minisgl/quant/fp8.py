"""FP8 weights: the numbers, and the three ways a projection multiplies by them.

e4m3 (float8_e4m3fn) keeps 4 bits of exponent and 3 of mantissa: magnitudes up to 448, and
about two significant digits (between 1 and 2 its steps are 1/8). A weight matrix spans a
wider range than one scale can hold, so each slice of it is stored divided by its own
scale, chosen to map the slice's largest magnitude to 448, and the scale is kept in fp32
beside it: w ≈ q * scale. `--quantization fp8` makes one scale per output row; Hugging
Face's FP8 checkpoints bring one per block of 128 x 128 weights.

A layer with FP8 weights (`weight` in FP8, `weight_scale`, `fp8_block`) multiplies:
- a few rows of x (a decode step of a small batch): in the FP8 GEMV, which reads the bytes
  as stored and scales in registers (kernels/fp8_gemv.py);
- more rows on a GPU: x is quantised too, one scale per row (per 128 columns for block
  scales), and torch's `_scaled_mm` multiplies FP8 by FP8 on the tensor cores and applies
  both scales to the result;
- anywhere else (the CPU, a shape the library refuses): the reference, which dequantises
  W and multiplies in the activations' dtype. The other two are tested against it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.layers.activation import silu_and_mul
from minisgl.layers.linear import GatedLinear
from minisgl.layers.triton_ops import Blocks, NormedInput

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448.0
GEMV_MAX_ROWS = 8  # rows of x (tokens) that may go to an FP8 GEMV, as measured; more: the matmul
HAS_TRITON = importlib.util.find_spec("triton") is not None


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [n, k] -> (q [n, k] FP8, scale [n, 1] fp32) with w ≈ q * scale, row by row."""
    w32 = w.float()
    scale = w32.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (w32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [n, k] -> (q [n, k] FP8, scale [ceil(n / bn), ceil(k / bk)] fp32): one scale per
    block of bn x bk (the last ones may be cut short), as Hugging Face's FP8 checkpoints
    store it (their `weight_scale_inv` is this scale: the multiplier that dequantises)."""
    (bn, bk), (n, k) = block, w.shape
    padded = F.pad(w.float(), (0, -k % bk, 0, -n % bn))
    tiles = padded.view(padded.size(0) // bn, bn, padded.size(1) // bk, bk)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (w.float() / expand(scale, block, n, k)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def expand(scale: torch.Tensor, block: tuple[int, int], n: int, k: int) -> torch.Tensor:
    """The scale of every one of n x k weights, from one per block."""
    return scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The weights that q and its scales stand for, in fp32."""
    (n, k), (bn, bk) = q.shape, block
    if bn == 1 and scale.size(1) == 1:  # one scale per row
        return q.float() * scale
    if n % bn == 0 and k % bk == 0:  # whole blocks: a broadcast, no expanded copy
        return (q.float().view(n // bn, bn, k // bk, bk) * scale[:, None, :, None]).view(n, k)
    return q.float() * expand(scale, block, n, k)


def quantize_groups_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What `kernels.fp8_gemv.quantize_groups` computes, in torch: x [m, k] -> (q FP8,
    scales [m, ceil(k / group)]), one scale per `group` columns of each row."""
    m, k = x.shape
    groups = -(-k // group)
    x32 = F.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = x32.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    q = (x32 / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).view(m, -1)[:, :k].to(FP8)
    return q, scale


def is_fp8(layer: nn.Module) -> bool:
    return layer.weight.dtype == FP8


def set_fp8_weight(
    layer: nn.Module, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> None:
    """Make `layer` (a Linear) hold FP8 weights q, dequantised by `scale`, one per `block` of
    (rows, columns). The weight keeps its tensor-parallel split, for the loader."""
    split = getattr(layer.weight, "tp_split", None)
    layer.weight = nn.Parameter(q, requires_grad=False)
    layer.weight.tp_split = split
    layer.register_buffer("weight_scale", scale.float().contiguous())
    layer.fp8_block = block
    layer.gemv_choice = FIRST_GUESS if gemv_runs(q.device) else None
    layer.matmul = functools.partial(
        fp8_projection, layer=layer, gated=isinstance(layer, GatedLinear)
    )


def check_device(device: torch.device) -> None:
    """FP8 weights run on the CPU (the reference) and on GPUs that convert FP8 in hardware."""
    if device.type == "cuda" and (cap := torch.cuda.get_device_capability(device)) < (8, 9):
        raise ValueError(
            f"FP8 weights need a GPU of compute capability 8.9 or newer (Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}: run without fp8"
        )


def fp8_projection(
    x: torch.Tensor | NormedInput, layer: nn.Module, gated: bool = False
) -> torch.Tensor:
    """x @ W.T (+ bias) for a layer with FP8 weights. gated: W is a merged [gate; up] and
    the result silu(gate) * up. x may be chapter 20's NormedInput, a norm left to the
    projection: the GEMV does it in its kernel, the other paths here. A few rows go to the
    GEMV in the blocks the start-up measurement chose (`layer.gemv_choice`, by whether a
    norm comes with x and by the rows), or to the matmul where it won."""
    rows = x.x if isinstance(x, NormedInput) else x
    choices = layer.gemv_choice  # None where the FP8 GEMV does not run (no triton, a CPU)
    few = rows.dim() == 2 and rows.size(0) <= GEMV_MAX_ROWS and rows.stride(1) == 1
    if choices is not None and few:
        blocks = choices[rows is not x][rows.size(0)]
        if isinstance(blocks, _kernels().MmaBlocks):
            return mma_projection(x, layer, gated, blocks)
        if blocks != "matmul":
            norm = (x.residual, x.residual_out, x.weight, x.eps) if rows is not x else None
            w, scale, block, bias = layer.weight, layer.weight_scale, layer.fp8_block, layer.bias
            return _kernels().fp8_gemv(
                rows, w, scale, block, bias, gated=gated, norm=norm, blocks=blocks
            )
    return library(x.compute() if isinstance(x, NormedInput) else x, layer, gated)


def library(x: torch.Tensor, layer: nn.Module, gated: bool = False) -> torch.Tensor:
    """The matmul's path (`matmul`), and SiLU-and-mul after it where gated."""
    y = matmul(x, layer.weight, layer.weight_scale, layer.fp8_block, layer.bias)
    return silu_and_mul(y) if gated else y


def mma_projection(
    x: torch.Tensor | NormedInput, layer: nn.Module, gated: bool, blocks: Blocks
) -> torch.Tensor:
    """A few rows on the tensor cores (`kernels.fp8_gemv.fp8_mma_gemv`): x quantised per row
    first, in one kernel with the norm where one was deferred to this projection."""
    kernels = _kernels()
    if isinstance(x, NormedInput):
        fold = (x.residual, x.residual_out, x.weight, x.eps)
        xq, xs = kernels.quantize_groups(x.x, x.x.size(1), norm=fold)
        dtype = x.x.dtype
    else:
        xq, xs = kernels.quantize_groups(x, x.size(1))
        dtype = x.dtype
    w, scale = layer.weight, layer.weight_scale
    return kernels.fp8_mma_gemv(xq, xs, w, scale, blocks, dtype, layer.bias, gated)


Choice = Blocks | str | None  # GEMV blocks, "matmul", or None: the GEMV's first guess
FIRST_GUESS: tuple[tuple[Choice, ...], ...] = ((None,) * (GEMV_MAX_ROWS + 1),) * 2


def gemv_runs(device: torch.device) -> bool:
    """Whether the FP8 GEMV runs on `device`: a GPU with triton, or its interpreter."""
    return HAS_TRITON and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [m, k] @ W.T (+ bias): FP8 x FP8 on the tensor cores where the GPU and the shapes
    allow it (bf16 activations, sm89+, sides that are multiples of 16), else the reference."""
    n, k = w.shape
    if x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and _fp8_mma(x.device):
        if block[0] == 1 and block[1] >= k and n % 16 == 0 and k % 16 == 0:
            return scaled_mm_rows(x, w, scale, bias)
        if block == (128, 128) and n % 128 == 0 and k % 128 == 0 and blockwise_mm(x.device):
            return scaled_mm_blocks(x, w, scale, bias)
    return reference(x, w, scale, block, bias)


def reference(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    return F.linear(x, dequantize(w, scale, block).to(x.dtype), bias)


def scaled_mm_rows(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-row scales on both sides: y[i, j] = sx[i] * sw[j] * (qx[i] . qw[j])."""
    qx, sx = quantize_groups(x, x.size(1))
    return torch._scaled_mm(qx, w.t(), scale_a=sx, scale_b=scale.t(), bias=bias, out_dtype=x.dtype)


def scaled_mm_blocks(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """DeepSeek's recipe: x scaled per 128 columns of each row, W per 128 x 128 block. cuBLAS
    (12.9+, sm90) reads W's scales column-major with the column blocks padded to 4."""
    qx, sx = quantize_groups(x, 128)
    sw = F.pad(scale, (0, -scale.size(1) % 4)).t()
    blockwise = F.ScalingType
    out = F.scaled_mm(
        qx, w.t(), sx, blockwise.BlockWise1x128, sw, blockwise.BlockWise128x128,
        output_dtype=x.dtype,
    )  # fmt: skip
    return out if bias is None else out + bias


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x quantised `group` columns at a time: in one kernel where Triton runs, else in torch."""
    x = x.contiguous()
    if HAS_TRITON and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return _kernels().quantize_groups(x, group)
    return quantize_groups_reference(x, group)


@functools.cache
def _kernels() -> ModuleType:
    # Imported when first used: triton is slow to import, and may be missing on a CPU.
    return importlib.import_module("minisgl.kernels.fp8_gemv")


@functools.cache
def _fp8_mma(device: torch.device) -> bool:
    """Whether the GPU multiplies FP8 on its tensor cores (Ada, Hopper and later)."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def blockwise_mm(device: torch.device) -> bool:
    """Whether torch here runs the block-scaled FP8 matmul (torch 2.10+ with cuBLAS 12.9+ on
    sm90) and gets it right: tried once on a small product, before any graph is captured
    (the loader asks first). Where it does not, block-scaled layers use the reference."""
    if not (hasattr(F, "scaled_mm") and torch.cuda.get_device_capability(device) == (9, 0)):
        return False
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(32, 256, device=device, generator=gen).bfloat16()
    q, scale = quantize_blocks(torch.randn(256, 256, device=device, generator=gen), (128, 128))
    try:
        got = scaled_mm_blocks(x, q, scale).float()
    except Exception as e:  # an older torch or cuBLAS: any failure means "not here"
        logger.info("block-scaled FP8 matmul unavailable (%s): such layers dequantise", e)
        return False
    qx, sx = quantize_groups_reference(x, 128)
    want = dequantize(qx, sx, (1, 128)) @ dequantize(q, scale, (128, 128)).t()
    ok = bool(torch.allclose(got, want, rtol=0.02, atol=0.02 * want.abs().max().item()))
    logger.info("block-scaled FP8 matmul (cuBLAS): %s", "in use" if ok else "wrong, not used")
    return ok
