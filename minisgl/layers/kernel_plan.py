"""The kernel plan: which kernel each layer runs, chosen once at start-up and installed.

A layer's own code is the reference: plain torch, the only path on a CPU. On a GPU in
bf16/fp16, fused kernels do the same work in fewer passes over memory (FlashInfer's, and
our own Triton kernels where the tree has them). Which ones run depends on the device,
the dtype, the attention backend, the MINISGL_* knobs and what the start-up measured;
none of these changes while the engine runs. So they are
read once, into a `KernelPlan`, and `install` puts each layer's kernels on it (a norm's
`forward` and `forward_add`, a projection's `matmul`, the rotary's `rotate`, the
attention layer's `forward`). A layer's forward then is one straight line, and no hot
path reads the environment or asks which backend it runs on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MethodType, ModuleType

import torch
from torch import nn

from minisgl.env import ENV
from minisgl.layers import activation
from minisgl.layers.attention import AttentionLayer
from minisgl.layers.elementwise_ops import elementwise_ops  # [ch20]
from minisgl.layers.fused import flashinfer, rope
from minisgl.layers.linear import GatedLinear, Linear
from minisgl.layers.norm import RMSNorm

# >>> ch20
from minisgl.layers.triton_ops import (
    GemvPlan,
    attention_from_qkv,
    deferring,
    gemv_kernel,
    rope_store_kernel,
)

# <<< ch20


@dataclass
class KernelPlan:
    dtype: torch.dtype
    fused: bool  # fused kernels may run: bf16/fp16 on CUDA, MINISGL_FUSED_KERNELS on
    flashinfer: ModuleType | None  # FlashInfer's kernels, where they may run and are installed
    # >>> ch20
    elementwise: ModuleType | None  # ours for the norms and SiLU, unless FlashInfer attends
    rope_store: Callable | None  # q/k norm, rotary and the KV store in one kernel
    decode_from_qkv: Callable | None  # the backend's decode from qkv (MINISGL_FUSED_DECODE)
    gemv: GemvPlan | None  # None: no GEMV here (CPU, fp32, no triton, MINISGL_GEMV=off)
    # <<< ch20

    @classmethod
    def at_start(cls, device: torch.device, dtype: torch.dtype, backend: object) -> KernelPlan:
        """The plan for a model in `dtype` on `device` whose attention runs on `backend`,
        with nothing measured yet."""
        half = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
        fused = half and bool(ENV.FUSED_KERNELS.value)
        # >>> ch20
        gemv = None
        if (kernel := gemv_kernel(fused)) and ENV.GEMV.value != "off":
            gemv = GemvPlan(kernel, ENV.GEMV.value, ENV.GEMV_MAX_ROWS.value)
        decode = getattr(backend, "decode_from_qkv", None) if ENV.FUSED_DECODE.value else None
        # <<< ch20
        return cls(
            dtype,
            fused,
            flashinfer() if fused else None,
            # >>> ch20
            elementwise_ops(fused, backend.name),  # type: ignore[attr-defined]
            rope_store := rope_store_kernel(fused),
            decode if rope_store is not None else None,
            gemv,
            # <<< ch20
        )

    def install(self, model: nn.Module) -> None:
        """Every layer of `model` gets the kernels of this plan."""
        fi = self.flashinfer
        ops = fi.norm if fi is not None else None
        act = fi.activation.silu_and_mul if fi is not None else activation.silu_and_mul_reference
        # >>> ch20 our Triton kernels, unless FlashInfer is the attention backend
        if (ours := self.elementwise) is not None:
            ops, act = ours, ours.silu_and_mul
        # <<< ch20
        activation.use_silu_and_mul(act)
        norm = _norm_kernels(ops) if ops is not None else None
        for module in model.modules():
            if isinstance(module, RMSNorm):
                self._install_norm(module, norm)
            elif isinstance(module, Linear):
                self._install_matmul(module)
            elif hasattr(module, "install_kernels"):  # a family's own layer chooses  # [ch29]
                module.install_kernels(self)  # [ch29]
            elif isinstance(module, AttentionLayer):
                rotary = module.rotary
                rotary.rotate = MethodType(rope(fi), rotary) if fi is not None else rotary.reference
                module.forward = MethodType(AttentionLayer.forward, module)
                # >>> ch20
                if self.rope_store is not None:
                    forward = attention_from_qkv(self.rope_store, self.decode_from_qkv)
                    module.forward = MethodType(forward, module)
                # <<< ch20

    def _install_norm(self, module: RMSNorm, kernels: tuple[Callable, Callable] | None) -> None:
        forward, forward_add = kernels or (RMSNorm.forward, RMSNorm.forward_add)
        # >>> ch20 a few tokens before a projection: the add and the norm go into its GEMV
        if self.gemv is not None and module.into_gemv:
            module.gemv_defers = self.gemv.defers(module)
            forward_add = deferring(self.gemv, forward_add)
        # <<< ch20
        module.forward = MethodType(forward, module)
        module.forward_add = MethodType(forward_add, module)

    def _install_matmul(self, module: Linear) -> None:
        # >>> ch28 FP8 weights: FP8's own kernels, with their scales
        if module.weight.dtype == torch.float8_e4m3fn:
            from minisgl.quant import fp8_choice

            fp8_choice.install(module, isinstance(module, GatedLinear), self.gemv)
            return
        # <<< ch28
        # >>> ch20 a few tokens: a matrix-vector product, the weights read once at full speed
        if self.gemv is not None and module.weight.dtype == self.dtype:
            self.gemv.install(module, isinstance(module, GatedLinear))
            return
        # <<< ch20
        module.matmul = MethodType(type(module).matmul, module)


def _norm_kernels(ops: ModuleType) -> tuple[Callable, Callable]:
    """RMSNorm's forward and forward_add in `ops`'s kernels (FlashInfer's `norm`, or our
    `kernels.elementwise`, which share one signature); forward_add works in place."""
    rmsnorm, fused_add_rmsnorm = ops.rmsnorm, ops.fused_add_rmsnorm

    def forward(self: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm(x, self.weight, self.eps)

    def forward_add(self: RMSNorm, x: torch.Tensor, residual: torch.Tensor):
        fused_add_rmsnorm(x, residual, self.weight, self.eps)
        return x, residual

    return forward, forward_add
