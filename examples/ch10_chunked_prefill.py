"""Chapter 10: chunked prefill. A prefill batch holds at most max_prefill_length new tokens.

One long prompt (about 100 tokens) and two short ones, with a budget of 16 tokens per
prefill: the long prompt is cut into chunks, one per step, and a short request fills the
space that the last chunk leaves. The tokens must still equal transformers' greedy output.

Run from the repo root: python examples/ch10_chunked_prefill.py
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
LONG = (
    "The old lighthouse stood at the end of a narrow spit of rock, and every evening for "
    "forty years the keeper climbed its one hundred and twelve steps to light the lamp. "
    "Ships passing in the night saw the beam sweep across the water and knew where the "
    "reef began. One winter the storm was so strong that the glass cracked, and the keeper"
)
PROMPTS = ["The capital of France is", LONG, "def add(a, b):"]
BUDGET = 16
NEW_TOKENS = 4

tok = Tokenizer(MODEL)
config = SchedulerConfig(
    MODEL,
    dtype=torch.float32,
    device="cpu",
    max_running_req=4,
    num_page_override=256,
    max_seq_len_override=160,
    cache_type="naive",
    max_prefill_length=BUDGET,
)
sched = Scheduler(config, tok.eos_token_ids)

# Record, as each batch is prepared, how many tokens each request computes in it.
steps = []


def record(batch, prepare=sched.engine.prepare_batch):
    parts = []
    for r in batch.reqs:
        chunk = " chunk" if r.device_len < len(r.input_ids) else ""
        parts.append(f"{r.uid}:{r.extend_len} ({r.device_len}/{len(r.input_ids)}{chunk})")
    steps.append(
        f"{batch.phase:7} {sum(r.extend_len for r in batch.reqs):3} tokens  " + ", ".join(parts)
    )
    prepare(batch)


sched.engine.prepare_batch = record

prompt_ids = [tok.encode(text) for text in PROMPTS]
for uid, ids in enumerate(prompt_ids):
    sched.add_request(UserMsg(uid, ids, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)))
print(f"prompt lengths {[len(ids) for ids in prompt_ids]}, prefill budget {BUDGET} tokens")
outputs: dict[int, list[int]] = {uid: [] for uid in range(len(PROMPTS))}
while sched.has_work:
    for msg in sched.step():
        outputs[msg.uid].append(msg.token)
for n, line in enumerate(steps, 1):
    print(f"step {n:2}: {line}")
sched.check_integrity()
sched.shutdown()

hf_logging.disable_progress_bar()
hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
ok = True
for uid, ids in enumerate(prompt_ids):
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, x.size(1) :].tolist()
    same = outputs[uid] == ref
    ok &= same
    print(f"{uid}: {len(ids):3} prompt tokens -> {tok.decode(outputs[uid])!r} same as HF: {same}")
if not ok:
    raise SystemExit("chunked prefill changed the tokens")
