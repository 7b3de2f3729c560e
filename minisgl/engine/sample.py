"""Turning a batch of logits into next tokens: greedy, temperature, top-k, top-p, seeds.

Random sampling uses the Gumbel-max trick: adding Gumbel noise -log(-log(u)) to the
logits and taking the argmax draws exactly from softmax(logits). The uniform numbers u
come from a counter-based hash of (seed, position, token id) rather than from a stateful
generator, so a request's draw depends only on its own seed and position: the same
tokens whether it runs alone or in any batch, on any device, with no per-request loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.core import Req
from minisgl.utils import to_device

_MASK32 = 0xFFFFFFFF


@dataclass
class BatchSamplingArgs:
    greedy: bool  # every request is greedy: argmax only, and none of the tensors below
    temperatures: torch.Tensor | None = None  # [bs, 1] fp32; greedy rows hold 1 (argmax's)
    is_greedy: torch.Tensor | None = None  # [bs] bool
    top_k: torch.Tensor | None = None  # [bs] int64 (vocab size = no limit), None: no limits
    top_p: torch.Tensor | None = None  # [bs] fp32, None when every request has top_p == 1
    seeds: torch.Tensor | None = None  # [bs] int64
    positions: torch.Tensor | None = None  # [bs] int64: index of the token being drawn
    # How many of a row's largest logits top-k and top-p look at, at most: the largest top_k,
    # or the whole vocabulary (0) when a row has a top_p and no top_k.
    widest: int = 0


def prepare_sampling(reqs: list[Req], vocab_size: int, device: torch.device) -> BatchSamplingArgs:
    params = [req.sampling_params for req in reqs]
    is_greedy = [p.is_greedy for p in params]
    if all(is_greedy):
        return BatchSamplingArgs(greedy=True)  # argmax needs nothing from the host
    top_ks = [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params]
    top_ps = [p.top_p for p in params]
    temperatures = [1.0 if g else p.temperature for g, p in zip(is_greedy, params)]
    limits = [(k, p) for k, p in zip(top_ks, top_ps) if k < vocab_size or p < 1.0]
    widths = [k if k < vocab_size else 0 for k, _ in limits]
    # Two copies: the floats, and the integers (a seed needs all 64 bits).
    floats = to_device([temperatures, top_ps], device, torch.float32)
    ints = to_device(
        [is_greedy, top_ks, [req.seed for req in reqs], [req.device_len for req in reqs]],
        device,
        torch.int64,
    )
    return BatchSamplingArgs(
        greedy=False,
        temperatures=floats[0, :, None],
        is_greedy=ints[0].bool(),
        top_k=ints[1] if any(k < vocab_size for k in top_ks) else None,
        top_p=floats[1] if any(p < 1.0 for p in top_ps) else None,
        seeds=ints[2],
        positions=ints[3],
        widest=0 if 0 in widths else max(widths, default=0),
    )


def sample(logits: torch.Tensor, args: BatchSamplingArgs) -> torch.Tensor:
    """logits: [bs, vocab] fp32 -> next tokens [bs] int32."""
    if args.greedy:
        return argmax(logits).to(torch.int32)
    assert args.seeds is not None and args.positions is not None and args.is_greedy is not None
    assert args.temperatures is not None
    # >>> ch20 on a GPU, one kernel reads each row once for its token, greedy or drawn
    from minisgl.layers.triton_ops import triton_sample

    if (kernel := triton_sample(logits)) is not None:
        rows = (args.temperatures, args.is_greedy, args.seeds, args.positions)
        return kernel(logits, *rows, min_kept(logits, args)).to(torch.int32)
    # <<< ch20
    noise = gumbel_noise(args.seeds, args.positions, logits.size(-1))
    sampled = argmax(warp(logits, args) + noise)
    return torch.where(args.is_greedy, argmax(logits), sampled).to(torch.int32)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The first index of each row's maximum: [bs, vocab] -> [bs] int64."""
    # >>> ch20 on a GPU, our two-pass kernel: torch's reads a whole row with one SM
    from minisgl.layers.triton_ops import triton_argmax

    if (kernel := triton_argmax(logits)) is not None:
        return kernel(logits)
    # <<< ch20
    return logits.argmax(dim=-1)


