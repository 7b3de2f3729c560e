"""A check, not a benchmark: speculation on a hybrid model gives the plain tokens.

Drafts come from a plain run's own output (up to 3 a step, the second one wrong every third
step: verify steps that accept all, some and none of them), so every verify step has its
roll back to do; with verify graphs on, each verify replays a captured graph. Lossless
speculation must give the plain run's greedy tokens. In float32 they must be identical; in
bf16 a verify's forward rounds differently from a decode step's, and a random model's
nearly tied logits can part the two runs, so bf16 is reported, not checked: where each
request first parts, and the plain run's margin there (its top log-probability less the
second), beside its median margin over all tokens. Ties part runs at the small margins;
a roll back that lost state would part them anywhere.

    python tools/check_hybrid_speculation.py --model /root/qwen3.5-0.8b --dtype float32
    python tools/check_hybrid_speculation.py --model /tmp/q35 --device cpu --dtype float32 \
        --tokens 16   # our kernels need the interpreter there: TRITON_INTERPRET=1

Exit status 1 when float32 tokens differ. Models: `tools/make_random_model.py --shape
qwen3.5-0.8b`, or any hybrid checkpoint.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128, help="generated per request")
    args = p.parse_args()

    import torch
    from helpers import oracle_drafter

    from minisgl.core import SamplingParams
    from minisgl.llm import LLM
    from minisgl.models.config import ModelConfig
    from minisgl.speculative.ngram import NgramDrafter

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rng = torch.Generator().manual_seed(0)
    n = args.requests
    vocab = min(5000, ModelConfig.from_path(args.model).vocab_size)
    prompts = [torch.randint(vocab // 50, vocab, (64,), generator=rng).tolist() for _ in range(n)]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    plain = SamplingParams(max_tokens=args.tokens, ignore_eos=True, logprobs=True, top_logprobs=2)
    kw = dict(device=args.device, dtype=args.dtype, max_running_req=8)
    if not cuda:
        kw.update(cuda_graph_max_bs=4, num_page_override=64 * args.requests)
    out: dict[str, list[list[int]]] = {}
    margins: list[list[float]] = []  # the plain run's, per request and token
    for mode in ("off", "ngram"):
        spec = dict(speculative="ngram", speculative_always=True) if mode == "ngram" else {}
        if mode == "ngram":
            NgramDrafter.propose = oracle_drafter(prompts, out["off"], vocab)
        llm = LLM(args.model, **kw, **spec)
        runner = llm.engine.graph_runner
        replays = counted(runner)
        sync()
        began = time.perf_counter()
        results = llm.generate(prompts, plain if mode == "off" else params, use_tqdm=False)
        out[mode] = [o["token_ids"] for o in results]
        if mode == "off":
            margins = [[margin(t["top"]) for t in o["logprobs"]] for o in results]
        sync()
        ms = (time.perf_counter() - began) * 1e3
        s = llm.scheduler.spec
        taken = f"; drafts accepted {s.num_accepted} of {s.num_drafted}" if spec else ""
        print(
            f"{mode}: {ms:.0f} ms for {len(prompts)} x {args.tokens} tokens; verify graphs "
            f"{len(runner.graphs('verify'))}, replays: {replays.count('verify')} verify, "
            f"{replays.count('decode')} decode{taken}"
        )
        llm.shutdown()
    same = sum(a == b for a, b in zip(out["off"], out["ngram"]))
    print(f"speculation (oracle drafts) against plain: {same} of {len(prompts)} identical")
    for i, (a, b) in enumerate(zip(out["off"], out["ngram"])):
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if at is not None:
            mid = sorted(margins[i])[len(margins[i]) // 2]
            print(
                f"  request {i} parts at token {at}: the plain run's margin there "
                f"{margins[i][at]:.4f}, its median {mid:.4f}"
            )
    if args.dtype == "float32" and same < len(prompts):
        print("FAILED: float32 tokens must be identical")
        return 1
    return 0


def margin(top: dict[int, float]) -> float:
    """The top log-probability less the second: how near a tie the greedy choice was."""
    best = sorted(top.values(), reverse=True)
    return best[0] - best[1] if len(best) > 1 else float("inf")


def counted(runner: object) -> list[str]:
    """The phases of the graphs `runner` replays from now on, in order."""
    phases: list[str] = []
    replay = type(runner).replay

    def logged(batch):  # noqa: ANN001, ANN202
        phases.append(batch.phase)
        return replay(runner, batch)

    runner.replay = logged
    return phases


if __name__ == "__main__":
    sys.exit(main())
