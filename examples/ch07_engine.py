"""Chapter 7: the engine. It owns the model, the KV pool, the page table and the token pool;
we play the scheduler by hand: give each request a row and pages, then prefill and decode.

Run from the repo root: python examples/ch07_engine.py
"""

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.kvcache.allocator import PageAllocator, page_slots
from minisgl.tokenizer.tokenizer import Tokenizer

MODEL = "models/SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "def add(a, b):", "Three primary colors are red,"]
NEW_TOKENS = 6

config = EngineConfig(
    MODEL,
    dtype=torch.float32,
    device="cpu",
    max_running_req=4,
    num_page_override=32,
    max_seq_len_override=64,
    page_size=4,
)
engine = Engine(config)
print(
    f"engine: {engine.model_config.architecture} {engine.dtype} on {engine.device}, "
    f"{engine.num_pages} pages of {engine.page_size}; page table and token pool "
    f"{tuple(engine.page_table.shape)}, dummy request in row {engine.dummy_req.table_idx}"
)

# The scheduler's job, by hand: a row per request, pages for prompt + new tokens, the prompt
# written into the request's row of the token pool.
tok = Tokenizer(MODEL)
pages = PageAllocator(engine.num_pages)
reqs = []
for row, text in enumerate(PROMPTS):
    ids = torch.tensor(tok.encode(text), dtype=torch.int32)
    req = Req(ids, row, 0, NEW_TOKENS, row, SamplingParams(max_tokens=NEW_TOKENS))
    slots = page_slots(pages.alloc(-(-req.max_device_len // engine.page_size)), engine.page_size)
    engine.page_table[row, : len(slots)] = slots
    engine.token_pool[row, : len(ids)] = ids
    reqs.append(req)
    print(f"  row {row}: {len(ids)} prompt tokens, slots {slots.tolist()}")

# One forward per step for all three: first a prefill of every prompt token, then decodes.
outputs: list[list[int]] = [[] for _ in reqs]
phase = "prefill"
for step in range(NEW_TOKENS):
    batch = Batch(reqs, phase)
    engine.prepare_batch(batch)  # input ids from the token pool, positions, KV slots, metadata
    if step < 2:
        print(f"{phase}: {len(batch.input_ids)} tokens, positions {batch.positions.tolist()}")
    tokens = engine.forward_batch(batch).next_tokens_cpu.tolist()
    for req, out, t in zip(reqs, outputs, tokens, strict=True):
        req.complete_one()  # its K/V is cached now; the sampled token joins the sequence
        req.append_host(t)
        out.append(t)
    phase = "decode"
print(f"token pool row 0 after the loop: {engine.token_pool[0, : reqs[0].device_len].tolist()}")
engine.shutdown()

# The reference: transformers' greedy generate, one prompt at a time.
hf_logging.disable_progress_bar()
hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
ok = True
for text, out in zip(PROMPTS, outputs, strict=True):
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        ref = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, ids.size(1) :]
    same = out == ref.tolist()
    ok &= same
    print(f"{text!r} -> {tok.decode(out)!r} {out} same as HF: {same}")
if not ok:
    raise SystemExit("engine tokens differ from transformers' greedy generate")
