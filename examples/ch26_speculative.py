"""Chapter 26: speculative decoding with n-gram and suffix drafts, on the CPU: the same tokens,
fewer steps.

(A CPU computes every drafted token's forward for real, so there it saves steps, not time;
a GPU, bound by launching kernels, checks a few tokens for about the price of one.)
"""

import torch

from minisgl.core import SamplingParams
from minisgl.env import ENV
from minisgl.llm import LLM

ENV.DISABLE_OVERLAP_SCHEDULING.value = True
CODE = "def area(width, height):\n    return width * height\n\n"
PROMPTS = [
    "Copy this line twice: the cat sat on the mat. the cat sat on the mat.",
    CODE + "Rewrite the function above with a docstring:\n" + CODE,
]
KW = dict(dtype=torch.float32, max_running_req=4, num_page_override=512, max_seq_len_override=256)
PARAMS = SamplingParams(max_tokens=32, ignore_eos=True)


def run(**kw):
    llm = LLM("models/SmolLM2-135M-Instruct", **kw, **KW)
    steps, step = [], llm.scheduler.step
    llm.scheduler.step = lambda: (steps.append(1), step())[1]
    out = [o["token_ids"] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    spec = llm.scheduler.spec
    if kw.get("speculative") == "suffix":  # the same prompts again: the answers are known
        first = spec.num_drafted, spec.num_accepted
        again = [o["token_ids"] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        print("suffix drafts, same tokens:", out == again)
        print(f"accepted {first[1]} of {first[0]} drafts, asked again", end=" ")
        print(f"{spec.num_accepted - first[1]} of {spec.num_drafted - first[0]}")
    llm.shutdown()
    return out, len(steps), spec


plain, plain_steps, _ = run()
# Always: verify every draft. By default a verify step is taken only where the step times
# measured so far say it pays, and on a CPU, which computes every drafted token, it may not.
fast, fast_steps, spec = run(speculative="ngram", num_draft_tokens=4, speculative_always=True)
print("same tokens as without drafts:", fast == plain)
print(f"forward steps: {plain_steps} without drafts, {fast_steps} with")
print(f"drafted {spec.num_drafted} tokens, accepted {spec.num_accepted}")

emulated, _, _ = run(speculative="ngram", cuda_graph_max_bs=4, speculative_always=True)
print("with emulated verify graphs, same tokens:", emulated == plain)

suffix, _, _ = run(speculative="suffix", num_draft_tokens=4, speculative_always=True)
print("suffix drafts equal plain decoding:", suffix == plain)
