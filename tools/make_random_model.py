"""A model folder with random weights in a real model's shape, for speed measurements.

Speed does not depend on weight values, so a benchmark can run a published architecture
without its weights (which a machine with no model hub cannot fetch). The tokenizer files
come from an existing folder; prompts in benchmarks are random token ids anyway.

    python tools/make_random_model.py --shape qwen3-0.6b --out /tmp/qwen3-0.6b \\
        --tokenizer-from models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

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
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer-from", required=True, help="a model folder with tokenizer files")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--device", default="cpu", help="where the random tensors are made (cuda: fast for 8B+)"
    )
    args = p.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(SHAPES[args.shape])
    arch = shape.pop("arch")
    model_type = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}[arch]
    config = AutoConfig.for_model(model_type, architectures=[arch], **shape)
    # The module tree on the meta device gives every tensor's name and shape without
    # allocating or initialising anything; the values are made one tensor at a time.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    params = write_random_weights(model, config, out, args.dtype, torch.device(args.device))
    for name in TOKENIZER_FILES:
        src = Path(args.tokenizer_from) / name
        if src.is_file() and not (out / name).exists():
            shutil.copy(src, out / name)
    print(f"{args.shape}: {params / 1e6:.0f}M parameters, {args.dtype}, written to {out}")


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
    import json

    weight_map = {"metadata": {"total_size": total * 2}, "weight_map": index}
    (out / "model.safetensors.index.json").write_text(json.dumps(weight_map, indent=1))
    return total


if __name__ == "__main__":
    main()
