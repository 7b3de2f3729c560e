"""Programmatic dependent launch (Hopper and newer): a kernel may start while the one
before it in the stream is still finishing.

A decode step at batch 1 is a chain of short kernels, and between two of them the GPU
drains the first (its last blocks, the memory flush) before it launches and spreads out
the blocks of the second: a few microseconds per kernel for no work. A kernel launched
with `launch_pdl=True` is put on the SMs as soon as every block of the one before has
signalled (`gdc_launch_dependents`), and waits inside (`gdc_wait`) until that kernel has
completed and its writes are visible. Waiting first, before any load or store, keeps
every kernel's reads and writes in stream order; what overlaps is only the launch and
what a kernel does before its wait (a GEMV's first loads of weights, which no kernel
writes).

Every kernel launched this way must wait before it touches what earlier kernels write;
one that never waits must not be launched this way. `MINISGL_PDL` chooses it: off (plain
launches), on, or early: the GEMV also reads its first block of weights before its wait.
The interpreter on a CPU never takes it.
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
    """Wait for the kernel before this one, then let the one after this be launched."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_mode(x: torch.Tensor) -> str:
    """How kernels working on `x` are launched: "off", "on" or "early" (`MINISGL_PDL` where
    the GPU has programmatic dependent launch, else "off")."""
    if ENV.PDL.value == "off" or gdc_wait is None or not x.is_cuda:
        return "off"
    return ENV.PDL.value if torch.cuda.get_device_capability(x.device) >= (9, 0) else "off"


def pdl_enabled(x: torch.Tensor) -> bool:
    """Whether kernels working on `x` are launched with programmatic dependent launch."""
    return pdl_mode(x) != "off"


def pdl_launch(pdl: bool) -> dict:
    """The launch options of a kernel that takes PDL as its constexpr: PDL=pdl, and the
    launch attribute with it (the two must agree: see the module's docstring)."""
    return {"PDL": pdl, "launch_pdl": True} if pdl else {"PDL": False}
