"""A model folder with random weights in a real model's shape, for speed measurements.

Speed does not depend on weight values, so a benchmark can run a published architecture
without its weights (which a machine with no model hub cannot fetch). The tokenizer files
come from an existing folder; prompts in benchmarks are random token ids anyway.

    python tools/make_random_model.py --shape qwen3-0.6b --out /tmp/qwen3-0.6b \\
        --tokenizer-from models/SmolLM2-135M-Instruct
    python tools/make_random_model.py --shape qwen3-30b-a3b --num-layers 12 --device cuda \\
        --out /tmp/qwen3-30b-a3b-12l --tokenizer-from models/SmolLM2-135M-Instruct

`--num-layers` keeps every layer's real shape and only stacks fewer of them: Qwen3-30B-A3B
is 61 GB in bf16 with its 48 layers, 16.2 GB with 12. The tool refuses a model larger than
the free disk.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

# What the published Qwen3.5 and Gemma 4 configurations of every size share (MODELS.md).
_QWEN3_5 = dict(
    head_dim=256,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_conv_kernel_dim=4,
    vocab_size=248320,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25),
)
_GEMMA4 = dict(
    head_dim=256,
    global_head_dim=512,
    vocab_size=262144,
    vocab_size_per_layer_input=262144,
    final_logit_softcapping=30.0,
    tie_word_embeddings=True,
    rope_parameters=dict(
        sliding_attention=dict(rope_type="default", rope_theta=1e4),
        full_attention=dict(rope_type="proportional", rope_theta=1e6, partial_rotary_factor=0.25),
    ),
)
# Published configurations (the numbers that decide speed), by name.
SHAPES = {
    "qwen3-0.6b": dict(
        arch="Qwen3ForCausalLM",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
    ),
    "qwen3-8b": dict(
        arch="Qwen3ForCausalLM",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
    ),
    "qwen3-14b": dict(
        arch="Qwen3ForCausalLM",
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
    ),
    "qwen3-32b": dict(
        arch="Qwen3ForCausalLM",
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
    ),
    # Qwen3-30B-A3B: 48 layers, each a mixture of 128 experts (8 active per token, intermediate
    # 768), attention with 32 query and 4 KV heads of 128: 30.5B parameters, about 3B active.
    "qwen3-30b-a3b": dict(
        arch="Qwen3MoeForCausalLM",
        hidden_size=2048,
        intermediate_size=6144,  # of a dense MLP layer; it has none (decoder_sparse_step 1)
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
    ),
    # Llama-3.2-1B: the shape of the field's published batch-1 figures on the H200. Its
    # checkpoint scales RoPE (rope_type llama3); speed does not depend on that, so plain RoPE.
    "llama-3.2-1b": dict(
        arch="LlamaForCausalLM",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        max_position_embeddings=131072,
    ),
    "smollm2-135m": dict(
        arch="LlamaForCausalLM",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
    # Qwen3.5: three Gated DeltaNet layers to one gated attention layer (MODELS.md); the text
    # model alone (Qwen3_5ForCausalLM), which the engine serves as it serves the full checkpoint.
    "qwen3.5-0.8b": dict(
        arch="Qwen3_5ForCausalLM",
        **_QWEN3_5,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        linear_num_value_heads=16,
        tie_word_embeddings=True,
    ),
    "qwen3.5-9b": dict(
        arch="Qwen3_5ForCausalLM",
        **_QWEN3_5,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        linear_num_value_heads=32,
        tie_word_embeddings=False,
    ),
    # Gemma 4: five sliding layers (head_dim 256) to one global (512), the last layers of E4B
    # reading an earlier layer's keys and values, per-layer embeddings of 256 a layer.
    "gemma4-e4b": dict(
        arch="Gemma4ForCausalLM",
        **_GEMMA4,
        layer_pattern=6,
        hidden_size=2560,
        intermediate_size=10240,
        num_hidden_layers=42,
        num_attention_heads=8,
        num_key_value_heads=2,
        sliding_window=512,
        num_kv_shared_layers=18,
        hidden_size_per_layer_input=256,
        max_position_embeddings=131072,
    ),
    "gemma4-31b": dict(
        arch="Gemma4ForCausalLM",
        **_GEMMA4,
        layer_pattern=6,
        hidden_size=5376,
        intermediate_size=21504,
        num_hidden_layers=60,
        num_attention_heads=32,
        num_key_value_heads=16,
        num_global_key_value_heads=4,
        attention_k_eq_v=True,
        sliding_window=1024,
        num_kv_shared_layers=0,
        hidden_size_per_layer_input=0,
        max_position_embeddings=262144,
    ),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
MODEL_TYPES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "LlamaForCausalLM": "llama",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Gemma4ForCausalLM": "gemma4_text",
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer-from", required=True, help="a model folder with tokenizer files")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--device", default="cpu", help="where the random tensors are made (cuda: fast for 8B+)"
    )
    p.add_argument("--num-layers", type=int, help="fewer layers than the model has, same shapes")
    args = p.parse_args()
    if args.num_layers is not None and args.num_layers < 1:
        p.error(f"--num-layers must be >= 1, got {args.num_layers}")

    config, model = meta_model(args.shape, args.num_layers, getattr(torch, args.dtype))
    out = Path(args.out)
    need = weight_count(model, config) * getattr(torch, args.dtype).itemsize
    free = shutil.disk_usage(_existing(out)).free
    if need > free:
        p.error(
            f"{args.shape} with {config.num_hidden_layers} layers is {need / 1e9:.1f} GB in "
            f"{args.dtype}; {_existing(out)} has {free / 1e9:.1f} GB free: pass fewer --num-layers"
        )
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    params = write_random_weights(model, config, out, args.dtype, torch.device(args.device))
    for name in TOKENIZER_FILES:
        src = Path(args.tokenizer_from) / name
        if src.is_file() and not (out / name).exists():
            shutil.copy(src, out / name)
    print(
        f"{args.shape}, {config.num_hidden_layers} layers: {params / 1e6:.0f}M parameters, "
        f"{args.dtype}, written to {out}"
    )


def meta_model(shape: str, num_layers: int | None, dtype: torch.dtype):
    """(the Hugging Face config, the model on the meta device) of a shape: every tensor's
    name and shape, with nothing allocated or initialised; the values are made one at a time."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(SHAPES[shape])
    arch = spec.pop("arch")
    if num_layers is not None:
        spec["num_hidden_layers"] = num_layers
        if spec.get("num_kv_shared_layers"):  # keep the share of layers that read another's,
            full = SHAPES[shape]["num_hidden_layers"]  # a global layer among those that store
            shared = spec["num_kv_shared_layers"] * num_layers // full
            spec["num_kv_shared_layers"] = max(0, min(shared, num_layers - spec["layer_pattern"]))
    pattern = spec.pop("layer_pattern", None)
    if pattern:  # Gemma 4: pattern - 1 sliding layers, then a global one, repeated
        spec["layer_types"] = [
            "full_attention" if i % pattern == pattern - 1 else "sliding_attention"
            for i in range(spec["num_hidden_layers"])
        ]
    config = AutoConfig.for_model(MODEL_TYPES[arch], architectures=[arch], **spec)
    with torch.device("meta"):
        return config, AutoModelForCausalLM.from_config(config, dtype=dtype)


