"""Programmatic dependent launch (Hopper and newer): a kernel may start while the one
before it in the stream is still finishing.

A decode step at batch 1 is a chain of short kernels, and between two of them the GPU
drains the first (its last blocks, the memory flush) before it launches and spreads out
the blocks of the second: a few microseconds per kernel for no work. A kernel launched
with `launch_pdl=True` is put on the SMs as soon as every block of the one before has
signalled (`pdl_release`, or ended), and waits inside (`pdl_wait`) until that kernel has
completed and its writes are visible. The wait comes before any load of what earlier
kernels write and any store, so every kernel's reads and writes keep stream order; where
the signal comes decides what overlaps. A short kernel signals at once, so the next is
launched and spread out while it runs. A GEMV signals once its weights are read, and reads
its first block of weights before its wait (no kernel writes weights): so the next GEMV's
weights start to stream in while this one finishes, not while it still needs the bandwidth.

Every kernel launched this way must wait before it touches what earlier kernels write;
one that never waits must not be launched this way. `MINISGL_PDL` chooses it: off (plain
launches) or on. The interpreter never takes it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.env import ENV

try:  # triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton: never asked for (pdl_enabled is False)
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the kernel before this one: its writes are visible after this."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the kernel after this one be launched (once every program has said so or ended)."""
    if PDL:
        gdc_launch_dependents()


def pdl_enabled(x: torch.Tensor) -> bool:
    """Whether kernels working on `x` are launched with programmatic dependent launch:
    MINISGL_PDL=on, on a GPU that has it."""
    if ENV.PDL.value == "off" or gdc_wait is None or not x.is_cuda:
        return False
    return torch.cuda.get_device_capability(x.device) >= (9, 0)


def pdl_launch(pdl: bool) -> dict:
    """The launch options of a kernel that takes PDL as its constexpr: PDL=pdl, and the
    launch attribute with it (the two must agree: see the module's docstring)."""
    return {"PDL": pdl, "launch_pdl": True} if pdl else {"PDL": False}
