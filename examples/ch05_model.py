"""Chapter 5: the model, written once over pages. Build it from config.json, load the
safetensors weights, run one prefill by hand and compare the logits with transformers.

Run from the repo root: python examples/ch05_model.py
"""

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.core import Batch, Context, Req, SamplingParams, set_global_ctx
from minisgl.kvcache.allocator import page_slots
from minisgl.kvcache.mha_pool import MHAKVCache
from minisgl.models.config import ModelConfig
from minisgl.models.register import create_model
from minisgl.models.weight import load_weights
from minisgl.tokenizer.tokenizer import Tokenizer

PAGE_SIZE = 4
MODELS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "SmolLM2-135M-Instruct"]
PROMPT = "The capital of France is"


@torch.inference_mode()
def prefill(path: str, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Our logits for the last token [1, vocab] and for every token [len(ids), vocab]."""
    config = ModelConfig.from_path(path)
    model = create_model(config)  # parameters are empty here; fp32 is torch's default dtype
    load_weights(model, path)
    # By hand, what the engine will do: a pool with enough pages, one page-table row,
    # the reference backend, and the context the layers read the batch from.
    num_pages = -(-len(ids) // PAGE_SIZE)
    pool = MHAKVCache(
        config.num_layers,
        num_pages,
        PAGE_SIZE,
        config.num_kv_heads,
        config.head_dim,
        torch.float32,
        torch.device("cpu"),
    )
    page_table = torch.zeros((1, num_pages * PAGE_SIZE), dtype=torch.int32)
    page_table[0] = page_slots(list(range(num_pages)), PAGE_SIZE)
    backend = TorchAttnBackend(pool, page_table, config.head_dim**-0.5, config.num_heads)
    ctx = Context(backend)
    set_global_ctx(ctx)

    req = Req(torch.tensor(ids), 0, 0, 1, 0, SamplingParams())
    batch = Batch([req], "prefill")
    batch.input_ids = req.input_ids
    batch.positions = torch.arange(len(ids), dtype=torch.int32)
    batch.out_loc = page_table[0, : len(ids)]
    backend.prepare_metadata(batch)
    with ctx.forward_batch(batch):
        last = model.forward()  # the LM head keeps only each request's last token
        every = model.lm_head.project(model.model(batch.input_ids))  # all positions, for checking
    set_global_ctx(None)
    return last, every


hf_logging.disable_progress_bar()
tok = Tokenizer("models/SmolLM2-135M-Instruct")
ids = tok.encode(PROMPT)
print(f"prompt {PROMPT!r} -> {len(ids)} tokens {ids}")
print(f"{'model':<22} {'class':<20} {'max |diff| last':>15} {'all':>8}  next token (= HF?)")
worst = 0.0
for name in MODELS:
    path = f"models/{name}"
    last, every = prefill(path, ids)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    d_last = (last[0] - ref[-1]).abs().max().item()
    d_all = (every - ref).abs().max().item()
    worst = max(worst, d_last, d_all)
    nxt = int(last[0].argmax())
    same = nxt == int(ref[-1].argmax())
    print(
        f"{name:<22} {type(hf).__name__:<20} {d_last:>15.1e} {d_all:>8.1e}  "
        f"{nxt} {tok.decode([nxt])!r} ({same})"
    )
    if not same:
        raise SystemExit(f"{name}: next token differs from transformers")
if worst > 1e-3:
    raise SystemExit(f"logits differ from transformers by {worst:.2e}")
print(f"all models match transformers (worst max diff {worst:.1e})")
