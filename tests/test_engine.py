"""The engine on the tiny models: logits equal Hugging Face under teacher forcing.

Random tiny models have near-tied logits, so greedy tokens would be a fragile comparison;
instead we feed the same tokens to both and compare every position's logits in fp32.
"""

from __future__ import annotations

import pytest
import torch
from helpers import TINY, Driver, all_logits, hf_logits, make_engine, need

from minisgl.core import Batch, SamplingParams

TOL = 1e-4
SEQ = 40


def token_ids(seed: int, n: int = SEQ) -> list[int]:
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=sorted(TINY))
def model(request: pytest.FixtureRequest):
    return need(TINY[request.param])


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_in_one_piece(model, page_size: int) -> None:
    ids = token_ids(0)
    driver = Driver(make_engine(model, page_size=page_size))
    req = driver.add(ids, SamplingParams(max_tokens=1), row=0)
    got = all_logits(driver.engine, [req], "prefill")
    assert (got - hf_logits(model, ids)).abs().max().item() <= TOL


@pytest.mark.parametrize("page_size", [1, 16])
def test_cached_prefix_then_extension(model, page_size: int) -> None:
    ids = token_ids(1)
    driver = Driver(make_engine(model, page_size=page_size))
    req = driver.add(ids, SamplingParams(max_tokens=1), row=3)
    req.device_len = 17  # first chunk: positions [0, 17), ending inside a page
    first = all_logits(driver.engine, [req], "prefill")
    req.device_len = SEQ  # then the rest, attending to the cached 17
    second = all_logits(driver.engine, [req], "prefill")
    got = torch.cat([first[:17], second])
    assert (got - hf_logits(model, ids)).abs().max().item() <= TOL


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_under_teacher_forcing(model, page_size: int) -> None:
    ids = token_ids(2)
    prompt = 8
    engine = make_engine(model, page_size=page_size)
    driver = Driver(engine)
    # A second, shorter request decodes alongside and leaves the batch early.
    first = driver.add(ids[:prompt], SamplingParams(max_tokens=SEQ - prompt), row=0)
    second = driver.add(ids[:5], SamplingParams(max_tokens=10), row=5)
    got = [all_logits(engine, [first, second], "prefill")[prompt - 1]]
    sizes = set()
    while first.device_len <= SEQ:
        live = [r for r in (first, second) if r.device_len <= r.max_device_len]
        for req in live:  # teacher forcing: the next input is the reference token
            engine.token_pool[req.table_idx, req.cached_len] = ids[req.cached_len]
        got.append(all_logits(engine, live, "decode")[0])
        sizes.add(len(live))
    assert sizes == {1, 2}
    ref = hf_logits(model, ids)[prompt - 1 :]
    assert len(got) == len(ref) >= 32
    assert (torch.stack(got) - ref).abs().max().item() <= TOL


def test_requests_in_one_batch_match_each_alone(model) -> None:
    prompts = [token_ids(10 + i, n) for i, n in enumerate([3, 33, 17, 1])]
    driver = Driver(make_engine(model, page_size=4))
    reqs = [driver.add(p, SamplingParams(max_tokens=1), row=i) for i, p in enumerate(prompts)]
    batch = Batch(reqs, "prefill")
    driver.engine.prepare_batch(batch)
    with torch.inference_mode(), driver.engine.ctx.forward_batch(batch):
        last = driver.engine.model.forward()
    for i, ids in enumerate(prompts):
        assert (last[i] - hf_logits(model, ids)[-1]).abs().max().item() <= TOL


def test_pool_sizing_and_errors(model) -> None:
    engine = make_engine(model, num_page_override=None, max_seq_len_override=64, page_size=16)
    assert engine.num_pages == 8 * 4  # capped at max_running_req rows of 64 tokens
    assert engine.page_table.shape == (9, 80)  # a dummy row; 65 positions rounded to pages
    dummy = engine.page_table[-1]
    assert (dummy // 16 == engine.kv_cache.dummy_page).all()
    with pytest.raises(ValueError, match="exceeds the model's context 2048"):
        make_engine(model, max_seq_len_override=4096)
