"""Sampling a batch in one read of the logits: the argmax and the Gumbel-max draw together.

`engine/sample.py` draws with the Gumbel-max trick: argmax(logits / T + noise), the noise a
pure function of (seed, position, token id). In torch that is a division (a copy of the
logits), a noise tensor as large as the logits built in several passes, an add and two
argmaxes, one for greedy rows and one for sampled rows. Here each program reads one chunk
of one row once, makes the noise in registers from the same integer hash, and keeps the
chunk's winner: the first index of the maximum for a greedy row, of logits / T + noise
for a sampled one. The argmax kernel's second pass then picks each row's winner among its
chunks, so a row gets the token the torch path gives it, bit for bit.

Bit for bit takes care. Torch turns the hash into noise in fp64, -log(-log(u)), rounded to
fp32; fp64 logarithms for every logit would cost more than reading them. So the chunk is
scored in fp32 with noise a few millionths off, and only the logits whose fp32 score comes
within a safe margin of the chunk's best (nearly always one) are scored again exactly, as
torch does. Any logit that could win is among them, so the winner is torch's. A chunk
with many near-ties (huge logits, where the noise is below the fp32 spacing) is scored
exactly throughout, a rare and slower path that is still right.

Top-k and top-p come as one threshold a row, the smallest logit they keep (worked out
beforehand by `engine/sample.py`'s `min_kept`); the chunk drops what lies below it in the
same read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.argmax import _row_max_kernel

CHUNK = 4096  # logits per program: 38 programs a row for a 151,936-word vocabulary
MAX_RESCORED = 8  # near-winners scored exactly one by one; more: the whole chunk exactly
# |fp32 score - exact score| is below ~1e-5 + 4e-7 * |score| (the logs and the division
# in fp32, two roundings of the sum); a logit within twice that of the best may be the
# winner. The margin below is three to ten times that.
MARGIN = (2.0**-14, 2.0**-17)  # absolute, and relative to the best score


@triton.jit
def _hash32(x):
    # engine/sample.py's _hash32 on uint32, where a product wraps as the int64 one is masked.
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _token_bits(seed, position, tokens):
    """The 32 random bits of each token id: gumbel_noise's hash of (seed, position, id)."""
    key = _hash32(_hash32((seed ^ (seed >> 32)).to(tl.uint32)) ^ _hash32(position.to(tl.uint32)))
    return _hash32(key + tokens.to(tl.uint32) * 0x9E3779B1)


@triton.jit
def _exact_noise(bits):
    # As torch computes it: u = (bits + 0.5) / 2**32 and -log(-log(u)) in fp64, then fp32.
    uniform = (bits.to(tl.float64) + 0.5) * (1.0 / 4294967296.0)
    return (-tl.log(-tl.log(uniform))).to(tl.float32)


@triton.jit
def _fast_noise(bits):
    # The same noise in fp32 to within ~2e-6. -log(u) is taken from the nearer end: log(u)
    # below one half; above it, -log(1 - c) = 2 atanh(c / (2 - c)) from c = 1 - u, exact in
    # fp32 from the complement of the bits, so the largest noise (u near 1) keeps its digits.
    low = (bits.to(tl.float32) + 0.5) * (1.0 / 4294967296.0)
    c = ((bits ^ 0xFFFFFFFF).to(tl.float32) + 0.5) * (1.0 / 4294967296.0)
    s = c / (2.0 - c)  # at most 1/3: seven terms of the series are enough
    s2 = s * s
    series = 1.0 / 13.0
    series = 1.0 / 11.0 + s2 * series
    series = 1.0 / 9.0 + s2 * series
    series = 1.0 / 7.0 + s2 * series
    series = 1.0 / 5.0 + s2 * series
    series = 1.0 / 3.0 + s2 * series
    series = 1.0 + s2 * series
    minus_log_u = tl.where(bits < 0x80000000, -tl.log(low), 2.0 * s * series)
    return -tl.log(minus_log_u)


