"""Chapter 29: more model families - RoPE variants, sliding windows, Gemma 3 and 4, Phi-3.

Reads the published configs of Llama 3.1 and Phi-4-mini and shows what their RoPE variants
do to the frequencies; then builds three tiny random models (Mistral with a sliding window,
Gemma 3, Phi-3 with longrope and partial rotary) from a seed, serves a prompt longer than
their windows and pretrained contexts, and compares every position's logits with
transformers under teacher forcing. Last, the KV memory per token of the four published
Gemma 4 configs, by layer group, as the engine sizes its pool, and what a 32K conversation
keeps a token once the sliding layers keep only their window's pages (and Gemma 3's).

Run from the repo root: python examples/ch29_model_families.py
"""

import math
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, MistralConfig, Phi3Config

from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.kvcache.layout import KVLayout
from minisgl.kvcache.window_pages import WindowedKVCache, sequence_bytes_per_token
from minisgl.layers.rope_scaling import frequencies
from minisgl.models.config import ModelConfig
from minisgl.models.families import context_length, layer_rope

CPU = torch.device("cpu")

# ---- 1. what a RoPE variant changes: the frequencies, and a scale on cos and sin ------------
llama31 = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}  # fmt: skip
variants = {
    "llama3 (Llama 3.1)": llama31,
    "yarn x4 (Qwen2.5's recipe)": {
        **llama31, "max_position_embeddings": 32768, "rope_theta": 1e6,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    },
    "longrope (Phi-4-mini-like)": {
        **llama31, "hidden_size": 3072, "num_attention_heads": 24, "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75, "original_max_position_embeddings": 4096,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48,
                         "long_factor": [1.0 + i for i in range(48)]},
    },
}  # fmt: skip
print("variant                      context  turned  longest wavelength  cos/sin scale")
for name, raw in variants.items():
    config = ModelConfig.from_dict(raw)
    rope = layer_rope(config, 0)
    plain = layer_rope(ModelConfig.from_dict({**raw, "rope_scaling": None}), 0)
    inv_freq, scale = frequencies(rope, CPU)
    longest, was = 2 * math.pi / inv_freq.min(), 2 * math.pi / frequencies(plain, CPU)[0].min()
    print(f"{name:<28} {context_length(config):>7} {rope.rotary_dim:>4}/{config.head_dim}"
          f"  {was:>9.0f} -> {longest:>9.0f}  {scale:.4f}")  # fmt: skip


# ---- 2. three tiny families against transformers -----------------------------------------
def tiny(kind: str) -> object:
    base = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    if kind == "mistral":
        return MistralConfig(**base, sliding_window=8, architectures=["MistralForCausalLM"])
    if kind == "gemma3":
        return Gemma3TextConfig(
            **base,
            head_dim=16,
            sliding_window=8,
            sliding_window_pattern=2,
            query_pre_attn_scalar=24,
            architectures=["Gemma3ForCausalLM"],
        )
    return Phi3Config(
        **base, original_max_position_embeddings=32, partial_rotary_factor=0.75,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 6,
                      "long_factor": [1.0 + i for i in range(6)]},
        architectures=["Phi3ForCausalLM"], pad_token_id=0,
    )  # fmt: skip


