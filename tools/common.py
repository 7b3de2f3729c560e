"""What the tools that build an engine share, so that each says it once and alike.

Every benchmark and profiler picks a model, a device, a dtype and, where it builds the
whole engine, an attention backend and a number of ranks. Declared tool by tool, the same
flag had different defaults (`--device cuda` here, the GPU if there is one there; bf16 on
the CPU in one tool, fp32 in the next). Here they are declared once, with one rule for
each default, and turned into the `LLM` arguments in one place. A tool runs as
`python tools/X.py`, which puts this folder on sys.path: `from common import ...` works.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch

DTYPES = ("bfloat16", "float16", "float32")


def add_device_args(p: argparse.ArgumentParser) -> None:
    """--device and --dtype, for tools that run kernels or layers without a model."""
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda (the default where there is a GPU) or cpu",
    )
    p.add_argument("--dtype", choices=DTYPES, help="default: bfloat16 on a GPU, float32 on the CPU")


def add_engine_args(
    p: argparse.ArgumentParser,
    *,
    model: str | None = None,
    attn: str | None = "auto",
    tp_size: int | None = 1,
) -> None:
    """--model (required unless given a default) and the device arguments; --attn and
    --tp-size, with the server's meaning, unless their default is None (the tool has none)."""
    p.add_argument("--model", required=model is None, default=model, help="a model folder")
    add_device_args(p)
    if attn is not None:
        p.add_argument("--attn", default=attn, help="attention backend (--attn of the server)")
    if tp_size is not None:
        p.add_argument(
            "--tp-size", type=int, default=tp_size, help="ranks (GPUs) the model is cut over"
        )
    if attn is not None:  # a tool that builds the whole engine
        p.add_argument(
            "--speculative", default="off", help="off, ngram, suffix or draft: draft and verify"
        )
        p.add_argument("--num-draft-tokens", type=int, default=8, help="with --speculative")
        p.add_argument("--draft-model", help="with --speculative draft: a smaller model folder")
        p.add_argument("--quantization", choices=["fp8"], help="fp8: FP8 weights")  # [ch28]
        p.add_argument("--kv-cache-dtype", default="auto", help="fp8_e4m3: FP8 K/V")  # [ch28]


def parse(p: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed arguments, with --dtype filled in from the device when it was not given."""
    args = p.parse_args(argv)
    if args.dtype is None:
        args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    return args


def engine_kwargs(args: argparse.Namespace, **override: Any) -> dict[str, Any]:
    """The keyword arguments of `LLM(...)` that the shared flags set; `override` wins."""
    kw: dict[str, Any] = {
        "model_path": args.model,
        "dtype": getattr(torch, args.dtype),
        "device": args.device,
    }
    if "attn" in args:
        kw["attention_backend"] = args.attn
    if "tp_size" in args:
        kw["tp_size"] = args.tp_size
    if getattr(args, "speculative", "off") != "off":
        kw["speculative"], kw["num_draft_tokens"] = args.speculative, args.num_draft_tokens
        if args.speculative == "draft":
            kw["draft_model"] = args.draft_model
    if getattr(args, "quantization", None):  # [ch28]
        kw["quantization"] = args.quantization  # [ch28]
    if getattr(args, "kv_cache_dtype", "auto") != "auto":  # [ch28]
        kw["kv_cache_dtype"] = args.kv_cache_dtype  # [ch28]
    return {**kw, **override}


def sync(device: str) -> None:
    """Wait for the GPU's queued work, so that a host clock read after it counts it."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def weight_bytes(path: str, itemsize: int) -> int:
    """Bytes of all weights in the folder's safetensors files, at `itemsize` per value
    (a tied embedding counts once: one decode step reads it once, as the LM head)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118
    return total * itemsize


def parse_variants(spec: str) -> dict[str, dict[str, str]]:
    """ "a:X=1,Y=on;b:X=0" -> {"a": {"X": "1", "Y": "on"}, "b": {"X": "0"}}, knobs checked."""
    from minisgl.env import ENV

    variants = {}
    for item in filter(None, (v.strip() for v in spec.split(";"))):
        name, _, knobs = item.partition(":")
        settings = dict(kv.split("=", 1) for kv in filter(None, knobs.split(",")))
        for knob in settings:
            if not hasattr(ENV, knob):
                raise SystemExit(f"--variants: MINISGL_{knob} is not a knob of minisgl.env")
        variants[name] = settings
    return variants


def set_knobs(settings: dict[str, str]) -> None:
    from minisgl.env import ENV

    for knob, raw in settings.items():
        var = getattr(ENV, knob)
        kind = type(var.default)
        if kind is bool or var.default is None:
            var.value = raw.lower() in ("1", "true", "yes", "on")
        else:
            var.value = kind(raw)
