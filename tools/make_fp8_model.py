"""An FP8 copy of a model folder, in Hugging Face's block-scaled layout.

That is the layout DeepSeek-V3 and the Qwen3-*-FP8 checkpoints ship in. None can be
downloaded here, so this makes one from any of our folders (a real model's, or a random
one from make_random_model.py): every projection weight of the decoder layers (q/k/v/o,
gate/up/down, each expert's too) is stored as float8_e4m3fn, with `<name>.weight_scale_inv`
beside it, one fp32 multiplier per block of --block-size x --block-size weights
([ceil(rows / block), ceil(columns / block)]). Embeddings, the LM head, norms and routers
are copied as they are, and config.json gains the `quantization_config` that says all
this. minisgl loads the result as it is, with no flag.

    python tools/make_fp8_model.py models/SmolLM2-135M-Instruct /tmp/smollm2-fp8
    python tools/make_fp8_model.py /tmp/qwen3-8b /tmp/qwen3-8b-fp8 --device cuda
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minisgl.quant.fp8 import quantize_blocks

PROJECTION = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")
INDEX = "model.safetensors.index.json"


def convert_file(src: Path, dst: Path, block: tuple[int, int], device: str) -> dict[str, str]:
    """Write src's tensors to dst, projections in FP8 with their scales; returns the names
    of the scales added (for the index)."""
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(src), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
            tensor = f.get_tensor(name)
            if PROJECTION.search(name) and tensor.dim() == 2:
                q, scale = quantize_blocks(tensor.to(device), block)
                out[name], out[f"{name}_scale_inv"] = q.cpu(), scale.cpu()
            else:
                out[name] = tensor
    save_file(out, str(dst), metadata={"format": "pt"})
    return {name: dst.name for name in out if name.endswith("_scale_inv")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("src", help="a model folder (bf16, fp16 or fp32 safetensors)")
    p.add_argument("out", help="the folder to write")
    p.add_argument("--block-size", type=int, default=128, help="rows and columns per scale")
    p.add_argument("--device", default="cpu", help="where to quantise (cuda: fast for 8B+)")
    args = p.parse_args()
    src, out = Path(args.src), Path(args.out)
    raw = json.loads((src / "config.json").read_text())
    if raw.get("quantization_config"):
        p.error(f"{src} is already quantised ({raw['quantization_config'].get('quant_method')})")
    if args.block_size < 1:
        p.error("--block-size must be >= 1")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        p.error(f"no *.safetensors files in {src}")
    out.mkdir(parents=True, exist_ok=True)
    block = (args.block_size, args.block_size)
    scales: dict[str, str] = {}
    for file in files:
        scales.update(convert_file(file, out / file.name, block, args.device))
        print(f"{file.name}: projections in FP8, blocks of {block[0]} x {block[1]}")
    raw["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    for item in src.iterdir():  # the tokenizer and the rest, as they are
        if item.is_file() and item.suffix != ".safetensors" and item.name != "config.json":
            shutil.copy(item, out / item.name)
    if (src / INDEX).is_file():
        index = json.loads((src / INDEX).read_text())
        index["weight_map"].update(scales)
        (out / INDEX).write_text(json.dumps(index, indent=1))
    print(f"{len(scales)} weights in FP8 with their scales, written to {out}")


if __name__ == "__main__":
    main()
