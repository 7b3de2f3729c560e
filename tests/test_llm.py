"""The offline LLM API end to end: many requests at once, each equal to itself run alone.

The reference for every request is Hugging Face `generate` on that request alone, greedy,
in fp32. The engine must match it whatever the batching: overlap on or off, chunked or
whole prefill, page size, prefix cache, and how many requests run at once.
"""

from __future__ import annotations

import inspect
import json
import random
import re

import pytest
import torch
from helpers import SMOL, hf_greedy, need

from minisgl.core import SamplingParams
from minisgl.env import ENV
from minisgl.llm import LLM
from minisgl.tokenizer.tokenizer import Tokenizer


def corpus() -> list[int]:
    # Real text (not random ids) so the model's predictions are confident, as in real use.
    text = "\n".join(inspect.getsource(m) for m in (json.decoder, json.encoder, random))
    return Tokenizer(need(SMOL)).encode(text)


@pytest.fixture(scope="module")
def workload() -> list[tuple[list[int], int]]:
    """16 (prompt, output length) pairs: prompts 1-300 tokens, outputs 1-32 tokens.

    Big enough for what the configurations differ in: four requests for each of the 4 rows,
    prompts of many 16-token chunks, outputs across page edges. No bigger, because every
    output token of the reference is a forward of the whole model, one request at a time.
    """
    tokens, rng = corpus(), random.Random(0)
    out = []
    for _ in range(16):
        n = rng.randint(1, 300)
        start = rng.randrange(len(tokens) - n)
        out.append((tokens[start : start + n], rng.randint(1, 32)))
    return out


@pytest.fixture(scope="module")
def reference(workload) -> list[list[int]]:
    # Computed once: every configuration and the preemption test compare against it.
    return [hf_greedy(SMOL, ids, n) for ids, n in workload]


@pytest.fixture(autouse=True)
def _restore_overlap():
    saved = ENV.DISABLE_OVERLAP_SCHEDULING.value
    yield
    ENV.DISABLE_OVERLAP_SCHEDULING.value = saved


def make_llm(overlap: bool = True, **kw) -> LLM:
    ENV.DISABLE_OVERLAP_SCHEDULING.value = not overlap
    kw.setdefault("num_page_override", 4096 // kw.get("page_size", 1))
    return LLM(str(SMOL), dtype=torch.float32, device="cpu", max_seq_len_override=1024, **kw)


CONFIGS = {
    "overlap-whole-page1-radix-64": dict(
        overlap=True, page_size=1, cache_type="radix", max_running_req=64
    ),
    "serial-chunk16-page16-radix-4": dict(
        overlap=False, max_prefill_length=16, page_size=16, cache_type="radix", max_running_req=4
    ),
    "overlap-chunk16-page1-naive-4": dict(
        overlap=True, max_prefill_length=16, page_size=1, cache_type="naive", max_running_req=4
    ),
    "serial-whole-page16-naive-64": dict(
        overlap=False, page_size=16, cache_type="naive", max_running_req=64
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_request_equals_itself_alone(name: str, workload, reference) -> None:
    llm = make_llm(**CONFIGS[name])
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in workload]
    outputs = llm.generate([ids for ids, _ in workload], params, use_tqdm=False)
    llm.scheduler.check_integrity()
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        assert out["token_ids"] == ref, f"{name}: request {i} differs from HF alone"
        assert out["finish_reason"] == "length"
    llm.shutdown()


def test_shared_prefix_comes_from_the_cache() -> None:
    tokens = corpus()
    prefix = tokens[:200]
    prompts = [prefix + tokens[300 + 10 * i : 305 + 10 * i] for i in range(16)]
    llm = make_llm(page_size=1, cache_type="radix")
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    llm.scheduler.check_integrity()
    cached = sum(min(out["cached_tokens"], 200) for out in outputs)
    assert cached >= 0.9 * 16 * 200, f"only {cached} of {16 * 200} shared tokens were cached"
    for ids, out in zip(prompts, outputs):
        assert out["token_ids"] == hf_greedy(SMOL, ids, 6)
    llm.shutdown()


def test_kv_pool_smaller_than_demand(workload, reference) -> None:
    # 11 requests want ~2200 tokens of KV at once; the pool holds 448.
    llm = make_llm(page_size=16, num_page_override=28, max_running_req=16)
    subset = [i for i, (ids, n) in enumerate(workload) if len(ids) + n > 100]
    params = [SamplingParams(max_tokens=workload[i][1], ignore_eos=True) for i in subset]
    outputs = llm.generate([workload[i][0] for i in subset], params, use_tqdm=False)
    llm.scheduler.check_integrity()
    assert llm.scheduler.num_preemptions > 0, "the pool was never short: the test proves nothing"
    for i, out in zip(subset, outputs):
        assert out["token_ids"] == reference[i], f"request {i} differs after preemption"
    llm.shutdown()


def test_over_long_prompt_is_refused_and_the_llm_stays_usable() -> None:
    llm = make_llm()
    tok = llm.tokenizer
    short = tok.encode("The capital of France is")
    with pytest.raises(ValueError, match=re.escape("prompt 1: the prompt has 1500 tokens")) as err:
        llm.generate([short, [42] * 1500], SamplingParams(max_tokens=4))
    assert "1024" in str(err.value)
    assert not llm.scheduler.has_work  # nothing half-submitted
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert out[0]["token_ids"] == hf_greedy(SMOL, short, 4)
    llm.scheduler.check_integrity()
    llm.shutdown()


def test_outputs_text_strings_and_eos() -> None:
    llm = make_llm()
    tok = llm.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    outputs = llm.generate(
        [chat, "The capital of France is"],
        [SamplingParams(max_tokens=40), SamplingParams(max_tokens=5)],
        use_tqdm=False,
    )
    # the chat answer ends at <|im_end|> (EOS), well before 40 tokens
    assert outputs[0]["finish_reason"] == "stop" and outputs[0]["token_ids"][-1] == 2
    answer = outputs[0]["token_ids"]
    assert answer == hf_greedy(SMOL, tok.encode(chat), len(answer))
    assert outputs[0]["text"] == tok.decode(outputs[0]["token_ids"])
    assert "Paris" in outputs[0]["text"]
    assert outputs[1]["finish_reason"] == "length" and len(outputs[1]["token_ids"]) == 5
    llm.shutdown()
