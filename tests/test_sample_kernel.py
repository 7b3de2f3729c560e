"""The one-read sampling kernel gives the tokens of engine/sample.py's torch path, exactly.

Not close: the same token ids, row by row, for greedy and drawn rows mixed, over many seeds,
positions and temperatures, with top-k/top-p thresholds, ties and -inf logits. On CPU in
Triton's interpreter (tests/conftest.py turns it on without a GPU); on a GPU the torch path
runs on the GPU too, against the kernel that `sample` takes there.
"""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from minisgl.engine.sample import BatchSamplingArgs, gumbel_noise, min_kept, warp
from minisgl.kernels.sample import (
    CHUNK,
    MARGIN,
    MAX_RESCORED,
    _exact_noise,
    _fast_noise,
    sample_rows,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or Triton's interpreter",
)
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@triton.jit
def _noise_kernel(BITS, FAST, EXACT, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bits = tl.load(BITS + offs).to(tl.uint32)
    tl.store(FAST + offs, _fast_noise(bits))
    tl.store(EXACT + offs, _exact_noise(bits))


def batch_args(rows: int, gen: torch.Generator, greedy_share: float = 0.25) -> BatchSamplingArgs:
    """Random temperatures (0.05 to 3), 64-bit seeds and positions, some greedy rows."""
    is_greedy = torch.rand(rows, generator=gen) < greedy_share
    temperatures = torch.rand(rows, 1, generator=gen) * 2.95 + 0.05
    temperatures[is_greedy] = 1.0
    return BatchSamplingArgs(
        greedy=False,
        temperatures=temperatures.to(DEV),
        is_greedy=is_greedy.to(DEV),
        seeds=torch.randint(-(2**63), 2**63 - 1, (rows,), generator=gen).to(DEV),
        positions=torch.randint(0, 2**40, (rows,), generator=gen).to(DEV),
    )


def torch_path(logits: torch.Tensor, args: BatchSamplingArgs) -> list[int]:
    """engine/sample.py's tokens without the GPU kernel: warp, noise, argmax."""
    assert args.is_greedy is not None and args.seeds is not None and args.positions is not None
    noise = gumbel_noise(args.seeds, args.positions, logits.size(-1))
    sampled = (warp(logits, args) + noise).argmax(dim=-1)
    return torch.where(args.is_greedy, logits.argmax(dim=-1), sampled).tolist()


def kernel(logits: torch.Tensor, args: BatchSamplingArgs) -> list[int]:
    assert args.temperatures is not None and args.is_greedy is not None
    assert args.seeds is not None and args.positions is not None
    rows = (args.temperatures, args.is_greedy, args.seeds, args.positions)
    tokens = sample_rows(logits, *rows, min_kept(logits, args))
    assert tokens.dtype == torch.int64
    return tokens.tolist()


@pytest.mark.parametrize("vocab", [1000, CHUNK, 2 * CHUNK + 977])
def test_tokens_equal_the_torch_path(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    for scale in (0.3, 3.0, 30.0):  # flat to peaked: the noise decides, or the logits do
        logits = (torch.randn(48, vocab, generator=gen) * scale).to(DEV)
        args = batch_args(48, gen)
        assert kernel(logits, args) == torch_path(logits, args)


def test_many_draws_of_one_row_equal_the_torch_path() -> None:
    # One row, 256 seeds and positions: the kernel's fp32 noise must never pick another token.
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(1, 1500, generator=gen) * 2).expand(256, -1).contiguous().to(DEV)
    args = batch_args(256, gen, greedy_share=0.0)
    tokens = kernel(logits, args)
    assert tokens == torch_path(logits, args)
    assert len(set(tokens)) > 50  # and they are draws, not one token


def test_bf16_logits_with_many_ties() -> None:
    # Logits that came out of bf16 hold few distinct values: ties everywhere, greedy ties
    # across chunks too. The first index of the maximum wins, as in torch. The kernel reads
    # the bf16 logits as they are, with the tokens of their fp32 copy.
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(32, 2 * CHUNK + 5, generator=gen) * 4).bfloat16().to(DEV)
    logits[:, [7, CHUNK + 3, 2 * CHUNK + 1]] = 30.0  # three maxima in three chunks
    args = batch_args(32, gen, greedy_share=0.5)
    tokens = kernel(logits, args)
    assert tokens == torch_path(logits.float(), args)
    greedy = args.is_greedy.tolist()  # type: ignore[union-attr]
    assert [t for t, g in zip(tokens, greedy) if g] == [7] * sum(greedy)


