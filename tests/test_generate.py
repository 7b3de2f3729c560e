"""The real model: greedy tokens equal Hugging Face `generate`, token for token, in fp32."""

from __future__ import annotations

import pytest
from helpers import SMOL, Driver, hf_greedy, make_engine, need, tokenizer

from minisgl.core import SamplingParams
from minisgl.tokenizer.tokenizer import Tokenizer

PLAIN = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]
CHAT = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "List three prime numbers and explain why they are prime.",
]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tok = Tokenizer(need(SMOL))
    chats = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT]
    return [tok.encode(p) for p in PLAIN + chats]


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_equals_hf_generate(prompts: list[list[int]], page_size: int) -> None:
    engine = make_engine(SMOL, page_size=page_size, num_page_override=2048 // page_size)
    outputs = Driver(engine).generate(prompts, SamplingParams(max_tokens=NEW_TOKENS))
    for ids, out in zip(prompts, outputs):
        ref = hf_greedy(SMOL, ids, NEW_TOKENS)
        text = tokenizer(SMOL).decode(ids)
        assert out == ref, f"prompt {text!r}: minisgl {out} != HF {ref}"


def test_known_answer(prompts: list[list[int]]) -> None:
    # A readable anchor next to the token comparison: the model knows this one.
    engine = make_engine(SMOL)
    out = Driver(engine).generate([prompts[3]], SamplingParams(max_tokens=8))[0]
    assert "Paris" in Tokenizer(SMOL).decode(out)