def weight_count(model, config) -> int:
    """Parameters written: a tied LM head once."""
    return sum(
        t.numel()
        for name, t in model.state_dict().items()
        if not (name == "lm_head.weight" and config.tie_word_embeddings)
    )


def _existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def write_random_weights(model, config, out: Path, dtype: str, device: torch.device) -> int:
    """Norm weights 1, biases 0, everything else N(0, 0.02), in shards of at most 4 GB."""
    from safetensors.torch import save_file

    gen = torch.Generator(device).manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, index, total, n = 0, {}, 0, 0

    def flush() -> None:
        nonlocal shard, shard_bytes, n
        n += 1
        save_file(shard, str(out / f"model-{n:05d}.safetensors"), metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, f"model-{n:05d}.safetensors"))
        shard, shard_bytes = {}, 0

    for name, meta in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # the embedding is the LM head
        t = torch.empty(meta.shape, dtype=getattr(torch, dtype), device=device)
        if "norm" in name:
            t.fill_(1.0)
        elif name.endswith(".bias"):
            t.zero_()
        else:
            t.normal_(0.0, 0.02, generator=gen)
        shard[name] = t.cpu()
        shard_bytes += t.numel() * t.element_size()
        total += t.numel()
        if shard_bytes >= 4 * 2**30:
            flush()
    if shard:
        flush()
    weight_map = {"metadata": {"total_size": total * 2}, "weight_map": index}
    (out / "model.safetensors.index.json").write_text(json.dumps(weight_map, indent=1))
    return total


if __name__ == "__main__":
    main()