@triton.jit
def _sample_chunk_kernel(
    X,
    TEMPERATURES,
    IS_GREEDY,
    SEEDS,
    POSITIONS,
    MIN_KEPT,
    VALUES,
    INDICES,
    N,
    stride_x,
    stride_t,
    stride_m,
    CHUNKS,
    HAS_MIN: tl.constexpr,
    BLOCK: tl.constexpr,
    MARGIN_ABS: tl.constexpr,
    MARGIN_REL: tl.constexpr,
    RESCORED: tl.constexpr,
):
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    inside = offs < N
    row_x = X + row * stride_x
    x = tl.load(row_x + offs, mask=inside, other=float("-inf")).to(tl.float32)
    if tl.load(IS_GREEDY + row):
        value, index = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        index = (chunk * BLOCK + index).to(tl.int64)
    else:
        temperature = tl.load(TEMPERATURES + row * stride_t)
        seed, position = tl.load(SEEDS + row), tl.load(POSITIONS + row)
        kept = x >= (tl.load(MIN_KEPT + row * stride_m) if HAS_MIN else float("-inf"))
        score = x * (1.0 / temperature) + _fast_noise(_token_bits(seed, position, offs))
        score = tl.where(kept, score, float("-inf"))
        best = tl.max(score, 0)
        margin = MARGIN_ABS + tl.abs(best) * MARGIN_REL
        cutoff = tl.where(best == float("inf"), best, best - margin)
        near = (score >= cutoff) & (score > float("-inf"))
        count = tl.sum(near.to(tl.int32), 0)
        # No candidate: every logit of the chunk is -inf (or dropped); the first one stands.
        value = tl.full((), float("-inf"), tl.float32)
        index = (chunk * BLOCK).to(tl.int64)
        if count <= RESCORED:
            rest = tl.where(near, score, float("-inf"))
            for _ in range(count):
                _, local = tl.max(rest, 0, return_indices=True)
                at = (chunk * BLOCK + local).to(tl.int64)
                # as torch rounds it: x / T, then + noise (a candidate is a kept logit)
                exact = tl.div_rn(tl.load(row_x + at).to(tl.float32), temperature)
                exact += _exact_noise(_token_bits(seed, position, at))
                better = (exact > value) | ((exact == value) & (at < index))
                value = tl.where(better, exact, value)
                index = tl.where(better, at, index)
                rest = tl.where(tl.arange(0, BLOCK) == local, float("-inf"), rest)
        else:
            exact = tl.div_rn(x, temperature) + _exact_noise(_token_bits(seed, position, offs))
            exact = tl.where(kept, exact, float("-inf"))
            value, local = tl.max(exact, 0, return_indices=True, return_indices_tie_break_left=True)
            index = (chunk * BLOCK + local).to(tl.int64)
    tl.store(VALUES + row * CHUNKS + chunk, value)
    tl.store(INDICES + row * CHUNKS + chunk, index)


def sample_rows(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    is_greedy: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    min_kept: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row [rows] int64, as engine/sample.py's torch path draws it.

    logits [rows, n] (last dimension contiguous) fp32, or bf16/fp16 as if turned into fp32
    first (the same tokens, without the copy); temperatures [rows, 1] fp32;
    is_greedy [rows] bool; seeds, positions [rows] int64; min_kept [rows, 1] fp32 or None:
    a sampled row draws among its logits >= min_kept only.
    """
    rows, n = logits.shape
    assert logits.stride(-1) == 1 and is_greedy.is_contiguous()
    assert seeds.is_contiguous() and positions.is_contiguous()
    chunks = triton.cdiv(n, CHUNK)
    values = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows, chunks, dtype=torch.int64, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        has_min = min_kept is not None
        _sample_chunk_kernel[(rows, chunks)](
            logits,
            temperatures,
            is_greedy,
            seeds,
            positions,
            min_kept if has_min else temperatures,
            values,
            indices,
            n,
            logits.stride(0),
            temperatures.stride(0),
            (min_kept if has_min else temperatures).stride(0),
            chunks,
            HAS_MIN=has_min,
            BLOCK=CHUNK,
            MARGIN_ABS=MARGIN[0],
            MARGIN_REL=MARGIN[1],
            RESCORED=MAX_RESCORED,
            num_warps=8,
        )
        _row_max_kernel[(rows,)](
            values, indices, out, chunks, BLOCK_C=triton.next_power_of_2(chunks), num_warps=1
        )
    return out
