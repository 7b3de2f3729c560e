"""Chapter 8: text in, text out. A static batch runs to the end: each request stops at an
end-of-sequence token or at max_tokens and gives its pages back; no new request joins.

Run from the repo root: python examples/ch08_generate.py
"""

import time

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.kvcache.allocator import PageAllocator, page_slots
from minisgl.tokenizer.tokenizer import Tokenizer

MODEL = "models/SmolLM2-135M-Instruct"
MAX_TOKENS = 24


def generate(
    engine: Engine, tok: Tokenizer, prompts: list[str], max_tokens: int
) -> list[list[int]]:
    pages = PageAllocator(engine.num_pages)
    params = SamplingParams(max_tokens=max_tokens)  # greedy
    reqs, owned = [], []
    for row, text in enumerate(prompts):
        ids = torch.tensor(tok.encode(text), dtype=torch.int32)
        req = Req(ids, row, 0, max_tokens, row, params)
        owned.append(pages.alloc(-(-req.max_device_len // engine.page_size)))
        slots = page_slots(owned[row], engine.page_size)
        engine.page_table[row, : len(slots)] = slots
        engine.token_pool[row, : len(ids)] = ids
        reqs.append(req)
    outputs: list[list[int]] = [[] for _ in prompts]
    running, phase = list(reqs), "prefill"
    while running:
        batch = Batch(running, phase)
        engine.prepare_batch(batch)
        tokens = engine.forward_batch(batch).next_tokens_cpu.tolist()
        for req, t in zip(list(running), tokens, strict=True):
            req.complete_one()
            req.append_host(t)
            outputs[req.uid].append(t)
            if t in tok.eos_token_ids or len(outputs[req.uid]) == max_tokens:
                running.remove(req)  # finished: its row and pages are free for the next one
                pages.free(owned[req.uid])
        phase = "decode"
    assert pages.num_free == engine.num_pages, "a finished request kept its pages"
    return outputs


tok = Tokenizer(MODEL)
chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
prompts = [chat, "The three laws of motion are", "def fibonacci(n):"]
engine = Engine(
    EngineConfig(
        MODEL,
        dtype=torch.float32,
        device="cpu",
        max_running_req=4,
        num_page_override=64,
        max_seq_len_override=128,
        page_size=4,
    )
)
generate(engine, tok, prompts[1:2], 2)  # warm-up
start = time.perf_counter()
outputs = generate(engine, tok, prompts, MAX_TOKENS)
seconds = time.perf_counter() - start
engine.shutdown()
for text, out in zip(prompts, outputs, strict=True):
    end = "EOS" if out[-1] in tok.eos_token_ids else "max_tokens"
    print(f"--- prompt:\n{text}\n--- completion ({len(out)} tokens, stopped at {end}):")
    print(tok.decode(out))
total = sum(len(out) for out in outputs)
print(
    f"---\n{total} tokens in {seconds:.2f}s: {total / seconds:.1f} tokens/s (batch of "
    f"{len(prompts)}, fp32 on CPU)"
)

# The reference: transformers' greedy generate with the same stop tokens, one prompt at a time.
hf_logging.disable_progress_bar()
hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
for i, (text, out) in enumerate(zip(prompts, outputs, strict=True)):
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        ref = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=sorted(tok.eos_token_ids),
            pad_token_id=0,
        )[0, ids.size(1) :].tolist()
    print(f"prompt {i}: same tokens as HF generate: {out == ref}")
    if out != ref:
        raise SystemExit(f"prompt {i}: ours {out}\n  HF {ref}")
