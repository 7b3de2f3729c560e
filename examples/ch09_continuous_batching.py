"""Chapter 9: continuous batching. Requests join and leave the running batch between steps.

We drive the Scheduler by hand: three requests go in, the scheduler steps, two more arrive
mid-run. Each step prints the batch it ran and who is running or waiting afterwards; at the
end every request is compared with transformers' greedy generate of that request alone.

Run from the repo root: python examples/ch09_continuous_batching.py
"""

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from minisgl.core import SamplingParams
from minisgl.message.backend import UserMsg
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler
from minisgl.tokenizer.tokenizer import Tokenizer

MODEL = "models/SmolLM2-135M-Instruct"
FIRST = [("The capital of France is", 3), ("def add(a, b):", 7), ("Once upon a time", 5)]
LATER = [("Three primary colors are red,", 4), ("1, 2, 3, 4,", 4)]  # arrive before step 3

tok = Tokenizer(MODEL)
config = SchedulerConfig(
    MODEL,
    dtype=torch.float32,
    device="cpu",
    max_running_req=4,  # four rows: the fifth request must wait for one to free up
    num_page_override=256,
    max_seq_len_override=128,
    cache_type="naive",
)
sched = Scheduler(config, tok.eos_token_ids)

# Watch the batches go by: every batch passes through the engine's prepare_batch.
batches = []
prepare = sched.engine.prepare_batch
sched.engine.prepare_batch = lambda batch: (batches.append(batch), prepare(batch))[1]

prompts: dict[int, tuple[str, int]] = {}
outputs: dict[int, list[int]] = {}
reasons: dict[int, str] = {}


def submit(items):
    for text, max_tokens in items:
        uid = len(prompts)
        prompts[uid] = (text, max_tokens)
        outputs[uid] = []
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sched.add_request(UserMsg(uid, tok.encode(text), params))
    print(f"  + requests {list(prompts)[-len(items) :]} arrive")


submit(FIRST)
step = 0
while sched.has_work:
    step += 1
    if step == 3:
        submit(LATER)
    messages = sched.step()
    batch = batches[-1]
    done = []
    for msg in messages:
        outputs[msg.uid].append(msg.token)
        if msg.finished:
            reasons[msg.uid] = msg.finish_reason
            done.append(msg.uid)
    running = [r.uid for r in sched.decode.running]
    waiting = [p.uid for p in sched.prefill.pending]
    print(
        f"step {step:2}: {batch.phase:7} {[r.uid for r in batch.reqs]!s:12} "
        f"finished {done!s:8} running {running!s:14} waiting {waiting}"
    )
sched.check_integrity()  # every page and row is back
sched.shutdown()

hf_logging.disable_progress_bar()
hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
ok = True
for uid, (text, max_tokens) in prompts.items():
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        ref = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, ids.size(1) :].tolist()
    same = outputs[uid] == ref
    ok &= same
    print(f"{uid} {text!r} -> {tok.decode(outputs[uid])!r} ({reasons[uid]}) same as HF: {same}")
if not ok:
    raise SystemExit("scheduler tokens differ from transformers' greedy generate")
