"""Sampling: greedy, temperature, top-k, top-p and per-request seeds."""

from __future__ import annotations

import torch

from minisgl.core import Req, SamplingParams
from minisgl.engine.penalty import apply_penalties, gather_penalties
from minisgl.engine.sample import BatchSamplingArgs, prepare_sampling, sample

VOCAB = 50


def make_req(params: SamplingParams, prompt_len: int = 4, uid: int = 0) -> Req:
    return Req(torch.arange(prompt_len, dtype=torch.int32), uid, 0, 8, uid, params)


def draw(logits: torch.Tensor, reqs: list[Req]) -> list[int]:
    return sample(logits, prepare_sampling(reqs, logits.size(-1), logits.device)).tolist()


def many_draws(
    row: torch.Tensor,
    n: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """n draws from one row of logits, each with its own seed."""
    args = BatchSamplingArgs(
        greedy=False,
        temperatures=torch.full((n, 1), temperature),
        is_greedy=torch.zeros(n, dtype=torch.bool),
        top_k=None if top_k is None else torch.full((n,), top_k),
        top_p=None if top_p is None else torch.full((n,), top_p),
        seeds=torch.arange(n, dtype=torch.int64) * 7919 + 13,
        positions=torch.full((n,), 5, dtype=torch.int64),
    )
    return sample(row.expand(n, -1).contiguous(), args)


def assert_matches(samples: torch.Tensor, probs: torch.Tensor) -> None:
    """Every token's frequency within 5 standard errors of its probability."""
    n = samples.numel()
    freq = torch.bincount(samples.long(), minlength=probs.numel()).double() / n
    sigma = (probs.double() * (1 - probs.double()) / n).sqrt()
    worst = ((freq - probs.double()).abs() - 5 * sigma - 1e-9).max().item()
    assert worst <= 0, f"empirical frequencies off by {worst:.4f} beyond 5 sigma\n{freq}\n{probs}"


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    reqs = [make_req(SamplingParams(), uid=i) for i in range(6)]
    assert draw(logits, reqs) == logits.argmax(-1).tolist()


def test_top_k_1_and_tiny_top_p_equal_greedy() -> None:
    logits = torch.randn(32, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    top_k = [make_req(SamplingParams(temperature=1.5, top_k=1), uid=i) for i in range(16)]
    top_p = [make_req(SamplingParams(temperature=1.5, top_p=1e-6), uid=i) for i in range(16)]
    assert draw(logits, top_k + top_p) == logits.argmax(-1).tolist()


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    gen = torch.Generator().manual_seed(2)
    row = torch.randn(VOCAB, generator=gen)
    params = SamplingParams(temperature=1.0, seed=1234)
    alone = draw(row[None], [make_req(params)])[0]
    others = torch.randn(5, VOCAB, generator=gen)
    mixed = [make_req(SamplingParams(temperature=0.8), uid=i) for i in range(5)]
    batch_logits = torch.cat([others[:3], row[None], others[3:]])
    in_batch = draw(batch_logits, mixed[:3] + [make_req(params)] + mixed[3:])[3]
    assert in_batch == alone
    # and the seed matters: over many seeds the draws differ
    tokens = {
        draw(row[None], [make_req(SamplingParams(temperature=1.0, seed=s))])[0] for s in range(40)
    }
    assert len(tokens) > 5


def test_unseeded_requests_differ() -> None:
    row = torch.zeros(1, VOCAB)  # uniform: any two fixed draws agreeing 40 times is ~impossible
    tokens = [draw(row, [make_req(SamplingParams(temperature=1.0))])[0] for _ in range(40)]
    assert len(set(tokens)) > 5


def test_temperature_matches_softmax() -> None:
    row = torch.randn(8, generator=torch.Generator().manual_seed(3)) * 2
    for temperature in (0.5, 1.0, 2.0):
        samples = many_draws(row, 40_000, temperature=temperature)
        assert_matches(samples, torch.softmax(row / temperature, dim=-1))


def test_top_k_renormalises_over_the_k_best() -> None:
    row = torch.randn(10, generator=torch.Generator().manual_seed(4))
    samples = many_draws(row, 40_000, top_k=3)
    probs = torch.zeros(10)
    best = row.topk(3).indices
    probs[best] = torch.softmax(row[best], dim=-1)
    assert_matches(samples, probs)


def test_top_p_keeps_the_smallest_nucleus() -> None:
    row = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0, -2.0])
    full = torch.softmax(row, dim=-1)  # ~[0.64, 0.23, 0.09, ...]
    samples = many_draws(row, 40_000, top_p=0.8)  # 0.64 < 0.8 <= 0.87: keep the top two
    probs = torch.zeros(6)
    probs[:2] = full[:2] / full[:2].sum()
    assert_matches(samples, probs)


def test_mixed_batch_greedy_rows_stay_greedy() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(5))
    reqs = [
        make_req(SamplingParams(), uid=0),
        make_req(SamplingParams(temperature=1.0, seed=1), uid=1),
        make_req(SamplingParams(), uid=2),
        make_req(SamplingParams(temperature=1.0, top_k=4, seed=2), uid=3),
    ]
    tokens = draw(logits, reqs)
    assert tokens[0] == logits[0].argmax().item()
    assert tokens[2] == logits[2].argmax().item()
    assert tokens[3] in logits[3].topk(4).indices.tolist()


def test_penalties_change_only_seen_tokens_as_defined() -> None:
    # Against the definitions row by row, on a whole vocabulary: repetition on every token
    # seen (prompt or output), frequency per occurrence and presence once in the output.
    gen = torch.Generator().manual_seed(6)
    pool = torch.randint(0, VOCAB, (5, 40), generator=gen, dtype=torch.int32)
    params = [
        SamplingParams(presence_penalty=1.5),
        SamplingParams(),  # no penalties of its own, in a batch that has some
        SamplingParams(frequency_penalty=0.5, repetition_penalty=1.25),
        SamplingParams(presence_penalty=-0.75, frequency_penalty=-0.5, repetition_penalty=0.5),
    ]
    reqs = [make_req(p, prompt_len=3 + 4 * i, uid=i) for i, p in enumerate(params)]
    for req, generated in zip(reqs, (9, 0, 21, 2)):
        req.device_len += generated
    logits = torch.randn(4, VOCAB, generator=gen) * 3
    original, expected = logits.clone(), logits.clone()
    for row, req in zip(expected, reqs):
        p, tokens = req.sampling_params, pool[req.table_idx, : req.device_len].long()
        counts = torch.bincount(tokens[req.prompt_len :], minlength=VOCAB).float()
        seen = torch.zeros(VOCAB, dtype=torch.bool).index_fill(0, tokens, True)
        rep = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row.copy_(torch.where(seen, rep, row) - p.frequency_penalty * counts)
        row -= p.presence_penalty * (counts > 0).float()
    penalties = gather_penalties(reqs, pool, VOCAB)
    assert penalties is not None
    got = apply_penalties(logits, penalties)
    assert got.data_ptr() == logits.data_ptr()  # in place: nothing as large as the logits
    assert torch.equal(got, expected)
    changed = (got != original).sum(dim=-1).tolist()
    assert changed[1] == 0 and min(changed[0], changed[2], changed[3]) > 0
