"""Chapter 12: overlap scheduling. Launch batch N+1 first, then process batch N's results.

The same three requests run twice, with overlap scheduling off and on. Each step prints
which batch it launched and whose results it processed: with overlap the results lag one
step behind, and a request that stopped (here on its end-of-sequence token) still rides
in the next batch, whose extra token is dropped. The outputs must be identical.

Run from the repo root: python examples/ch12_overlap.py
"""

import time

import torch

from minisgl.core import SamplingParams
from minisgl.env import ENV
from minisgl.message.backend import UserMsg
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler
from minisgl.tokenizer.tokenizer import Tokenizer

MODEL = "models/SmolLM2-135M-Instruct"
tok = Tokenizer(MODEL)
CHAT = tok.apply_chat_template([{"role": "user", "content": "Reply with one word: yes or no?"}])
PROMPTS = [CHAT, "The capital of France is", "def add(a, b):"]
PARAMS = SamplingParams(max_tokens=6)


def run(overlap: bool, show: bool = True):
    ENV.DISABLE_OVERLAP_SCHEDULING.value = not overlap  # read when the Scheduler is built
    config = SchedulerConfig(
        MODEL,
        dtype=torch.float32,
        device="cpu",
        max_running_req=4,
        num_page_override=128,
        max_seq_len_override=128,
        cache_type="naive",
    )
    sched = Scheduler(config, tok.eos_token_ids)
    launched = [0]
    events: list[str] = []

    def launch(batch, prepare=sched.engine.prepare_batch):
        launched[0] += 1
        batch.name = f"B{launched[0]}"
        events.append(f"launch {batch.name} {batch.phase} {[r.uid for r in batch.reqs]}")
        prepare(batch)

    def process(flight, inner=sched.process):
        messages = inner(flight)
        events.append(f"process {flight.batch.name} -> {len(messages)} tokens")
        return messages

    sched.engine.prepare_batch = launch
    sched.process = process
    if show:
        print(f"overlap {'on' if overlap else 'off'}:")
    outputs: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    for uid, text in enumerate(PROMPTS):
        sched.add_request(UserMsg(uid, tok.encode(text), PARAMS))
        outputs[uid] = []
    start, step = time.perf_counter(), 0
    while sched.has_work:
        step += 1
        for msg in sched.step():
            outputs[msg.uid].append(msg.token)
            if msg.finished:
                reasons[msg.uid] = msg.finish_reason
        if show:
            print(f"  step {step}: " + "; ".join(events))
        events.clear()
    elapsed = time.perf_counter() - start
    sched.check_integrity()
    sched.shutdown()
    return outputs, reasons, elapsed


run(overlap=False, show=False)  # the process's first forwards warm torch up: time neither mode
serial, serial_reasons, serial_time = run(overlap=False)
overlapped, overlap_reasons, overlap_time = run(overlap=True)
for uid in serial:
    print(f"  {uid}: {tok.decode(serial[uid])!r} ({serial_reasons[uid]})")
same = serial == overlapped and serial_reasons == overlap_reasons
print(f"same outputs and finish reasons: {same}")
print(f"wall time of the step loop: off {serial_time:.2f}s, on {overlap_time:.2f}s")
if not same:
    raise SystemExit("overlap scheduling changed the outputs")
