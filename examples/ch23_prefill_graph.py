"""Chapter 23: prefill graphs, breakable and full, emulated on CPU; and two ways to break them."""

import torch

from minisgl.core import SamplingParams
from minisgl.engine.breakable import BoundaryBuffers
from minisgl.env import ENV
from minisgl.llm import LLM

ENV.DISABLE_OVERLAP_SCHEDULING.value = True
PROMPTS = ["The capital of France is", "List three prime numbers:", "def fibonacci(n):"]
KW = dict(dtype=torch.float32, max_running_req=4, num_page_override=512, max_seq_len_override=128)
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def run(mode):
    graphs = dict(prefill_graph=mode, prefill_graph_tokens=[8, 16, 32])
    llm = LLM("models/SmolLM2-135M-Instruct", **graphs, **KW)
    runner, log = llm.engine.graph_runner, []
    replay = runner.replay

    def logged(batch):
        if batch.is_prefill:
            tokens = sum(r.extend_len for r in batch.reqs)
            padded = sum(r.extend_len for r in batch.padded_reqs)
            log.append(f"{batch.size} reqs/{tokens} tokens -> {batch.padded_size} slots/{padded}")
        return replay(batch)

    runner.replay = logged
    out = [o["token_ids"] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    out += [o["token_ids"] for o in llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)]
    shapes, segments = sorted(runner.graphs("prefill")), None
    if mode == "breakable":
        graph = runner.graphs("prefill")[shapes[0]]
        segments = (len(graph.segments) or len(graph.breaks) + 1, len(graph.breaks))
    llm.shutdown()
    return out, shapes, log, segments


eager, _, _, _ = run("off")
for mode in ("breakable", "full"):
    got, shapes, log, segments = run(mode)
    print(f"{mode}: captured (slots, tokens) {shapes}")
    if segments:
        print(f"{mode}: one shape is {segments[0]} segments joined by {segments[1]} eager calls")
    print(f"{mode}: prefill replays {log}")
    print(f"{mode}: same output as eager: {got == eager}")


def forget_the_result(self, name, value):  # the eager part's result never reaches the graph
    return self.view(name, value) if name.endswith(":out") else self.view(name, value).copy_(value)


BoundaryBuffers.stage = forget_the_result
wrong, _, _, _ = run("breakable")
print("breakable, boundary copy forgotten: same output as eager:", wrong == eager)
