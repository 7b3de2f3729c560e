"""How much of a multi-turn chat's prompts does the prefix cache serve for a hybrid model?

Several conversations share a system prompt and grow turn by turn: each turn's prompt is the
last turn's, the model's answer and a new message. Every round sends one turn of every
conversation at once, so they run side by side and queue for the running slots. The hit
rate is the share of prompt tokens served from the cache (`cached_tokens`) instead of
computed, for:
- a model whose every layer attends (Qwen3-style): the radix cache's own hit rate, the most
  a hybrid could reach;
- a hybrid (Qwen3.5-style: three Gated DeltaNet layers to one attention layer) with the
  radix cache and its state snapshots, at the default number and at a larger one;
- the same hybrid with the naive cache: nothing.
Each hybrid run's greedy tokens are checked against the naive cache's (they must be equal).

Both models are tiny and random (built with transformers into a temporary folder), in fp32
on the CPU: the hit rate depends on the scheduler and the cache, not on the weights.

    python tools/bench_prefix_cache_hybrid.py [--conversations 8 --turns 6 --page-size 1]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 512
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    tie_word_embeddings=True,
)  # fmt: skip
LINEAR: dict[str, Any] = dict(
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=32, linear_conv_kernel_dim=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                     "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                     "mrope_interleaved": True},
)  # fmt: skip


def build_models(out: Path, tokenizer_from: Path) -> dict[str, Path]:
    """A tiny Qwen3 and a tiny Qwen3.5 (text), random from seed 0, with a tokenizer each."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    models = {
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(**COMMON)),
        "qwen3_5": (Qwen3_5ForCausalLM, Qwen3_5TextConfig(**COMMON, **LINEAR)),
    }
    paths = {}
    for name, (cls, config) in models.items():
        torch.manual_seed(0)
        model = cls(config).float()
        with torch.no_grad():  # every weight random (some start as zeros or ones)
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        model.save_pretrained(out / name)
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tokenizer_from / f).is_file():
                shutil.copy(tokenizer_from / f, out / name / f)
        paths[name] = out / name
    return paths


def ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def chat(path: Path, args: argparse.Namespace, **config: Any) -> tuple[int, int, list, float, int]:
    """Run the conversations; (prompt tokens, cached tokens, every answer, seconds, the
    snapshots the engine kept)."""
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    llm = LLM(str(path), device="cpu", dtype="float32", max_running_req=args.max_running,
              page_size=args.page_size, **config)  # fmt: skip
    pool = llm.engine.state_pool
    snapshots = pool.num_snapshots if pool is not None else 0
    params = SamplingParams(max_tokens=args.answer, ignore_eos=True)
    system = ids(0, args.system)
    prompts = [system + ids(1000 + c, args.message) for c in range(args.conversations)]
    prompt_tokens = cached = 0
    answers = []
    start = time.perf_counter()
    for turn in range(args.turns):
        out = llm.generate(prompts, params, use_tqdm=False)
        prompt_tokens += sum(len(p) for p in prompts)
        cached += sum(o["cached_tokens"] for o in out)
        answers.append([o["token_ids"] for o in out])
        prompts = [p + o["token_ids"] + ids(2000 + 100 * turn + c, args.message)
                   for c, (p, o) in enumerate(zip(prompts, out))]  # fmt: skip
    seconds = time.perf_counter() - start
    llm.scheduler.check_integrity()
    llm.shutdown()
    return prompt_tokens, cached, answers, seconds, snapshots


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system", type=int, default=48, help="tokens of the shared system prompt")
    p.add_argument("--message", type=int, default=12, help="tokens of each user message")
    p.add_argument("--answer", type=int, default=8, help="tokens of each answer")
    p.add_argument("--max-running", type=int, default=4, help="--max-running-requests")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--few", type=int, default=4, help="snapshots in the run that has few")
    p.add_argument("--tokenizer-from", type=Path, default=ROOT / "models" / "tiny-llama")
    args = p.parse_args(argv)
    if not (args.tokenizer_from / "tokenizer.json").is_file():
        p.error(f"--tokenizer-from: no tokenizer.json in {args.tokenizer_from}; try `make models`")
    longest = args.system + args.turns * (args.message + args.answer)
    if longest > COMMON["max_position_embeddings"]:
        p.error(f"the last turn would hold {longest} tokens, more than the models' 1024")

    with tempfile.TemporaryDirectory() as tmp:
        paths = build_models(Path(tmp), args.tokenizer_from)
        runs = [
            ("Qwen3 (attention only)", "radix", paths["qwen3"], {}),
            ("Qwen3.5 (hybrid)", "radix, {} snapshots (default)", paths["qwen3_5"], {}),
            ("Qwen3.5 (hybrid)", "radix, {} snapshots", paths["qwen3_5"],
             {"state_snapshots": args.few}),
            ("Qwen3.5 (hybrid)", "naive", paths["qwen3_5"], {"cache_type": "naive"}),
        ]  # fmt: skip
        results = [chat(path, args, **config) for _, _, path, config in runs]

    naive_answers = results[-1][2]
    print(
        f"multi-turn chat: {args.conversations} conversations x {args.turns} turns, "
        f"side by side (a {args.system}-token system prompt shared, {args.message}-token "
        f"messages, {args.answer}-token answers); max_running_req {args.max_running}, "
        f"page_size {args.page_size}; tiny random models, fp32, CPU"
    )
    print(f"{'model':24} {'cache':32} {'prompt tok':>10} {'cached':>8} {'hit rate':>8} {'s':>6}")
    for (model, cache, _, _), (prompt, cached, answers, seconds, n) in zip(runs, results):
        same = "" if model.startswith("Qwen3 ") or answers == naive_answers else "  TOKENS DIFFER"
        print(f"{model:24} {cache.format(n):32} {prompt:10d} {cached:8d} {cached / prompt:8.1%} "
              f"{seconds:6.1f}{same}")  # fmt: skip


if __name__ == "__main__":
    main()
