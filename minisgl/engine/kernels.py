"""The engine's kernel plan: made once at start-up, after the weights load and the attention
backend is chosen, and before any graph is captured (layers/kernel_plan.py says what it
holds). Where our GEMV may run, it is measured first (engine/kernel_choice.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minisgl.layers.kernel_plan import KernelPlan

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine
    from minisgl.engine.graph import GraphPlan


def install_kernels(engine: Engine, graphs: GraphPlan) -> KernelPlan:
    """The plan for the engine's model, measured where it needs to be, and installed on it."""
    kernels = KernelPlan.at_start(engine.device, engine.dtype, engine.attn_backend)
    kernels.install(engine.model)
    # >>> ch20 our kernels where they beat the library, measured
    from minisgl.engine.kernel_choice import choose_kernels

    choose_kernels(engine, graphs, kernels)  # installs the plan again, with what it measured
    # <<< ch20
    return kernels
