"""Chapter 4: paged attention through a real page table equals dense causal attention; Req, Batch
bookkeeping; SamplingParams validation."""

from __future__ import annotations

import math
import random

import pytest
import torch

from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.core import Batch, Req, SamplingParams
from minisgl.kvcache.allocator import PageAllocator, page_slots
from minisgl.kvcache.mha_pool import MHAKVCache

Q_HEADS, KV_HEADS, HEAD_DIM, LAYERS = 4, 2, 16, 2
MAX_POS = 96  # page-table width: positions per row
ROWS = 6
SCALE = 1 / math.sqrt(HEAD_DIM)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal GQA attention of one whole sequence: q [L, Hq, D], k/v [L, Hkv, D]."""
    group = q.size(1) // k.size(1)
    k = k.repeat_interleave(group, dim=1)  # q head h reads kv head h // group
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * SCALE
    n = q.size(0)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


class Setup:
    """A KV pool, a page table whose rows own shuffled pages, and the backend over them."""

    def __init__(self, page_size: int, seed: int = 0) -> None:
        self.page_size = page_size
        num_pages = ROWS * MAX_POS // page_size
        self.pool = MHAKVCache(
            LAYERS, num_pages, page_size, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu")
        )
        self.page_table = torch.full((ROWS, MAX_POS), -1, dtype=torch.int32)
        alloc = PageAllocator(num_pages)
        pages = alloc.alloc(num_pages)
        random.Random(seed).shuffle(pages)  # rows get scattered, out-of-order pages
        per_row = MAX_POS // page_size
        for row in range(ROWS):
            mine = pages[row * per_row : (row + 1) * per_row]
            self.page_table[row] = page_slots(mine, page_size)
        self.backend = TorchAttnBackend(self.pool, self.page_table, SCALE, Q_HEADS)
        self.gen = torch.Generator().manual_seed(seed)
        # full per-row q/k/v of every position, per layer, so the reference sees all of it
        self.q = torch.randn(LAYERS, ROWS, MAX_POS, Q_HEADS, HEAD_DIM, generator=self.gen)
        self.k = torch.randn(LAYERS, ROWS, MAX_POS, KV_HEADS, HEAD_DIM, generator=self.gen)
        self.v = torch.randn(LAYERS, ROWS, MAX_POS, KV_HEADS, HEAD_DIM, generator=self.gen)

    def req(self, row: int, length: int, cached: int = 0) -> Req:
        ids = torch.arange(length, dtype=torch.int32)
        return Req(ids, row, cached, 8, uid=row, sampling_params=SamplingParams())

    def run(self, reqs: list[Req], phase: str) -> list[torch.Tensor]:
        """One forward over both layers; returns each request's attention output per layer."""
        batch = Batch(reqs, phase)  # type: ignore[arg-type]
        batch.out_loc = torch.cat(
            [self.page_table[r.table_idx, r.cached_len : r.device_len] for r in reqs]
        )
        self.backend.prepare_metadata(batch)
        outs = []
        for layer in range(LAYERS):
            q, k, v = (
                torch.cat([t[layer, r.table_idx, r.cached_len : r.device_len] for r in reqs])
                for t in (self.q, self.k, self.v)
            )
            outs.append(self.backend.forward(q, k, v, layer, batch))
        return outs

    def check(self, reqs: list[Req], outs: list[torch.Tensor]) -> None:
        for layer, out in enumerate(outs):
            assert out.shape == (sum(r.extend_len for r in reqs), Q_HEADS, HEAD_DIM)
            start = 0
            for r in reqs:
                n, row, length = r.extend_len, r.table_idx, r.device_len
                expected = dense_attention(
                    self.q[layer, row, :length],
                    self.k[layer, row, :length],
                    self.v[layer, row, :length],
                )[length - n :]
                torch.testing.assert_close(
                    out[start : start + n],
                    expected,
                    rtol=0,
                    atol=1e-5,
                    msg=lambda m, r=r, layer=layer: f"{r} layer {layer}: {m}",
                )
                start += n


