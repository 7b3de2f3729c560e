"""The attention backends by name, and the choice behind `--attn auto`.

Each backend class declares the devices it runs on, whether its decode can be captured in
a CUDA graph, and why it cannot run with given settings (a missing package, a dtype or a
page size it does not take). Adding a backend is one file and one line in `BACKENDS`.

`auto` takes the first backend that can run, in the order benchmarks measured fastest on
the device at hand (`MEASURED`), and in the order of `BACKENDS` on a device no benchmark
has run on; it logs the choice and the figures behind it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minisgl.attention import NAMES
from minisgl.attention.base import BaseAttnBackend
from minisgl.attention.fa import FlashAttnBackend  # [ch20]
from minisgl.attention.fi import FlashInferBackend  # [ch19]
from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.attention.triton_backend import TritonAttnBackend  # [ch20]

logger = logging.getLogger(__name__)

# Best first: `auto` takes the first that can run; the torch backend runs everywhere.
BACKENDS: dict[str, type[BaseAttnBackend]] = {
    cls.name: cls
    for cls in (
        FlashInferBackend,  # [ch19]
        TritonAttnBackend,  # [ch20]
        FlashAttnBackend,  # [ch20]
        TorchAttnBackend,
    )
}


@dataclass(frozen=True)
class Measured:
    """Which backends were fastest on one kind of GPU, best first, and the figures why."""

    device: str  # a part of torch.cuda.get_device_name(), e.g. "H200"
    capability: tuple[int, int]
    order: tuple[str, ...]
    why: str


MEASURED: tuple[Measured, ...] = (
    # >>> ch20 our Triton kernels against FlashInfer
    Measured(
        "H200",
        (9, 0),
        ("triton", "fi"),
        "measured on the H200 (docs/benchmarks.md), Qwen3-0.6B shape: triton 0.96 vs fi "
        "1.08 ms/token at batch 1, 1.78 vs 2.02 ms/step at batch 64, and no FlashInfer JIT at "
        "start-up (14-63 s on a fresh machine); fi is faster only at a 32K-token prefill "
        "(TTFT 466 vs 652 ms)",
    ),
    # <<< ch20
)


assert tuple(BACKENDS) == NAMES, "attention/__init__.py names the backends of BACKENDS"


def backend_names() -> list[str]:
    return ["auto", *NAMES]


# >>> ch28
def reads_fp8_kv(name: str) -> bool:
    """Whether `--attn name` can run on an FP8 KV cache (auto: it picks one that can)."""
    return name == "auto" or (name in BACKENDS and BACKENDS[name].reads_fp8_kv)


# <<< ch28
def select_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    page_size: int,
    fp8_kv: bool = False,  # the cache holds e4m3 keys and values, which not all read  # [ch28]
) -> type[BaseAttnBackend]:
    """The backend class for `name`, or a ValueError that says why it cannot run here."""

    def why_not(cls: type[BaseAttnBackend]) -> str:
        if fp8_kv and not cls.reads_fp8_kv:  # [ch28]
            return "it does not read an FP8 KV cache"  # [ch28]
        return cls.unavailable_reason(device, dtype, page_size)

    if name == "auto":
        return _auto(device, why_not)
    if name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose from {', '.join(backend_names())}"
        )
    if reason := why_not(BACKENDS[name]):
        raise ValueError(f"attention backend {name!r} cannot run here: {reason}")
    return BACKENDS[name]


def _auto(
    device: torch.device, why_not: Callable[[type[BaseAttnBackend]], str]
) -> type[BaseAttnBackend]:
    measured = _measured(device)
    order = [n for n in measured.order if n in BACKENDS] if measured else []
    why = measured.why if measured else "no benchmark ran on this GPU: the default order"
    why = "" if device.type != "cuda" else f"; {why}"
    for name in order + [n for n in BACKENDS if n not in order]:
        cls = BACKENDS[name]
        if device.type not in cls.auto_devices:
            continue
        reason = why_not(cls)
        if not reason:
            logger.info("attention backend: %s (auto%s)", name, why)
            return cls
        logger.info("attention backend %s passed over: %s", name, reason)
    raise AssertionError("the torch backend runs on every device")


def _measured(device: torch.device) -> Measured | None:
    """The benchmarks' entry for this GPU, or None (a CPU, or a GPU not measured)."""
    gpu = gpu_model(device) if device.type == "cuda" else None
    if gpu is None:
        return None
    return next((m for m in MEASURED if m.device in gpu[0] and m.capability == gpu[1]), None)


def gpu_model(device: torch.device) -> tuple[str, tuple[int, int]] | None:
    """(name, compute capability) of a CUDA device; None where torch sees none."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
