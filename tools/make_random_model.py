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
    args = p.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(SHAPES[args.shape])
    arch = shape.pop("arch")
    model_type = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}[arch]
    config = AutoConfig.for_model(model_type, architectures=[arch], **shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    out = Path(args.out)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        src = Path(args.tokenizer_from) / name
        if src.is_file() and not (out / name).exists():
            shutil.copy(src, out / name)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"{args.shape}: {params:.0f}M parameters, {args.dtype}, written to {out}")


if __name__ == "__main__":
    main()