PAGE_SIZES = [1, 4, 16]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_prefill_batch_of_different_lengths(page_size: int) -> None:
    s = Setup(page_size)
    reqs = [s.req(0, 7), s.req(3, 33), s.req(1, 1), s.req(4, 20)]
    outs = s.run(reqs, "prefill")
    s.check(reqs, outs)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_last_indices(page_size: int) -> None:
    s = Setup(page_size)
    lens = [7, 33, 1, 20]
    batch = Batch([s.req(i, n) for i, n in enumerate(lens)], "prefill")
    s.backend.prepare_metadata(batch)
    last = batch.attn_metadata.get_last_indices().tolist()
    assert last == [sum(lens[: i + 1]) - 1 for i in range(len(lens))]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_extend_after_cached_prefix(page_size: int) -> None:
    s = Setup(page_size)
    # First forward: prefixes only (as a radix cache hit would have left them in the pool).
    first = [s.req(0, 10), s.req(2, 17)]
    s.run(first, "prefill")
    # Second forward: the same rows extended past their cached prefixes, plus a fresh request.
    second = [s.req(0, 29, cached=10), s.req(5, 12), s.req(2, 18, cached=17), s.req(1, 40, 3)]
    s.run([s.req(1, 3)], "prefill")  # row 1's 3-token prefix, in a forward of its own
    outs = s.run(second, "prefill")
    assert [r.extend_len for r in second] == [19, 12, 1, 37]
    s.check(second, outs)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_decode_steps(page_size: int) -> None:
    s = Setup(page_size)
    reqs = [s.req(0, 5), s.req(1, 16), s.req(2, 1), s.req(3, 31)]
    s.check(reqs, s.run(reqs, "prefill"))
    for _ in range(4):  # each step appends one token to every request and attends over all
        for r in reqs:
            r.complete_one()
        assert all(r.extend_len == 1 for r in reqs)
        s.check(reqs, s.run(reqs, "decode"))


def test_decode_ignores_stale_slots_past_the_end() -> None:
    # Slots past a request's length hold other data (here: garbage); they must be masked.
    s = Setup(4)
    reqs = [s.req(0, 6), s.req(1, 13)]
    s.run(reqs, "prefill")
    for r in reqs:
        r.complete_one()
    for r in reqs:
        stale = s.page_table[r.table_idx, r.device_len :].long()
        s.pool.k_cache(0)[stale] = 1e4
        s.pool.v_cache(0)[stale] = 1e4
    s.check(reqs, s.run(reqs, "decode"))


def test_layers_do_not_share_kv() -> None:
    s = Setup(4)
    reqs = [s.req(0, 9)]
    s.run(reqs, "prefill")
    slots = s.page_table[0, :9].long()
    torch.testing.assert_close(s.pool.k_cache(0)[slots], s.k[0, 0, :9], rtol=0, atol=0)
    torch.testing.assert_close(s.pool.k_cache(1)[slots], s.k[1, 0, :9], rtol=0, atol=0)
    torch.testing.assert_close(s.pool.v_cache(1)[slots], s.v[1, 0, :9], rtol=0, atol=0)


# ---------------------------------------------------------------- Req and Batch


def test_req_lengths() -> None:
    params = SamplingParams(max_tokens=5)
    req = Req(torch.tensor([4, 5, 6, 7], dtype=torch.int64), 3, 1, 5, uid=9, sampling_params=params)
    assert req.input_ids.dtype == torch.int32
    assert (req.cached_len, req.device_len, req.max_device_len) == (1, 4, 9)
    assert req.extend_len == 3 and req.remain_len == 5
    req.complete_one()
    assert (req.cached_len, req.device_len) == (4, 5)
    assert req.extend_len == 1 and req.remain_len == 4
    req.append_host(11)
    assert req.input_ids.tolist() == [4, 5, 6, 7, 11]
    assert req.input_ids.dtype == torch.int32
    for _ in range(4):
        req.complete_one()
    assert req.remain_len == 0 and req.device_len == req.max_device_len


def test_req_seed() -> None:
    seeded = Req(torch.tensor([1]), 0, 0, 1, 0, SamplingParams(seed=123))
    assert seeded.seed == 123
    a = Req(torch.tensor([1]), 0, 0, 1, 0, SamplingParams())
    b = Req(torch.tensor([1]), 0, 0, 1, 1, SamplingParams())
    assert 0 <= a.seed < 2**63 and 0 <= b.seed < 2**63
    assert a.seed != b.seed  # 63 random bits each: a collision means no randomness


def test_batch_phase_and_size() -> None:
    reqs = [Req(torch.tensor([1, 2]), i, 0, 3, i, SamplingParams()) for i in range(3)]
    batch = Batch(reqs, "decode")
    assert batch.is_decode and not batch.is_prefill
    assert batch.size == batch.padded_size == 3
    batch.padded_reqs = reqs + reqs[:1]
    assert batch.size == 3 and batch.padded_size == 4


# ---------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"seed": -1}, "seed"),
    ],
)
def test_sampling_params_rejects(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs,greedy",
    [
        ({}, True),
        ({"temperature": 0.7}, False),
        ({"temperature": 0.7, "top_k": 1}, True),
        ({"temperature": 1.0, "top_p": 1.0, "top_k": -1}, False),
        ({"temperature": 0.5, "top_p": 1e-6, "top_k": 50, "max_tokens": 1}, False),
    ],
)
def test_sampling_params_accepts(kwargs: dict, greedy: bool) -> None:
    assert SamplingParams(**kwargs).is_greedy == greedy
