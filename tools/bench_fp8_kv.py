"""How much an FP8 KV cache changes what the model says, with and without calibrated scales.

    python tools/bench_fp8_kv.py --model models/SmolLM2-135M-Instruct --device cpu

Three runs of the same engine differ only in the KV cache: the model's dtype (the
reference), e4m3 stored as it is (scale 1.0, `--kv-cache-dtype fp8_e4m3`), and e4m3 with
one scale per layer for the keys and one for the values, max|K| / 448 and max|V| / 448 as
the reference run saw them on a calibration text (not the one measured). The calibrated
scales reach the engine the way a checkpoint's do: a folder with the model's files linked
and one more safetensors file of `model.layers.N.self_attn.k_scale` / `v_scale` tensors.

Each run teacher-forces the same text: a prefill of its first half, then one decode step
per token, as a server computes them. Reported per run against the reference: how often
the likeliest next token is the same, and KL(reference || FP8) of the next-token
distribution (mean and largest over the positions); then greedy text on chat prompts, as
`bench_fp8.py agreement` compares it.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import tempfile
from pathlib import Path

import torch
from bench_fp8 import PROMPTS, agreement, chat_prompts
from common import add_engine_args, parse

TEXT = (
    "Lighthouses were among the first public works that served every ship alike. The "
    "oldest known, the Pharos of Alexandria, stood for well over a thousand years before "
    "earthquakes brought it down, and its name became the word for a lighthouse in several "
    "languages. For most of their history the lights were fires of wood or coal, and later "
    "candles and oil lamps, burning in an open tower or behind glass. The light they gave "
    "was weak and scattered in every direction, so that a keeper could do little more than "
    "mark a harbour mouth on a clear night. The change came in the early nineteenth century, "
    "when the French engineer Augustin Fresnel designed a lens built from rings of glass "
    "prisms. Each ring bent the light from a single lamp into a narrow horizontal beam, and "
    "a lens that would have been impossibly thick and heavy as one piece of glass became "
    "thin enough to turn on a bed of mercury. With the lens rotating, the beam swept the "
    "horizon, and each station could be given its own pattern of flashes, so that a captain "
    "who saw two short flashes every ten seconds knew which coast lay ahead. Keepers lived "
    "at the stations with their families, trimming wicks, winding the clockwork that turned "
    "the lens and recording the weather in logbooks. Electric lamps, radio beacons and "
    "finally satellite navigation made most of that work unnecessary, and by the end of the "
    "twentieth century nearly every light had been automated. Many towers still stand, some "
    "as museums, others still lit, because a light on a headland remains the simplest thing "
    "a sailor can check when every instrument on board has failed."
)
CALIBRATION = (
    "The bread dough was left to rise overnight in a cool kitchen, covered with a damp "
    "cloth. In the morning the baker folded it, shaped two loaves and baked them in a very "
    "hot oven, opening the door once to let the steam escape so that the crust would crack "
    "and turn a deep brown. Good bread needs little more than flour, water, salt and time."
)


def teacher_forced(engine, ids: list[int], prefill: int, row: int = 0) -> torch.Tensor:
    """Logits [len(ids), vocab] after each token of `ids` (the first `prefill` in one forward,
    each further one in a decode step), in row `row` of the page table and its own slots."""
    from minisgl.core import Batch, Req, SamplingParams, set_global_ctx

    n, first = len(ids), row * engine.max_seq_len  # build() gives each row that many slots
    engine.page_table[row, :n] = torch.arange(first, first + n, dtype=torch.int32)
    engine.token_pool[row, :n] = torch.tensor(ids, dtype=torch.int32)
    req = Req(torch.tensor(ids[:prefill], dtype=torch.int32), row, 0, n - prefill, row,
              SamplingParams())  # fmt: skip
    set_global_ctx(engine.ctx)
    out = []
    for phase in ["prefill"] + ["decode"] * (n - prefill):
        batch = Batch([req], phase)  # type: ignore[arg-type]
        engine.prepare_batch(batch)
        with torch.inference_mode(), engine.ctx.forward_batch(batch):
            out.append(engine.model.lm_head.project(engine.model.model(batch.input_ids)))
        req.complete_one()
        if req.cached_len < n:
            req.append_host(ids[req.cached_len])
    return torch.cat(out).float()


def build(args: argparse.Namespace, model: str, kv_cache_dtype: str, tokens: int):
    from minisgl.engine.config import EngineConfig
    from minisgl.engine.engine import Engine

    """An engine of two rows (the text, the calibration text) of `tokens` slots each."""
    return Engine(EngineConfig(model, dtype=getattr(torch, args.dtype), device=args.device,
                               attention_backend=args.attn, kv_cache_dtype=kv_cache_dtype,
                               num_page_override=2 * tokens, max_running_req=2,
                               max_seq_len_override=tokens, cuda_graph_max_bs=0))  # fmt: skip


def calibrated_folder(model: Path, k: list[float], v: list[float], into: Path) -> Path:
    """`model`'s files linked into `into`, and the scales beside them as a checkpoint has
    them: one fp32 number per tensor, x = stored * scale."""
    from safetensors.torch import save_file

    for f in model.iterdir():
        (into / f.name).symlink_to(f.resolve())
    tensors = {}
    for i, (ks, vs) in enumerate(zip(k, v)):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor([ks])
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([vs])
    save_file(tensors, str(into / "kv_scales.safetensors"))
    return into


def compare(full: torch.Tensor, fp8: torch.Tensor) -> tuple[int, float, float]:
    """(positions with the same likeliest next token, mean and largest KL(full || fp8))."""
    same = int((full.argmax(-1) == fp8.argmax(-1)).sum())
    p, q = full.log_softmax(-1), fp8.log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)
    return same, float(kl.mean()), float(kl.max())


def where_values_fall(kv: list[torch.Tensor], scales: list[float]) -> tuple[float, float]:
    """Shares of the values in `kv` (one tensor per layer and K or V) that e4m3 would hold
    below 2^-6, in its subnormals (fewer bits), and beyond 448 (clipped), with `scales`."""
    low = high = total = 0
    for x, scale in zip(kv, scales):
        y = x.abs() / scale
        low, high = low + int(((y < 2**-6) & (y > 0)).sum()), high + int((y > 448).sum())
        total += y.numel()
    return low / total, high / total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(p, model="models/SmolLM2-135M-Instruct", tp_size=None)
    p.add_argument("--tokens", type=int, default=320, help="tokens of the text teacher-forced")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="chat prompts, greedy")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt")
    args = parse(p)
    from minisgl.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer(args.model)
    ids = tok.encode(TEXT)[: args.tokens]
    calibration = tok.encode(CALIBRATION)[: args.tokens]
    n, prefill = len(ids), len(ids) // 2
    engine = build(args, args.model, "auto", n)
    logits = {"full": teacher_forced(engine, ids, prefill)}
    teacher_forced(engine, calibration, len(calibration), row=1)
    layers, cache, table = range(engine.model_config.num_layers), engine.kv_cache, engine.page_table
    measured, seen = table[0, :n].long(), table[1, : len(calibration)].long()
    kv = [c(i)[measured].clone() for i in layers for c in (cache.k_cache, cache.v_cache)]
    k, v = ([float(c(i)[seen].abs().max()) / 448 for i in layers]
            for c in (cache.k_cache, cache.v_cache))  # fmt: skip
    full = str(engine.shape.kv_dtype).removeprefix("torch.")
    engine.shutdown()
    with tempfile.TemporaryDirectory() as tmp:
        folder = calibrated_folder(Path(args.model), k, v, Path(tmp))
        runs = {"fp8_e4m3, scale 1.0": args.model, "fp8_e4m3, calibrated": str(folder)}
        for label, path in runs.items():
            engine = build(args, path, "fp8_e4m3", n)
            logits[label] = teacher_forced(engine, ids, prefill)
            engine.shutdown()
        greedy = generate(args, {"full": args.model, **runs})
    scales = {"fp8_e4m3, scale 1.0": [1.0] * len(kv),
              "fp8_e4m3, calibrated": [s for pair in zip(k, v) for s in pair]}  # fmt: skip

    print(f"{args.model}, {args.dtype} on {args.device} ({machine(args.device)}), {args.attn} "
          f"attention, {datetime.date.today().isoformat()}")  # fmt: skip
    print(f"{n} tokens teacher-forced ({prefill} in the prefill, {n - prefill} decoded); "
          f"calibrated: max|K|, max|V| / 448 per layer over {len(calibration)} other tokens, "
          f"k_scale {min(k):.3g}-{max(k):.3g}, v_scale {min(v):.3g}-{max(v):.3g}\n")  # fmt: skip
    print("| K/V | K, V below 2^-6 | beyond 448 | same next token | KL(full \\|\\| fp8), mean "
          "| KL, largest |\n|---|---|---|---|---|---|")  # fmt: skip
    print(f"| {full} (full) | - | - | {n}/{n} | 0 | 0 |")
    for label in runs:
        low, high = where_values_fall(kv, scales[label])
        same, mean, top = compare(logits["full"], logits[label])
        print(f"| {label} | {100 * low:.1f}% | {100 * high:.2f}% | {same}/{n} "
              f"({100 * same / n:.1f}%) | {mean:.2e} | {top:.2e} |")  # fmt: skip
    print(f"\ngreedy, {args.prompts} chat prompts x {args.max_tokens} tokens, against {full} K/V:")
    for label in runs:
        print(f"  {label}: {agreement(greedy['full'], greedy[label], args.max_tokens)}")


def generate(args: argparse.Namespace, models: dict[str, str]) -> dict[str, list[list[int]]]:
    """Greedy tokens of the chat prompts from each folder: "full" in the model's dtype, the
    others with an FP8 KV cache."""
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    prompts = chat_prompts(args.model, args.prompts)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    out = {}
    for label, path in models.items():
        llm = LLM(path, dtype=getattr(torch, args.dtype), device=args.device,
                  attention_backend=args.attn, max_running_req=len(prompts),
                  kv_cache_dtype="auto" if label == "full" else "fp8_e4m3")  # fmt: skip
        out[label] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    return out


def machine(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    cpu = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpu.read_text().splitlines()
             if line.startswith("model name")] if cpu.exists() else []  # fmt: skip
    return f"{names[0] if names else platform.machine()}, {torch.get_num_threads()} threads"


if __name__ == "__main__":
    main()
