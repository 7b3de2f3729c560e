"""Chapter 6: sampling. One batched call turns logits into tokens for requests that each
want something different: greedy, temperature, top-k, top-p, a seed.

Run from the repo root: python examples/ch06_sampling.py
"""

import torch

from minisgl.core import Req, SamplingParams
from minisgl.engine.sample import prepare_sampling, sample

cpu = torch.device("cpu")
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])  # a made-up 8-word vocab
V = len(LOGITS)


def req(params: SamplingParams, prompt_len: int = 5, uid: int = 0) -> Req:
    return Req(torch.zeros(prompt_len, dtype=torch.int32), uid, 0, 16, uid, params)


def draw(reqs: list[Req]) -> list[int]:
    """One sampled token per request, all from the same logits row."""
    args = prepare_sampling(reqs, V, cpu)
    return sample(LOGITS.expand(len(reqs), V).contiguous(), args).tolist()


print(f"logits        {LOGITS.tolist()}")
print(f"softmax       {[round(p, 3) for p in LOGITS.softmax(-1).tolist()]}")

# 1. A mixed batch: every row follows its own parameters, in one call.
mixed = {
    "greedy": SamplingParams(),
    "T=0.7, seed 1": SamplingParams(temperature=0.7, seed=1),
    "T=1, top_k=2, seed 2": SamplingParams(temperature=1.0, top_k=2, seed=2),
    "T=1, top_p=0.5, seed 3": SamplingParams(temperature=1.0, top_p=0.5, seed=3),
    "T=5, seed 4": SamplingParams(temperature=5.0, seed=4),
}
tokens = draw([req(p, uid=i) for i, p in enumerate(mixed.values())])
print("\none mixed batch:")
for name, t in zip(mixed, tokens, strict=True):
    print(f"  {name:<24} -> token {t}")

# 2. A seeded request draws the same token alone, or in any batch at any row.
seeded = SamplingParams(temperature=1.0, seed=1234)
alone = draw([req(seeded)])[0]
others = [req(SamplingParams(temperature=1.0, seed=s), uid=s) for s in range(7)]
in_batch = draw(others[:3] + [req(seeded, uid=99)] + others[3:])[3]
print(f"\nseed 1234 alone -> {alone}; the same request as row 3 of 8 -> {in_batch}")
assert alone == in_batch, "a seeded draw depended on its batch"
# ... and the draw moves on with the position, so a sequence does not repeat one token.
steps = [draw([req(seeded, prompt_len=n)])[0] for n in range(5, 15)]
print(f"seed 1234 at positions 5..14 -> {steps}")


# 3. Many seeds at once: the frequencies approach softmax(logits / T), with the filters applied.
def histogram(params: dict, n: int = 20000) -> torch.Tensor:
    reqs = [req(SamplingParams(**params, seed=s), uid=s) for s in range(n)]
    return torch.bincount(torch.tensor(draw(reqs)), minlength=V) / n


def show(name: str, freq: torch.Tensor, want: torch.Tensor) -> float:
    print(f"  {name:<14} sampled {[round(f, 3) for f in freq.tolist()]}")
    print(f"  {'':<14} expected {[round(p, 3) for p in want.tolist()]}")
    return (freq - want).abs().max().item()


print("\n20000 draws each:")
T = 0.8
err = show(f"T={T}", histogram({"temperature": T}), (LOGITS / T).softmax(-1))
top3 = torch.where(torch.arange(V) < 3, LOGITS, float("-inf")).softmax(-1)
err = max(err, show("T=1, top_k=3", histogram({"temperature": 1.0, "top_k": 3}), top3))
# top_p=0.8: the top three hold 0.403 + 0.244 + 0.148 = 0.795 < 0.8, so the 4th is kept too.
top4 = torch.where(torch.arange(V) < 4, LOGITS, float("-inf")).softmax(-1)
err = max(err, show("T=1, top_p=0.8", histogram({"temperature": 1.0, "top_p": 0.8}), top4))
print(f"largest gap between sampled and expected frequency: {err:.3f}")
if err > 0.02:
    raise SystemExit("sampled frequencies do not follow the distribution")
