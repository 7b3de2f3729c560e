"""The engine's kernel plan: made once at start-up, after the weights load and the attention
backend is chosen, and before any graph is captured (layers/kernel_plan.py says what it
holds). Where our GEMV may run, it is measured first (engine/kernel_choice.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import nn

from minisgl.layers.kernel_plan import KernelPlan

if TYPE_CHECKING:
    from minisgl.engine.graph import GraphPlan
    from minisgl.engine.startup import EngineShape


def install_kernels(
    shape: EngineShape,
    model: nn.Module,
    backend: object,
    graphs: GraphPlan,
    forward_dummy: Callable[[], object],
) -> KernelPlan:
    """The plan for the engine's model, measured where it needs to be, and installed on it
    (`forward_dummy`: one decode forward of the dummy request, which the measurement records)."""
    kernels = KernelPlan.at_start(shape.device, shape.dtype, backend)
    kernels.install(model)
    # >>> ch20 our kernels where they beat the library, measured
    from minisgl.engine.kernel_choice import Probe, choose_kernels

    probe = Probe(model, shape.device, shape.dtype, shape.config.max_prefill_length, forward_dummy)
    choose_kernels(probe, graphs, kernels)  # installs the plan again, with what it measured
    # <<< ch20
    return kernels
