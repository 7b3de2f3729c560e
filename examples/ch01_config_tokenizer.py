"""Chapter 1: read a model folder's config.json and tokenizer, and check them against transformers.

Run from the repo root: python examples/ch01_config_tokenizer.py
"""

from transformers import AutoTokenizer

from minisgl.models.config import ModelConfig
from minisgl.tokenizer.tokenizer import Tokenizer

SMOL = "models/SmolLM2-135M-Instruct"
MOE = "models/tiny-qwen3-moe"

# 1. The numbers that decide the model's shapes, from two very different checkpoints.
for path in (SMOL, MOE):
    c = ModelConfig.from_path(path)
    print(f"{path}: {c.architecture}")
    print(
        f"  layers={c.num_layers} hidden={c.hidden_size} heads={c.num_heads} "
        f"kv_heads={c.num_kv_heads} head_dim={c.head_dim} vocab={c.vocab_size}"
    )
    print(
        f"  rope_theta={c.rope_theta:g} eps={c.rms_norm_eps:g} tied={c.tie_word_embeddings} "
        f"context={c.max_position_embeddings} dtype={c.dtype}"
    )
    if c.moe is not None:
        m = c.moe
        print(
            f"  moe: {m.num_experts} experts, top-{m.top_k}, expert width "
            f"{m.intermediate_size}, norm_topk_prob={m.norm_topk_prob}, "
            f"moe layers={[i for i in range(c.num_layers) if m.is_moe_layer(i)]}"
        )

# 2. Text to ids and back, with our tokenizer and with transformers'.
tok = Tokenizer(SMOL)
hf = AutoTokenizer.from_pretrained(SMOL)
text = "Paged attention keeps KV in fixed-size pages."
ids = tok.encode(text)
print(f"\nencode({text!r})\n  -> {ids}")
print(f"  pieces: {[tok.decode([i]) for i in ids]}")
print(f"  decode -> {tok.decode(ids)!r}")
assert ids == hf.encode(text), "token ids differ from transformers"
assert tok.decode(ids) == text, "decode(encode(text)) is not the text"

# 3. The chat template: a conversation becomes one prompt string.
messages = [{"role": "user", "content": "What is a KV cache?"}]
ours = tok.apply_chat_template(messages)
theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
print(f"\nchat template renders:\n{ours}")
print(f"eos token {tok.eos_token!r} -> ids {sorted(tok.eos_token_ids)}; vocab {tok.vocab_size}")
two = messages + [
    {"role": "assistant", "content": "Saved keys and values."},
    {"role": "user", "content": "Why pages?"},
]
for msgs in (messages, two):
    a = tok.apply_chat_template(msgs)
    b = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    if a != b:
        raise SystemExit(f"chat template differs from transformers:\n{a!r}\n{b!r}")
prompt_ids = tok.encode(ours)
assert prompt_ids == hf.encode(theirs)
print(f"same as transformers' AutoTokenizer: True ({len(prompt_ids)} prompt tokens)")
