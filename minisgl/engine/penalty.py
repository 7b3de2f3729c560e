"""Presence, frequency and repetition penalties, computed from the tokens on the device.

Counting from the token pool rather than from the host's copy of each request matters for
overlap scheduling: when a step is sampled, the host may not have seen the previous
step's token yet, but the token pool on the device always has it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.core import Req
from minisgl.utils import to_device


@dataclass
class Penalties:
    presence: torch.Tensor  # [bs, 1]: subtracted once from every token already generated
    frequency: torch.Tensor  # [bs, 1]: subtracted per occurrence in the output
    repetition: torch.Tensor  # [bs, 1]: divides (or multiplies, if negative) seen tokens' logits
    output_counts: torch.Tensor  # [bs, vocab]: occurrences among generated tokens
    seen: torch.Tensor  # [bs, vocab] bool: appears in prompt or output


def gather_penalties(reqs: list[Req], token_pool: torch.Tensor, vocab: int) -> Penalties | None:
    params = [req.sampling_params for req in reqs]
    if not any(p.has_penalties for p in params):
        return None
    device = token_pool.device
    columns = [
        [req.device_len for req in reqs],
        [req.prompt_len for req in reqs],
        [p.presence_penalty for p in params],
        [p.frequency_penalty for p in params],
        [p.repetition_penalty for p in params],
    ]
    host = to_device(columns, device, torch.float32)[:, :, None]  # one copy for the five
    lengths, prompt_lens, presence, frequency, repetition = host
    rows = to_device([req.table_idx for req in reqs], device, torch.int64)
    width = max(req.device_len for req in reqs)
    tokens = token_pool[rows, :width].long()  # every token so far, prompt first
    pos = torch.arange(width, device=device, dtype=torch.float32)[None, :]
    known = pos < lengths
    generated = known & (pos >= prompt_lens)
    zeros = torch.zeros(len(reqs), vocab, device=device)
    return Penalties(
        presence=presence,
        frequency=frequency,
        repetition=repetition,
        output_counts=zeros.scatter_add(1, tokens, generated.float()),
        seen=zeros.scatter_add(1, tokens, known.float()) > 0,
    )


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    repeated = torch.where(logits > 0, logits / p.repetition, logits * p.repetition)
    logits = torch.where(p.seen, repeated, logits)
    return logits - p.frequency * p.output_counts - p.presence * (p.output_counts > 0).float()
