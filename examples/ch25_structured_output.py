"""Chapter 25: the rest of the API. logit_bias, top and prompt logprobs, JSON-schema output.

Everything here changes the logits after the model and before the sampler (or reads
them there), so it runs the same through the offline LLM, the server and CUDA graphs.
It runs on a CPU in about a minute; the first schema request loads xgrammar (seconds).

Run from the repo root: python examples/ch25_structured_output.py
"""

import json
import math

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
    max_seq_len_override=256,
    cuda_graph_max_bs=8,  # decode through (emulated) graphs: the logits change outside them
)
tok = llm.tokenizer
failures = []
prompt = "The capital of France is"

# 1. logit_bias: +100 forces a token, -100 forbids one; the other requests are untouched.
greedy = llm.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)[0]
banana = tok.encode(" banana")[0]
params = [
    SamplingParams(max_tokens=4, logit_bias={banana: 100.0}),
    SamplingParams(max_tokens=4, logit_bias={greedy["token_ids"][0]: -100.0}),
    SamplingParams(max_tokens=4),
]
outs = llm.generate([prompt] * 3, params, use_tqdm=False)
for label, out in zip(["+100 on ' banana'", "-100 on ' Paris'", "no bias"], outs):
    print(f"{label:18} -> {out['text']!r}")
if outs[0]["token_ids"] != [banana] * 4 or outs[2]["token_ids"] != greedy["token_ids"]:
    failures.append("logit_bias did not force its token, or changed an unbiased request")
if greedy["token_ids"][0] in outs[1]["token_ids"]:
    failures.append("-100 did not forbid the token")

# 2. Top logprobs of each generated token, and the logprob of every prompt token (echo).
asked = SamplingParams(max_tokens=3, logprobs=True, top_logprobs=3, prompt_logprobs=True)
out = llm.generate([prompt], asked, use_tqdm=False)[0]
print("prompt tokens:")
for token, lp in zip(tok.encode(prompt), out["prompt_logprobs"]):
    shown = "   (first: none)" if lp is None else f"{lp['logprob']:8.3f}"
    print(f"  {tok.decode([token])!r:12} {shown}")
print("generated tokens, with the 3 likeliest:")
for token, lp in zip(out["token_ids"], out["logprobs"]):
    top = ", ".join(f"{tok.decode([t])!r} {v:.2f}" for t, v in lp["top"].items())
    print(f"  {tok.decode([token])!r:12} {lp['logprob']:8.3f}   [{top}]")
    if not math.isclose(lp["logprob"], max(lp["top"].values()), abs_tol=1e-6):
        failures.append("a greedy token is not the likeliest of its top logprobs")

# 3. JSON-schema output at temperature 1: every answer parses and fits the schema.
schema = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
ask = [{"role": "user", "content": "Describe a person as JSON: name, age, favourite colour."}]
ids = tok.encode(tok.apply_chat_template(ask), add_special_tokens=False)
bound = [
    SamplingParams(max_tokens=64, temperature=1.0, seed=i, json_schema=json.dumps(schema))
    for i in range(4)
]
free = SamplingParams(max_tokens=24, temperature=1.0, seed=0)  # in the same batch, unbound
outs = llm.generate([ids] * 5, [*bound, free], use_tqdm=False)
for out in outs:
    print(f"{out['finish_reason']:6} {out['text']!r}")
for out in outs[:4]:
    doc = json.loads(out["text"])
    if not (set(doc) == set(schema["properties"]) and 18 <= doc["age"] <= 99):
        failures.append(f"{doc} does not fit the schema")

llm.shutdown()
if failures:
    raise SystemExit("; ".join(failures))
