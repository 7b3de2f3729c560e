"""Presence, frequency and repetition penalties, computed from the tokens on the device.

Counting from the token pool rather than from the host's copy of each request matters for
overlap scheduling: when a step is sampled, the host may not have seen the previous
step's token yet, but the token pool on the device always has it.

Only the tokens a request has seen change, so the penalties work on those: the logits of
a row's tokens so far are gathered, penalised and written back in place. Nothing as large
as the logits is built, and the sampler after them reads the logits once, as without.
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
    tokens: torch.Tensor  # [bs, width] int64: every token so far, prompt first; past a row's
    # end, its first token again (the same value is written there twice)
    output_counts: torch.Tensor  # [bs, width]: occurrences of each among generated tokens


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
    tokens = torch.where(known, tokens, tokens[:, :1])
    counts = output_counts(tokens, known & (pos >= prompt_lens), vocab)
    return Penalties(presence, frequency, repetition, tokens, counts)


def output_counts(tokens: torch.Tensor, generated: torch.Tensor, vocab: int) -> torch.Tensor:
    """How often each of `tokens` [bs, width] occurs where `generated`, as floats: counted in
    the generated tokens sorted (the others as `vocab`, which sorts last), not in a tensor
    as large as the logits."""
    ordered = torch.where(generated, tokens, vocab).sort(dim=-1).values
    after = torch.searchsorted(ordered, tokens, right=True)
    return (after - torch.searchsorted(ordered, tokens)).float()


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """The penalised logits, written over `logits` (which is returned)."""
    seen = logits.gather(1, p.tokens)
    repeated = torch.where(seen > 0, seen / p.repetition, seen * p.repetition)
    counts = p.output_counts
    penalised = repeated - p.frequency * counts - p.presence * (counts > 0).float()
    return logits.scatter_(1, p.tokens, penalised)
