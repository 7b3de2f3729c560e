"""Steering the logits before sampling: OpenAI's logit_bias, and grammar token masks.

Both work on the device, after the model and before the sampler, and both make new tensors
instead of writing into the logits: under a CUDA graph the logits are the graph's static
output buffer, and the forward stays the same graph whatever the requests ask for. A bias
adds a number to a few tokens of one request; a mask sets every token that a request's
grammar forbids next to -inf. Rows of requests that use neither are left as they were, so
those requests sample exactly the tokens they would get alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.core import Req
from minisgl.utils import to_device


@dataclass
class LogitBias:
    rows: torch.Tensor  # [n] int64: the batch row of each (request, token) pair
    tokens: torch.Tensor  # [n] int64
    values: torch.Tensor  # [n] fp32: added to that row's logit of that token


def gather_logit_bias(reqs: list[Req], device: torch.device) -> LogitBias | None:
    if not any(r.sampling_params.logit_bias for r in reqs):
        return None
    biased = [(i, r.sampling_params.logit_bias) for i, r in enumerate(reqs)]
    rows = [i for i, bias in biased for _ in bias]  # empty biases add nothing
    tokens = [token for _, bias in biased for token in bias]
    values = [value for _, bias in biased for value in bias.values()]
    where = to_device([rows, tokens], device, torch.int64)  # one copy for both
    return LogitBias(where[0], where[1], to_device(values, device, torch.float32))


def apply_logit_bias(logits: torch.Tensor, bias: LogitBias | None) -> torch.Tensor:
    if bias is None:
        return logits
    return logits.index_put((bias.rows, bias.tokens), bias.values, accumulate=True)


@dataclass
class TokenMask:
    """The tokens some rows of a batch may sample next, packed 32 to an int32 word."""

    rows: torch.Tensor  # [n] int64: the batch rows it constrains
    bits: torch.Tensor  # [n, ceil(vocab / 32)] int32: bit j of word w allows token 32 * w + j

    @classmethod
    def from_host(cls, rows: list[int], bits: torch.Tensor, device: torch.device) -> TokenMask:
        return cls(to_device(rows, device, torch.int64), to_device(bits, device))


def apply_token_mask(logits: torch.Tensor, mask: TokenMask | None) -> torch.Tensor:
    if mask is None:
        return logits
    vocab = logits.size(-1)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    # An arithmetic shift keeps the sign bit on the left, but `& 1` reads only bit j.
    allowed = ((mask.bits[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab]
    keep = torch.ones_like(logits, dtype=torch.bool)
    keep[mask.rows] = allowed
    return logits.masked_fill(~keep, float("-inf"))