@pytest.mark.parametrize("tied", [2, MAX_RESCORED, MAX_RESCORED + 12])
def test_scores_tied_beyond_the_noise(tied: int) -> None:
    # Logits so large that the noise is below their fp32 spacing: the scores of the tied
    # tokens come out equal and the first of them wins. A few are scored again one by one;
    # more than MAX_RESCORED send the chunk down the path that scores all of it exactly.
    gen = torch.Generator().manual_seed(tied)
    logits = torch.randn(8, 3000, generator=gen)
    places = torch.randperm(3000, generator=gen)[:tied]
    logits[:, places] = 2.0**26
    logits, args = logits.to(DEV), batch_args(8, gen, greedy_share=0.0)
    args.temperatures = torch.ones_like(args.temperatures)  # type: ignore[arg-type]
    tokens = kernel(logits, args)
    assert tokens == torch_path(logits, args)
    assert set(tokens) <= set(places.tolist())


def test_minus_infinity_logits() -> None:
    gen = torch.Generator().manual_seed(11)
    vocab = 2 * CHUNK + 300
    logits = torch.randn(6, vocab, generator=gen) * 2
    logits[0] = float("-inf")  # a whole row: token 0, as torch's argmax
    logits[1, : 2 * CHUNK] = float("-inf")  # whole chunks
    logits[2, torch.rand(vocab, generator=gen) < 0.999] = float("-inf")  # a grammar's mask
    logits[3, :] = float("-inf")
    logits[3, vocab - 1] = 0.0  # one allowed token, the last
    logits = logits.to(DEV)
    for greedy_share in (0.0, 1.0):
        args = batch_args(6, gen, greedy_share)
        tokens = kernel(logits, args)
        assert tokens == torch_path(logits, args)
        assert tokens[0] == 0 and tokens[3] == vocab - 1 and tokens[1] >= 2 * CHUNK


def test_top_k_and_top_p_thresholds() -> None:
    gen = torch.Generator().manual_seed(5)
    vocab, rows = 2 * CHUNK + 33, 40
    logits = (torch.randn(rows, vocab, generator=gen) * 3).bfloat16().float().to(DEV)  # ties
    args = batch_args(rows, gen)
    top_k = torch.randint(1, 60, (rows,), generator=gen)
    top_k[::4] = vocab  # no limit
    top_p = torch.rand(rows, generator=gen) * 0.9 + 0.05
    top_p[1::3] = 1.0
    for k, p, widest in ((top_k, None, 59), (None, top_p, 0), (top_k, top_p, 59)):
        args.top_k = None if k is None else k.to(DEV)
        args.top_p = None if p is None else p.to(DEV)
        args.widest = widest
        assert kernel(logits, args) == torch_path(logits, args)


def test_min_kept_is_top_k_and_top_p_with_ties_kept() -> None:
    # The threshold against the definitions, in float64 and one row at a time.
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(24, 300, generator=gen).bfloat16().float()
    top_k = torch.randint(1, 40, (24,), generator=gen)
    top_p = torch.rand(24, generator=gen) * 0.9 + 0.05
    temperatures = torch.rand(24, 1, generator=gen) + 0.5
    args = BatchSamplingArgs(False, temperatures, None, top_k, top_p, widest=39)
    floor = min_kept(logits, args)
    assert floor is not None
    for row, k, p, t, got in zip(logits, top_k, top_p, temperatures, floor[:, 0]):
        values = row.double().sort(descending=True).values
        kept = values[values >= values[k - 1]]  # top-k, ties of the k-th kept
        probs = (kept / t.double()).softmax(dim=0)
        above = probs.cumsum(dim=0) - probs
        margin = (above - p.double()).abs().min().item()
        if margin < 1e-5:  # at the edge float32's sums may round either way
            continue
        nucleus = kept[above < p.double()]  # those with less than top_p above them
        assert got.item() == nucleus.min().item()


def test_fast_noise_is_within_the_margin() -> None:
    # The fp32 noise that scores a chunk against the fp64 one that decides: the margin
    # (MARGIN) must cover twice the gap with room to spare, also where u is near 0 or 1.
    gen = torch.Generator().manual_seed(0)
    edges = [0, 2**31 - 2**14, 2**32 - 2**14]
    spread = torch.randint(0, 2**32, (2**16,), generator=gen)
    bits = torch.cat([torch.arange(e, e + 2**14) for e in edges] + [spread]).to(DEV)
    fast, exact = torch.empty(len(bits), device=DEV), torch.empty(len(bits), device=DEV)
    _noise_kernel[(len(bits) // 4096,)](bits, fast, exact, BLOCK=4096)
    gap = (fast - exact).abs() / (1 + exact.abs())
    assert gap.max().item() < MARGIN[0] / 8
