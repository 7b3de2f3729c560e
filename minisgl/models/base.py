"""What the engine needs from a model: one `forward()` that reads the batch from the context."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn


class BaseLLMModel(ABC, nn.Module):
    # Why the forward cannot be captured in a CUDA graph (it reads the device on the host),
    # or None when it can.
    cuda_graph_blocker: str | None = None  # [ch18]

    @abstractmethod
    def forward(self) -> torch.Tensor:
        """Logits [padded batch size, vocab] in fp32 for the current `get_global_ctx().batch`."""
