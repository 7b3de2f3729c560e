"""Chapter 28: FP8 weights - e4m3, a scale per row or per block, and half the bytes to read.

Rounds a few numbers to e4m3, quantises one of SmolLM2's projections with one scale per
row and with one per block of 128 x 128, runs the FP8 GEMV against the dequantised
reference, then loads SmolLM2 with quantization="fp8" and generates beside the model as
it is. On a CPU the kernel runs in Triton's interpreter and the model in the reference
path (the interpreter would take minutes per token); on a GPU both are compiled.
"""

import os

import torch

device = "cuda" if torch.cuda.is_available() else "cpu"
if device == "cpu":  # must be set before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

from safetensors import safe_open  # noqa: E402

from minisgl.core import SamplingParams  # noqa: E402
from minisgl.kernels.fp8_gemv import fp8_gemv  # noqa: E402
from minisgl.llm import LLM  # noqa: E402
from minisgl.quant.fp8 import FP8, dequantize, quantize_blocks, quantize_rows  # noqa: E402
from minisgl.quant.fp8 import reference as fp8_reference  # noqa: E402
from minisgl.quant.quantize import projections  # noqa: E402

MODEL = "models/SmolLM2-135M-Instruct"
torch.manual_seed(0)

values = torch.tensor([0.3, 1.07, 1.19, 17.3, 300.0, 448.0])
print("e4m3 keeps 3 bits of mantissa, magnitudes up to", torch.finfo(FP8).max)
print("  ", [f"{v:g} -> {r:g}" for v, r in zip(values.tolist(), values.to(FP8).float().tolist())])

with safe_open(f"{MODEL}/model.safetensors", framework="pt") as f:
    w = f.get_tensor("model.layers.3.mlp.gate_proj.weight").float().to(device)
print(f"\ngate_proj of layer 3: {tuple(w.shape)}, largest |w| {w.abs().max():.3f}")
for label, (q, scale), block in [
    ("one scale per row", quantize_rows(w), (1, w.size(1))),
    ("per 128 x 128 block", quantize_blocks(w, (128, 128)), (128, 128)),
]:
    error = (dequantize(q, scale, block) - w).abs().mean() / w.abs().mean()
    print(f"  {label:<20} {q.numel() + 4 * scale.numel():>8} bytes (bf16: {2 * w.numel()}),"
          f" {tuple(scale.shape)} scales, mean error {100 * error:.2f}% of mean |w|")  # fmt: skip

    x = torch.randn(1, w.size(1), device=device)
    got, want = fp8_gemv(x, q, scale, block), fp8_reference(x, q, scale, block)
    gap = (got - want).abs().max()
    print(f"  {'':<20} FP8 GEMV on {device}: max |kernel - reference| {gap:.1e}")

os.environ.pop("TRITON_INTERPRET", None)  # the model: the reference path on a CPU
prompts = ["The capital of France is", "Water boils at a temperature of"]
params = SamplingParams(max_tokens=8)
for quantization in (None, "fp8"):
    llm = LLM(MODEL, device=device, quantization=quantization, max_running_req=2)
    layers = [layer for _, layer in projections(llm.engine.model)]
    size = sum(layer.weight.numel() * layer.weight.element_size() for layer in layers)
    out = llm.generate(prompts, params, use_tqdm=False)
    kind = f"{quantization or 'as loaded'}: {len(layers)} projections in {layers[0].weight.dtype}"
    print(f"\n{kind}, {size / 1e6:.0f} MB")
    for prompt, o in zip(prompts, out):
        print(f"  {prompt!r} -> {o['text']!r}")
    llm.shutdown()
