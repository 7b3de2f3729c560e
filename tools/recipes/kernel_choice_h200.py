"""Decode ms per step by batch size on four model shapes, our GEMV where the start-up
measurement chose it against the GEMV switched off, in one table.

    PYTHONPATH=. python tools/recipes/kernel_choice_h200.py --out /tmp/shapes   # ~8 min, H200

For Qwen3-0.6B, Qwen3-8B, Qwen3-14B and Qwen3-30B-A3B (12 of its 48 layers, real shapes) one
after the other: make the random model (tools/make_random_model.py, on the GPU), run
tools/bench_latency.py on it with `--gemv auto,off` (graphs for the batch sizes only, no
prefill graphs, no eager or Hugging Face runs), delete the model (the 14B alone is 30 GB of a
64 GB disk). The table: ms per decode step with the choice (`auto`, the default) and with
MINISGL_GEMV=off (the matmul library everywhere), and the weights' GB/s at batch 1. Every
engine's log has the measured GEMV table ("GEMV or the matmul library") and its start-up
phases ("engine ready in"); they are kept in OUT/<shape>.log.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent.parent
SHAPES = [("qwen3-0.6b", None), ("qwen3-8b", None), ("qwen3-14b", None), ("qwen3-30b-a3b", 12)]


def run(cmd: list[str], log: Path) -> None:
    with log.open("a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}; see {log}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="a folder for the models (one at a time) and logs")
    p.add_argument("--tokenizer-from", default="models/SmolLM2-135M-Instruct")
    p.add_argument("--batch-sizes", default="1,2,4,8,64")
    p.add_argument("--shapes", default=",".join(s for s, _ in SHAPES))
    p.add_argument("--attn", default="auto")
    p.add_argument("--keep", action="store_true", help="keep the models")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    layers = dict(SHAPES)
    results = {}
    for shape in args.shapes.split(","):
        model, log = out / shape, out / f"{shape}.log"
        log.unlink(missing_ok=True)
        if not (model / "config.json").is_file():
            extra = ["--num-layers", str(layers[shape])] if layers.get(shape) else []
            run([sys.executable, str(TOOLS / "make_random_model.py"), "--shape", shape,
                 "--out", str(model), "--tokenizer-from", args.tokenizer_from,
                 "--device", "cuda", *extra], log)  # fmt: skip
        report = out / f"{shape}.json"
        run([sys.executable, str(TOOLS / "bench_latency.py"), "--model", str(model),
             "--attn", args.attn, "--gemv", "auto,off", "--batch-sizes", args.batch_sizes,
             "--output-len", "128", "--step-tokens", "32", "--prefill-graph", "off",
             "--skip-hf", "--skip-eager", "--output-json", str(report)], log)  # fmt: skip
        results[shape] = json.loads(report.read_text())
        if not args.keep:
            shutil.rmtree(model)
        print_table(results, args.batch_sizes)


def print_table(results: dict, batch_sizes: str) -> None:
    print("\nms per decode step (batch 1: ms per token over 128 tokens), GEMV chosen by")
    print("measurement (auto) or off; GB/s: weights read per token at batch 1\n")
    print(
        "| shape | batch | auto ms | off ms | off / auto | auto GB/s |\n|---|---|---|---|---|---|"
    )
    for shape, r in results.items():
        auto, off = r["graphs"], r["graphs, GEMV off"]
        gbs = r.get("weight_bytes", 0) / auto["batch1_ms"] / 1e6
        print(f"| {shape} | 1 (128 tokens) | {auto['batch1_ms']:.3f} | {off['batch1_ms']:.3f} "
              f"| {off['batch1_ms'] / auto['batch1_ms']:.2f}x | {gbs:.0f} |")  # fmt: skip
        for bs in batch_sizes.split(","):
            a, o = auto["steps"][bs][0], off["steps"][bs][0]
            print(f"| {shape} | {bs} | {a:.3f} | {o:.3f} | {o / a:.2f}x | |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