def warp(logits: torch.Tensor, args: BatchSamplingArgs) -> torch.Tensor:
    """The logits whose softmax a non-greedy row draws from: temperature, top-k, top-p."""
    scaled = logits / args.temperatures
    floor = min_kept(logits, args)
    return scaled if floor is None else scaled.masked_fill(logits < floor, float("-inf"))


def min_kept(logits: torch.Tensor, args: BatchSamplingArgs) -> torch.Tensor | None:
    """Per row, the smallest logit that top-k and top-p keep [bs, 1]; None: no row has limits.

    A threshold, not a mask: tokens of equal logit are kept or dropped together, and the
    kernel of the GPU path drops what lies below it as it reads the row. Top-k keeps the
    logits that reach the k-th largest. Top-p keeps the smallest set of most likely tokens
    whose probability reaches top_p: a token is dropped when the tokens ranked above it
    already reach top_p, so the top one always stays. Only the `widest` largest logits of a
    row are sorted; with no top_k to bound them, all of them.
    """
    if args.top_k is None and args.top_p is None:
        return None
    vocab, width = logits.size(-1), args.widest or logits.size(-1)
    if width < vocab:
        values = logits.topk(width, dim=-1).values
    else:
        values = logits.sort(dim=-1, descending=True).values
    floor = torch.full_like(values[:, :1], float("-inf"))
    if args.top_k is not None:  # rows without a limit have top_k == vocab
        kth = values.gather(1, (args.top_k.clamp(max=width) - 1)[:, None])
        floor = torch.where(args.top_k[:, None] <= width, kth, floor)
    if args.top_p is not None:
        floor = _top_p_floor(logits, values, floor, args.temperatures, args.top_p[:, None])
    return floor


def _top_p_floor(
    logits: torch.Tensor,
    values: torch.Tensor,
    floor: torch.Tensor,
    temperatures: torch.Tensor,
    top_p: torch.Tensor,
) -> torch.Tensor:
    # values: each row's largest logits, sorted; floor: what top-k keeps. The probabilities
    # are those of the logits top-k keeps, scaled by the temperature.
    scaled = values.masked_fill(values < floor, float("-inf")) / temperatures
    top = scaled[:, :1].clamp(min=torch.finfo(scaled.dtype).min)  # a row all -inf: no nan
    weights = (scaled - top).exp()
    total = weights.sum(dim=-1, keepdim=True)
    if values.size(-1) < logits.size(-1):  # the k-th logit's ties beyond the sorted ones
        ties = (logits >= floor).sum(-1, keepdim=True) - (values >= floor).sum(-1, keepdim=True)
        total = total + ties * (floor / temperatures - top).exp()
    mass_above = (weights.cumsum(dim=-1) - weights) / total
    kept = (mass_above < top_p).sum(dim=-1, keepdim=True).clamp(min=1)
    nucleus = values.gather(1, kept - 1)
    return torch.where(top_p < 1.0, torch.maximum(floor, nucleus), floor)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [bs, vocab], a pure function of (seed, position, token id)."""
    token_ids = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    key = _hash32(_hash32((seeds ^ (seeds >> 32)) & _MASK32) ^ _hash32(positions & _MASK32))
    bits = _hash32((key[:, None] + token_ids[None, :] * 0x9E3779B1) & _MASK32)
    uniform = (bits.double() + 0.5) / 2.0**32  # strictly inside (0, 1)
    return -torch.log(-torch.log(uniform)).float()


def _hash32(x: torch.Tensor) -> torch.Tensor:
    # An integer mixing function (xor-shift / multiply rounds) on 32-bit values held in
    # int64; every product stays below 2**63, so nothing overflows.
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x
