"""Accepting drafts so that the output is exactly what the model alone would produce.

Request i's rows of a verify forward are its last sampled token and its k_i drafts d_1..d_k;
row j's logits are the model's distribution p_j for the token after them, the token whose
draft is d_{j+1}. Row by row, from the first:

- greedy: d_{j+1} is accepted while it equals the argmax of p_j. At the first mismatch, or
  after the last draft, the argmax itself is the next token. The tokens are those of plain
  greedy decoding, one for one.
- sampling: d_{j+1} is accepted with probability p_j(d_{j+1}). Rejected, the next token is
  drawn from p_j with d_{j+1} taken out (renormalised); all accepted, from p_k. A draft that
  is a fixed guess q (all its mass on d) makes this the rejection step of speculative
  sampling, min(1, p/q) and then max(0, p - q) renormalised, so every token is distributed
  exactly as p. The randomness is keyed by (seed, position), as in plain sampling: a seed
  gives the same tokens again.

p_j is the distribution plain sampling would draw from: logit_bias, temperature, top-k,
top-p. Penalties change with every token, so requests with penalties bring no drafts: they
have one row, and the penalties apply to it as in a decode step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.core import Req
from minisgl.engine.bias import apply_logit_bias, gather_logit_bias
from minisgl.engine.penalty import apply_penalties, gather_penalties
from minisgl.engine.sample import argmax, gumbel_noise, prepare_sampling, warp
from minisgl.utils import to_device

ACCEPT_SALT = 0x5BD1E995  # the acceptance draws use a stream apart from the sampling noise


def accept_drafts(
    logits: torch.Tensor, reqs: list[Req], drafts: list[list[int]], token_pool: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [sum(1 + k_i), vocab], request by request -> (accepted drafts [bs] int64,
    the token after them [bs] int32), both on the device. Each request's `cached_len` is
    the position of its first row's token."""
    device, vocab = logits.device, logits.size(-1)
    counts = [len(d) for d in drafts]
    width = max(max(counts), 1)
    starts, rows = 0, []
    for k in counts:
        rows.append([starts + min(j, k) for j in range(width + 1)])
        starts += k + 1
    padded = [t for d in drafts for t in d + [-1] * (width - len(d))]
    valid = [int(j < k) for k in counts for j in range(width)]
    flat = [i for r in rows for i in r]
    host = to_device(flat + padded + valid, device, torch.int64)  # one copy for the three
    index, guess, valid_d = host.split([len(flat), len(padded), len(valid)])
    index = index.view(-1, width + 1)  # [bs, width + 1]: the logits row of each step
    guess = guess.view(-1, width)  # [bs, width]: d_1, d_2, ..., -1 where there are fewer
    valid_d = valid_d.view(-1, width).bool()

    expanded = [r for r, k in zip(reqs, counts) for _ in range(k + 1)]
    logits = apply_logit_bias(logits, gather_logit_bias(expanded, device))
    penalties = gather_penalties(reqs, token_pool, vocab)
    if penalties is not None:  # requests with penalties have one row: the first
        first = index[:, 0]
        logits = logits.index_put((first,), apply_penalties(logits[first], penalties))
    args = prepare_sampling(expanded, vocab, device)
    if args.greedy:
        target = logits.argmax(dim=-1)[index]  # [bs, width + 1]
        ok = (target[:, :width] == guess) & valid_d
        accepted = ok.long().cumprod(dim=1).sum(dim=1)
        return accepted, target.gather(1, accepted[:, None])[:, 0].to(torch.int32)

    warped = warp(logits, args)
    # A greedy request's distribution is all on its argmax.
    top = logits.argmax(dim=-1, keepdim=True)
    onehot = torch.full_like(warped, float("-inf")).scatter(1, top, 0.0)
    assert args.is_greedy is not None and args.seeds is not None
    warped = torch.where(args.is_greedy[:, None], onehot, warped)
    probs = warped.softmax(dim=-1)

    seeds = to_device([r.seed for r in reqs], device, torch.int64)
    first_pos = to_device([r.cached_len + 1 for r in reqs], device, torch.int64)
    steps = torch.arange(width, device=device)
    positions = first_pos[:, None] + steps  # [bs, width]: of each draft's token
    uniform = _uniform(seeds, positions)
    p_guess = probs[index[:, :width], guess.clamp(min=0)]
    ok = (uniform < p_guess) & valid_d
    accepted = ok.long().cumprod(dim=1).sum(dim=1)

    final = warped[index.gather(1, accepted[:, None])[:, 0]]  # [bs, vocab]
    final = without_rejected(final, guess, accepted, accepted < valid_d.sum(dim=1))
    noise = gumbel_noise(seeds, first_pos + accepted, vocab)
    return accepted, (final + noise).argmax(dim=-1).to(torch.int32)


