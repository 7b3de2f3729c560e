"""Chapter 13: the offline API. LLM(...).generate(prompts, sampling_params) and nothing else.

Strings or token-id lists in; one SamplingParams for all prompts or one per prompt; text,
token ids and a finish reason out. A prompt that cannot fit is refused before anything runs.

Run from the repo root: python examples/ch13_llm.py
"""

import torch

from minisgl.core import SamplingParams
from minisgl.llm import LLM

MODEL = "models/SmolLM2-135M-Instruct"
llm = LLM(
    MODEL,
    dtype=torch.float32,
    device="cpu",
    max_running_req=8,
    num_page_override=512,
    max_seq_len_override=128,
)
tok = llm.tokenizer
failures = []

# 1. Strings, one SamplingParams for all of them (greedy, 8 tokens).
greedy = SamplingParams(max_tokens=8)
texts = ["The capital of France is", "def add(a, b):"]
chat = tok.apply_chat_template([{"role": "user", "content": "Reply with one word: yes or no?"}])
outs = llm.generate([*texts, chat], greedy, use_tqdm=False)
for text, out in zip([*texts, "<chat: yes or no?>"], outs):
    print(f"{text!r:28} -> {out['text']!r:28} {out['finish_reason']:6} {out['token_ids']}")

# 2. The same prompt as token ids gives the same tokens.
ids = tok.encode(texts[0])
as_ids = llm.generate([ids], greedy, use_tqdm=False)[0]
print(
    f"as token ids {ids} -> {as_ids['text']!r}, same as the string: "
    f"{as_ids['token_ids'] == outs[0]['token_ids']}"
)
if as_ids["token_ids"] != outs[0]["token_ids"]:
    failures.append("token-id prompt differs from the string prompt")

# 3. One SamplingParams per prompt: greedy, sampled with a seed (twice), a stop token.
stop_at = outs[1]["token_ids"][2]  # the third greedy token of the second prompt
params = [
    SamplingParams(max_tokens=8),
    SamplingParams(max_tokens=8, temperature=0.8, seed=7),
    SamplingParams(max_tokens=8, temperature=0.8, seed=7),
    SamplingParams(max_tokens=8, stop_token_ids=[stop_at]),
]
mixed = llm.generate([texts[0], texts[0], texts[0], texts[1]], params, use_tqdm=False)
for label, out in zip(["greedy", "T=0.8 seed=7", "T=0.8 seed=7", f"stop at {stop_at}"], mixed):
    print(f"{label:14} -> {out['text']!r:30} {out['finish_reason']:6} {out['token_ids']}")
if mixed[1]["token_ids"] != mixed[2]["token_ids"]:
    failures.append("the same seed gave different tokens")
if mixed[3]["token_ids"] != outs[1]["token_ids"][:3] or mixed[3]["finish_reason"] != "stop":
    failures.append("the stop token did not end the request")

# 4. A prompt longer than the context is refused, and nothing else in the call runs.
try:
    llm.generate([texts[0], "word " * 200], greedy, use_tqdm=False)
    failures.append("an over-long prompt was accepted")
except ValueError as e:
    print(f"ValueError: {e}")

llm.shutdown()
if failures:
    raise SystemExit("; ".join(failures))
