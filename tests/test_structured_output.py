"""The rest of the API, offline: logit_bias, top and prompt logprobs, JSON-schema output.

References: Hugging Face's fp32 logits for log-probabilities (within 1e-4), the same
request run alone for anything batched, and a schema check written out by hand for the
structured output. The decode steps run through (emulated) CUDA graphs and, unless a test
says otherwise, with overlap scheduling on: both paths where the logits are changed after
the model and before the sampler.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import SMOL, hf_logits, need

from minisgl.core import SamplingParams
from minisgl.engine.bias import TokenMask, apply_token_mask
from minisgl.env import ENV
from minisgl.llm import LLM

PROMPT = "The capital of France is"  # greedy: " Paris.\n\n"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON: name, age, favourite colour."}]


def make_llm(overlap: bool = True) -> LLM:
    saved = ENV.DISABLE_OVERLAP_SCHEDULING.value
    ENV.DISABLE_OVERLAP_SCHEDULING.value = not overlap
    try:
        return LLM(
            str(need(SMOL)),
            dtype=torch.float32,
            device="cpu",
            max_running_req=16,
            num_page_override=2048,
            max_seq_len_override=256,
            cuda_graph_max_bs=16,  # decode runs through (emulated) graphs
        )
    finally:
        ENV.DISABLE_OVERLAP_SCHEDULING.value = saved


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    engine = make_llm()
    assert engine.scheduler.overlap and engine.engine.graph_runner.graph_map
    yield engine
    engine.shutdown()


def run(llm: LLM, prompts: list[Any], params: SamplingParams | list[SamplingParams]) -> list[dict]:
    return llm.generate(prompts, params, use_tqdm=False)


def chat_ids(llm: LLM) -> list[int]:
    tok = llm.tokenizer
    return tok.encode(tok.apply_chat_template(ASK), add_special_tokens=False)


def valid(text: str) -> bool:
    """Does `text` parse as JSON that SCHEMA accepts? (No jsonschema package needed.)"""
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    return (
        isinstance(doc, dict)
        and set(doc) == {"name", "age", "color"}
        and isinstance(doc["name"], str)
        and len(doc["name"]) <= 20
        and type(doc["age"]) is int
        and 18 <= doc["age"] <= 99
        and doc["color"] in ("red", "green", "blue")
    )


# ---- logit_bias ---------------------------------------------------------------------------


def test_logit_bias_forces_forbids_and_leaves_the_rest_alone(llm):
    greedy = run(llm, [PROMPT], SamplingParams(max_tokens=4))[0]["token_ids"]
    forced, banned = llm.tokenizer.encode(" banana")[0], greedy[0]
    assert forced not in greedy
    prompts = [PROMPT, PROMPT, "Once upon a time", "1, 2, 3,"]
    free = [SamplingParams(max_tokens=4, temperature=0.8, seed=i) for i in range(2)]
    params = [
        SamplingParams(max_tokens=4, logit_bias={forced: 100.0}),
        SamplingParams(max_tokens=4, logit_bias={banned: -100.0}),
        *free,
    ]
    out = run(llm, prompts, params)
    alone = run(llm, prompts[2:], free)
    assert out[0]["token_ids"] == [forced] * 4, "+100 makes greedy pick that token every time"
    assert banned not in out[1]["token_ids"], "-100 on the greedy token rules it out"
    assert [o["token_ids"] for o in out[2:]] == [o["token_ids"] for o in alone]


# ---- log-probabilities --------------------------------------------------------------------


def hf_logprobs(ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf_logits(SMOL, ids), dim=-1)


def test_prompt_logprobs_equal_hugging_face(llm):
    ids = chat_ids(llm)
    params = SamplingParams(max_tokens=1, logprobs=True, top_logprobs=3, prompt_logprobs=True)
    ref = hf_logprobs(ids)
    for attempt in range(2):  # the second time, the prompt is in the prefix cache
        out = run(llm, [ids], params)[0]
        prompt = out["prompt_logprobs"]
        assert len(prompt) == len(ids) and prompt[0] is None, attempt
        got = torch.tensor([p["logprob"] for p in prompt[1:]])
        want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        for i, p in enumerate(prompt[1:]):
            assert list(p["top"]) == ref[i].topk(3).indices.tolist(), (attempt, i)


def test_prompt_logprobs_across_chunks_and_alongside_others(llm):
    ids = chat_ids(llm)
    prefill = llm.scheduler.prefill
    saved, prefill.max_prefill_length = prefill.max_prefill_length, 7  # chunks of 7 tokens
    try:
        asked = SamplingParams(max_tokens=2, prompt_logprobs=True)
        out = run(llm, [ids, "Hello there"], [asked, SamplingParams(max_tokens=2)])
    finally:
        prefill.max_prefill_length = saved
    got = torch.tensor([p["logprob"] for p in out[0]["prompt_logprobs"][1:]])
    want = hf_logprobs(ids)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert "prompt_logprobs" not in out[1]


def test_top_logprobs_equal_hugging_face(llm):
    ids = llm.tokenizer.encode(PROMPT)
    out = run(llm, [ids], SamplingParams(max_tokens=4, logprobs=True, top_logprobs=5))[0]
    ref = hf_logprobs(ids + out["token_ids"])[len(ids) - 1 :]
    for i, (token, lp) in enumerate(zip(out["token_ids"], out["logprobs"])):
        assert abs(lp["logprob"] - ref[i, token].item()) < 1e-4
        top = ref[i].topk(5)
        assert list(lp["top"]) == top.indices.tolist()
        torch.testing.assert_close(
            torch.tensor(list(lp["top"].values())), top.values, atol=1e-4, rtol=0
        )


# ---- structured output --------------------------------------------------------------------


def test_token_mask_bits_follow_xgrammar():
    """Bit j of word w allows token 32w + j, as xgrammar's own kernel reads its bitmasks."""
    xgrammar = pytest.importorskip("xgrammar")
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 100, generator=gen)
    bits = torch.randint(-(2**31), 2**31, (3, 4), generator=gen, dtype=torch.int64)
    bits = bits.to(torch.int32)
    ours = apply_token_mask(logits, TokenMask(torch.tensor([0, 2]), bits[[0, 2]]))
    theirs = logits.clone()
    xgrammar.apply_token_bitmask_inplace(theirs, bits, indices=[0, 2])
    assert torch.equal(ours, theirs)
    assert torch.isinf(ours).any() and not torch.isinf(ours[1]).any()