ids = torch.randint(0, 512, (48,), generator=torch.Generator().manual_seed(0)).tolist()
print(f"\na {len(ids)}-token prompt: longer than the windows (8) and than Phi-3's 32 positions")
with tempfile.TemporaryDirectory() as root:
    for kind in ("mistral", "gemma3", "phi3"):
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(tiny(kind), dtype=torch.float32).eval()
        hf.save_pretrained(Path(root) / kind)
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0]
        engine = Engine(
            EngineConfig(
                str(Path(root) / kind),
                dtype=torch.float32,
                device="cpu",
                num_page_override=16,
                page_size=4,
                max_running_req=1,
            )
        )
        req = Req(torch.tensor(ids, dtype=torch.int32), 0, 0, 1, 0, SamplingParams())
        engine.page_table[0, : len(ids)] = torch.arange(len(ids), dtype=torch.int32)
        pool = engine.kv_cache
        if isinstance(pool, WindowedKVCache):  # sliding layers' own pages: here the same ids
            pool.window_map[:-1] = torch.arange(16, dtype=torch.int32)
            pool.window_table[0] = engine.page_table[0]
        engine.token_pool[0, : len(ids)] = req.input_ids
        batch = Batch([req], "prefill")
        engine.prepare_batch(batch)
        with torch.inference_mode(), engine.ctx.forward_batch(batch):
            got = engine.model.lm_head.project(engine.model.model(batch.input_ids))
        windows = engine.attn_backend.windows
        print(f"  {kind:<8} context {engine.max_seq_len:>4}, windows per layer {windows}: "
              f"max |logits - transformers| {(got - want).abs().max():.1e}")  # fmt: skip
        engine.shutdown()


# ---- 3. Gemma 4: KV memory per token by layer group ---------------------------------------
def gemma4(layers: int, pattern: int, kv: int, global_kv: int | None, shared: int,
           window: int) -> dict:  # fmt: skip
    """The KV-shaping fields of a published Gemma 4 config (their config.json's values)."""
    s, f = "sliding_attention", "full_attention"
    text = dict(num_hidden_layers=layers, num_key_value_heads=kv, head_dim=256,
                global_head_dim=512, num_global_key_value_heads=global_kv, sliding_window=window,
                attention_k_eq_v=global_kv is not None, num_kv_shared_layers=shared,
                layer_types=([s] * (pattern - 1) + [f]) * (layers // pattern))  # fmt: skip
    return {"architectures": ["Gemma4ForConditionalGeneration"], "text_config": text}


BF16 = torch.bfloat16
published = {
    "E2B": gemma4(35, 5, 1, None, 20, 512),
    "E4B": gemma4(42, 6, 2, None, 18, 512),
    "26B-A4B": gemma4(30, 6, 8, 2, 0, 1024),
    "31B": gemma4(60, 6, 16, 4, 0, 1024),
}
CONVERSATION = 32768
print("\nGemma 4, bf16 KV bytes a token: each group (layers x KV heads x head_dim), in all,")
print("and if every attention layer kept its own")
print("  model    sliding group            full group             shared   in all  every layer")
layouts = {name: KVLayout.of(ModelConfig.from_dict(raw), CONVERSATION + 1)
           for name, raw in published.items()}  # fmt: skip
for name, layout in layouts.items():
    groups = "  ".join(
        f"{len(g.layers):>2} x {g.kv_heads:>2} x {g.head_dim} {g.bytes_per_token(BF16):>8,}"
        for g in layout.groups
    )
    total, every = layout.bytes_per_token(BF16), layout.every_layer_bytes_per_token(BF16)
    print(f"  {name:<8} {groups}  {len(layout.shared):>6} {total:>8,}  {every:>8,} "
          f"({every / total:.2f}x)")  # fmt: skip

# The sliding layers' pages apart (kvcache/window_pages.py): a conversation keeps the full
# groups' bytes for every token, the sliding groups' for its last window only.
layouts["gemma-3-1b"] = KVLayout.of(ModelConfig.from_dict({
    "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 26, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512,
    "sliding_window_pattern": 6}), CONVERSATION + 1)  # fmt: skip
print(f"\na {CONVERSATION:,}-token conversation, bf16 KV bytes a token: in one page table, and")
print("with the sliding layers' pages freed outside their window")
for name, layout in layouts.items():
    total = layout.bytes_per_token(BF16)
    kept = sequence_bytes_per_token(layout, BF16, CONVERSATION)
    print(f"  {name:<10} window {layout.window:>4}  {total:>8,} -> {kept:>7,.0f} "
          f"({total / kept:.2f}x)")  # fmt: skip
