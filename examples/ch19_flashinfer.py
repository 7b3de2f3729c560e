"""Chapter 19: FlashInfer attention and real CUDA graphs - and what `auto` picks where.

On a CUDA machine with FlashInfer installed this runs SmolLM2 in bf16 with the FlashInfer
backend, captures real decode graphs and times a decode step with and without them. On a
CPU it shows why it falls back: the registry says what each backend needs, and the
FlashInfer page arrays are computed and printed all the same (they need no GPU).
"""

import time

import torch

from minisgl.attention.fi import paged_kv_layout
from minisgl.attention.registry import BACKENDS, select_backend
from minisgl.core import SamplingParams
from minisgl.env import ENV
from minisgl.kvcache.allocator import page_slots
from minisgl.llm import LLM

MODEL = "models/SmolLM2-135M-Instruct"
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

print("backends (best first):")
for name, cls in BACKENDS.items():
    why = cls.unavailable_reason(device, dtype, 16) or "can run here"
    print(f"  {name:6s} devices={cls.devices} cuda_graphs={cls.cuda_graphs}: {why}")
print(f"auto on {device.type} with {dtype}: {select_backend('auto', device, dtype, 16).name}")

# FlashInfer's view of two requests (5 and 11 tokens) in pages of 4 tokens.
table = torch.zeros(2, 12, dtype=torch.int32)
table[0] = page_slots([7, 2, 9], 4)
table[1] = page_slots([0, 5, 3], 4)
indptr, indices, last = paged_kv_layout([5, 11], [0, 1], table, 4)
print("indptr", indptr.tolist(), "indices", indices.tolist(), "last_page_len", last.tolist())

ENV.DISABLE_OVERLAP_SCHEDULING.value = True
prompts = ["The capital of France is", "List three prime numbers:", "def fibonacci(n):"]
params = SamplingParams(max_tokens=32, ignore_eos=True)
kw = dict(dtype=dtype, max_running_req=8, num_page_override=2048, max_seq_len_override=256)
results = {}
for label, max_bs in (("graphs", 8), ("eager", 0)):
    if device.type == "cpu" and label == "graphs":
        max_bs = 4  # on CPU: emulated graphs, to show the same tokens come out
    llm = LLM(MODEL, cuda_graph_max_bs=max_bs, **kw)
    runner = llm.engine.graph_runner
    kind = type(next(iter(runner.graph_map.values()))).__name__ if runner.graph_map else "-"
    llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    out = llm.generate(prompts, params, use_tqdm=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    results[label] = [o["token_ids"] for o in out]
    print(
        f"{label:6s}: backend {llm.engine.attn_backend.name}, graphs {sorted(runner.graph_map)} "
        f"({kind}), {seconds / 32 * 1e3:.1f} ms per step for 3 requests"
    )
    print(f"        {out[0]['text']!r}")
    llm.shutdown()
print("same tokens with and without graphs:", results["graphs"] == results["eager"])