@pytest.mark.parametrize("overlap,n", [(True, 8), (False, 4)], ids=["overlap", "no-overlap"])
def test_json_schema_output_validates_and_free_requests_are_unchanged(llm, overlap, n):
    """n constrained and n free requests in one batch: every constrained answer validates,
    and each free one gets exactly the tokens it gets alone."""
    engine = llm if overlap else make_llm(overlap=False)
    try:
        assert engine.scheduler.overlap == overlap
        ids = chat_ids(engine)
        schema = json.dumps(SCHEMA)
        free = [SamplingParams(max_tokens=8, temperature=1.0, seed=100 + i) for i in range(n)]
        bound = [
            SamplingParams(max_tokens=48, temperature=1.0, seed=i, json_schema=schema)
            for i in range(n)
        ]
        alone = run(engine, [ids] * n, free)
        mixed = run(engine, [ids] * 2 * n, [p for pair in zip(bound, free) for p in pair])
    finally:
        if not overlap:
            engine.shutdown()
    texts = [o["text"] for o in mixed[0::2]]
    assert all(valid(t) for t in texts), texts
    assert all(o["finish_reason"] == "stop" for o in mixed[0::2])
    assert [o["token_ids"] for o in mixed[1::2]] == [o["token_ids"] for o in alone]


def test_bad_schema_is_refused_before_anything_runs(llm):
    with pytest.raises(ValueError, match="JSON schema cannot be used"):
        run(llm, [PROMPT], SamplingParams(json_schema='{"type": "no-such-type"}'))
    assert not llm.scheduler.reqs and not llm.scheduler.grammars.matchers


# ---- SamplingParams refuses nonsense ------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {"logprobs": True, "top_logprobs": 21},
        {"top_logprobs": 2},  # top logprobs of nothing
        {"logit_bias": {5: 100.5}},
        {"logit_bias": {5: float("nan")}},
        {"logit_bias": {-1: 1.0}},
        {"logit_bias": {"5": 1.0}},
        {"json_schema": "{not json"},
        {"json_schema": "[1, 2]"},
    ],
)
def test_sampling_params_refuse_nonsense(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_logit_bias_outside_the_vocabulary_is_refused(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        run(llm, [PROMPT], SamplingParams(logit_bias={10**7: 1.0}))
