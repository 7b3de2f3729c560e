"""The attention backends by name, and the choice behind `--attn auto`.

Each backend class declares the devices it runs on, whether its decode can be captured in
a CUDA graph, and why it cannot run with given settings (a missing package, a dtype or a
page size it does not take). Adding a backend is one file and one line in `BACKENDS`.
"""

from __future__ import annotations

import logging

import torch

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


def backend_names() -> list[str]:
    return ["auto", *BACKENDS]


def select_backend(
    name: str, device: torch.device, dtype: torch.dtype, page_size: int
) -> type[BaseAttnBackend]:
    """The backend class for `name`, or a ValueError that says why it cannot run here."""
    if name == "auto":
        return _auto(device, dtype, page_size)
    if name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose from {', '.join(backend_names())}"
        )
    cls = BACKENDS[name]
    reason = cls.unavailable_reason(device, dtype, page_size)
    if reason:
        raise ValueError(f"attention backend {name!r} cannot run here: {reason}")
    return cls


def _auto(device: torch.device, dtype: torch.dtype, page_size: int) -> type[BaseAttnBackend]:
    for name, cls in BACKENDS.items():
        if device.type not in cls.auto_devices:
            continue
        reason = cls.unavailable_reason(device, dtype, page_size)
        if not reason:
            logger.info("attention backend: %s (auto)", name)
            return cls
        logger.info("attention backend %s passed over: %s", name, reason)
    raise AssertionError("the torch backend runs on every device")