@dataclass
class VerifyRows:
    """Where each request's rows lie in a verify batch, on the device: its first row, its
    drafts, and the flat place in the token pool of its first draft. A verify launched ahead
    of the one before it also has its guard: that verify's output (accepted, token), and the
    drafts it had and the token this one assumed it would make, each [bs]."""

    starts: torch.Tensor  # [bs] int64
    counts: torch.Tensor  # [bs] int64
    after: torch.Tensor  # [bs] int64
    width: int  # the most drafts of any request
    guard: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def accept_into_pool(
    logits: torch.Tensor,
    ids: torch.Tensor,
    reqs: list[Req],
    drafts: list[list[int]],
    pool: torch.Tensor,
    rows: VerifyRows,
) -> torch.Tensor:
    """`accept_drafts`, with the token after the accepted drafts written into the token pool
    in place of the first rejected one -> [2, bs] int64 on the device: the accepted counts,
    then those tokens, for the host to read in one copy. `ids` are the verify's input ids.
    A guarded request whose guard failed (the verify before it took fewer drafts, or made
    another token) gets -1, -1 and puts that verify's token back where its guess was.

    Where every request decodes greedily, plainly (no bias, no penalties), the drafts it
    checks are its own input ids one row on, and on a GPU one small kernel after the argmax
    does the walk and the write (kernels/accept.py): three launches in place of a dozen."""
    plain = all(
        r.sampling_params.is_greedy
        and not r.sampling_params.logit_bias
        and not r.sampling_params.has_penalties
        for r in reqs
    )
    from minisgl.layers.triton_ops import triton_accept  # triton is slow to import

    if plain and (kernel := triton_accept(logits)) is not None:
        where = (rows.starts, rows.counts, rows.after, pool.view(-1))
        return kernel(argmax(logits), ids, *where, rows.width, rows.guard)
    accepted, final = accept_drafts(logits, reqs, drafts, pool)
    out = torch.stack([accepted, final.long()])
    where = rows.after + accepted
    if rows.guard is not None:
        before, expect, guess = rows.guard
        ok = (before[0] == expect) & (before[1] == guess)
        out = torch.where(ok, out, -1)
        final, where = torch.where(ok, final, before[1]), torch.where(ok, where, rows.after - 1)
    pool.view(-1)[where] = final.to(pool.dtype)
    return out


def without_rejected(
    logits: torch.Tensor, guess: torch.Tensor, accepted: torch.Tensor, rejected: torch.Tensor
) -> torch.Tensor:
    """Where a draft was rejected, its token taken out of the next token's distribution."""
    width = guess.size(1)
    taken = guess.gather(1, accepted.clamp(max=width - 1)[:, None]).clamp(min=0)  # [bs, 1]
    drop = torch.zeros_like(logits, dtype=torch.bool).scatter(1, taken, True)
    return logits.masked_fill(drop & rejected[:, None], float("-inf"))


def _uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Uniform (0, 1) draws [bs, n], a pure function of (seed, position): the Gumbel noise
    of one token, turned back into the uniform number it came from."""
    bs, n = positions.shape
    salted = (seeds ^ ACCEPT_SALT)[:, None].expand(bs, n).reshape(-1)
    gumbel = gumbel_noise(salted, positions.reshape(-1), 1)[:, 0]
    return torch.exp(-torch.exp(-gumbel.double())).view(bs, n)
