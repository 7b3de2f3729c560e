"""Chapter 11: the radix prefix cache. Prompts that share a prefix share its KV pages.

Three waves of requests: three questions after system prompt A, three after system prompt
B, then one more after A. We run them with the naive cache and with the radix cache, count
the prompt tokens each actually computed, and print how many tokens of each prompt came
from the cache. The radix run gets a pool too small to keep everything, so the tree must
evict its least recently used leaves; the outputs must stay the same.

Run from the repo root: python examples/ch11_radix_cache.py
"""

import torch

from minisgl.core import SamplingParams
from minisgl.message.backend import UserMsg
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler
from minisgl.tokenizer.tokenizer import Tokenizer

MODEL = "models/SmolLM2-135M-Instruct"
SYSTEM_A = (
    "You are the assistant of a small bakery in Lyon. The bakery opens at seven in the "
    "morning and closes at eight in the evening, except on Mondays. It sells bread, "
    "croissants and cakes. Answer in one short sentence.\nQuestion: "
)
SYSTEM_B = (
    "You are a tutor for a first course in astronomy. Explain things simply, with one "
    "everyday comparison, and never use formulas. Keep every answer short.\nQuestion: "
)
WAVES = [
    [SYSTEM_A + "When do you open?", SYSTEM_A + "Do you sell cakes?", SYSTEM_A + "Monday?"],
    [SYSTEM_B + "What is a star?", SYSTEM_B + "Why is the sky dark?", SYSTEM_B + "What is Mars?"],
    [SYSTEM_A + "Where is the bakery?"],
]
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)

tok = Tokenizer(MODEL)
waves = [[tok.encode(text) for text in wave] for wave in WAVES]


def run(cache_type: str, num_pages: int):
    config = SchedulerConfig(
        MODEL,
        dtype=torch.float32,
        device="cpu",
        max_running_req=4,
        num_page_override=num_pages,
        max_seq_len_override=128,
        page_size=4,
        cache_type=cache_type,
    )
    sched = Scheduler(config, tok.eos_token_ids)
    computed = [0]  # prompt tokens that went through the model

    def record(batch, prepare=sched.engine.prepare_batch):
        if batch.is_prefill:
            computed[0] += sum(r.extend_len for r in batch.reqs)
        prepare(batch)

    sched.engine.prepare_batch = record
    evicted = []  # tokens freed by each eviction

    def evict(num_tokens, inner=sched.cache.cache.evict):
        slots = inner(num_tokens)
        evicted.append(len(slots))
        return slots

    sched.cache.cache.evict = evict
    print(f"{cache_type} cache, {num_pages} pages of 4 tokens:")
    outputs, uid = [], 0
    for n, wave in enumerate(waves, 1):
        cached = {}
        for ids in wave:
            sched.add_request(UserMsg(uid, ids, PARAMS))
            outputs.append([])
            uid += 1
        while sched.has_work:
            for msg in sched.step():
                outputs[msg.uid].append(msg.token)
                cached[msg.uid] = msg.cached_tokens
        lens = [len(ids) for ids in wave]
        print(
            f"  wave {n}: prompt lengths {lens}, cached tokens {list(cached.values())}; "
            f"pages free {sched.cache.allocator.num_free}, in the cache "
            f"{sched.cache.cache.evictable_tokens // 4}, evicted so far {sum(evicted) // 4}"
        )
    print(f"  prompt tokens computed: {computed[0]} of {sum(map(len, sum(waves, [])))}")
    sched.check_integrity()
    sched.shutdown()
    return outputs, computed[0], sum(evicted)


naive, naive_computed, _ = run("naive", 256)
radix, radix_computed, evicted = run("radix", 28)
print(f"same outputs with the radix cache as with the naive one: {radix == naive}")
for text, out in zip(sum(WAVES, [])[:2], radix):
    print(f"  ...{text[-20:]!r} -> {tok.decode(out)!r}")
if radix != naive or radix_computed >= naive_computed or evicted == 0:
    raise SystemExit("the radix cache changed the tokens, saved nothing, or never evicted")
