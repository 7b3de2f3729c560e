"""Chapter 18: CUDA graphs emulated on CPU - padding, replay, and what one missed copy does."""

import torch

from minisgl.core import SamplingParams
from minisgl.engine.graph import GraphCaptureBuffer
from minisgl.env import ENV
from minisgl.llm import LLM

ENV.DISABLE_OVERLAP_SCHEDULING.value = True
PROMPTS = ["The capital of France is", "List three prime numbers:", "def fibonacci(n):"]
KW = dict(dtype=torch.float32, max_running_req=8, num_page_override=512, max_seq_len_override=128)


def run(cuda_graph_max_bs):
    llm = LLM("models/SmolLM2-135M-Instruct", cuda_graph_max_bs=cuda_graph_max_bs, **KW)
    runner = llm.engine.graph_runner
    log = []
    orig = runner.replay
    runner.replay = lambda b: (log.append(f"{b.size}->{b.padded_size}"), orig(b))[1]
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    sizes = sorted(runner.graph_map)
    llm.shutdown()
    return [o["token_ids"] for o in out], sizes, log


eager, _, _ = run(0)
graph, sizes, log = run(4)
print("captured batch sizes:", sizes)
print("replay per decode step (live -> padded):", log)
print("same output as eager:", graph == eager)

orig_copy = GraphCaptureBuffer.copy_from


def buggy_copy_from(self, batch):  # forgets positions
    s = slice(batch.padded_size)
    self.input_ids[s] = batch.input_ids
    self.out_loc[s] = batch.out_loc


GraphCaptureBuffer.copy_from = buggy_copy_from
wrong, _, _ = run(4)
GraphCaptureBuffer.copy_from = orig_copy
print("same output as eager after forgetting positions:", wrong == eager)
print("  right:", eager[0])
print("  wrong:", wrong[0])
