"""Speculative decoding: n-gram drafts, lossless acceptance, verify graphs (emulated on CPU).

Greedy output with drafts must equal greedy output without them, token for token, under
everything the scheduler does (chunks, the radix cache, pages of 1 and 16 tokens,
preemption, stop tokens inside an accepted run, mixed requests, verify graphs). Sampling
must draw from the model's distribution exactly: checked on the acceptance rule itself,
with many seeds, and shown to catch a broken resample step.
"""

from __future__ import annotations

import os
import random
import time
import urllib.request

import numpy as np
import openai
import pytest
import torch
from helpers import CPU, SMOL, TINY, ahead_oracle, behind_oracle, need, oracle_drafter, serving

from minisgl.core import Req, SamplingParams
from minisgl.engine.verify_graph import verify_token_tiers
from minisgl.llm import LLM
from minisgl.speculative import verify
from minisgl.speculative.acceptance import BACKOFF, Acceptance
from minisgl.speculative.cost import PRIOR, RETRY, StepCosts
from minisgl.speculative.ngram import NgramDrafter
from minisgl.speculative.verify import accept_drafts

pytestmark = pytest.mark.usefixtures("serial")  # from conftest.py

# Every draft is verified: the tests check what verify steps compute, wherever they pay.
KW = dict(
    dtype=torch.float32,
    device="cpu",
    max_running_req=4,
    max_seq_len_override=160,
    speculative_always=True,
    speculative_max_bs=4,  # the batches here speculate whole
)


def generate(path, prompts, params, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(need(path)), **{**KW, **kw})
    out = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.scheduler.check_integrity()  # every KV page back where it belongs
    return out, llm


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    drafter = NgramDrafter(max_n=3, min_n=1)
    tokens = np.array([5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 1, 2, 3])
    assert drafter.lookup(tokens, 2) == [7, 8]  # "1 2 3" last seen before "7 8"
    assert drafter.lookup(np.array([1, 2, 3, 4]), 3) == []  # nothing repeats
    assert drafter.lookup(np.array([4, 6, 4]), 5) == [6, 4]  # up to the end


def test_verify_tiers_front_pack_the_seed_example() -> None:
    tiers = verify_token_tiers(256)
    assert len(tiers) <= 12 and tiers[-1] == 256
    assert next(t for t in tiers if t >= 6 + 2 + 4) == 16  # [6, 2, 4] -> 12 -> tier 16


def fake_reqs(n: int, temperature: float, seed0: int = 0) -> list[Req]:
    params = SamplingParams(temperature=temperature, seed=None if temperature == 0 else 1)
    reqs = []
    for i in range(n):
        req = Req(torch.zeros(4, dtype=torch.int32), i, 3, 8, i, params)
        req.seed = seed0 + i  # each request its own stream
        reqs.append(req)
    return reqs


def test_greedy_acceptance_takes_the_agreeing_run_and_the_models_next_token() -> None:
    vocab = 8
    # Request 0: rows predict 3, 5, 6; drafts 3, 4 -> accepts 1, then the model's 5.
    # Request 1: rows predict 2, 2; draft 2 -> accepts it, then the bonus 2.
    # Request 2: no drafts: one row, its argmax 7.
    argmax = [3, 5, 6, 2, 2, 7]
    logits = torch.nn.functional.one_hot(torch.tensor(argmax), vocab).float()
    reqs = fake_reqs(3, 0.0)
    accepted, final = accept_drafts(logits, reqs, [[3, 4], [2], []], torch.zeros(4, 16))
    assert accepted.tolist() == [1, 1, 0] and final.tolist() == [5, 2, 7]


KERNELS = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or Triton's interpreter",
)


@KERNELS
def test_the_greedy_acceptance_kernel_equals_the_torch_rule() -> None:
    """kernels/accept.py (Triton's interpreter on a CPU) against `accept_drafts`: requests
    with no drafts, all taken, none taken and some, the token after them written into the
    pool where the first rejected draft was."""
    from minisgl.kernels.accept import accept_greedy

    gen = torch.Generator().manual_seed(3)
    vocab, width = 11, 16
    counts = [0, 3, 5, 1, 4, 2]
    bs = len(counts)
    reqs = fake_reqs(bs, 0.0)
    targets = torch.randint(0, vocab, (sum(counts) + bs,), generator=gen)
    drafts, ids, starts = [], [], []
    for i, k in enumerate(counts):
        start = len(ids)
        starts.append(start)
        row = targets[start : start + k].tolist()  # drafts the model agrees with
        cut = [k, k, 0, 1, 2, 0][i]  # where request i's drafts go wrong
        draft = row[:cut] + [(t + 1) % vocab for t in row[cut:]]
        drafts.append(draft)
        ids += [7] + draft
    logits = torch.nn.functional.one_hot(targets, vocab).float()
    logits += 0.01 * torch.rand(logits.shape, generator=gen)  # ties broken
    accepted, final = accept_drafts(logits, reqs, drafts, torch.zeros(4, 16))
    pool = torch.zeros(bs, width, dtype=torch.int32)
    after = [i * width + 2 for i in range(bs)]
    out = accept_greedy(
        logits.argmax(dim=-1),
        torch.tensor(ids, dtype=torch.int32),
        *(torch.tensor(x) for x in (starts, counts, after)),
        pool.view(-1),
        max(counts),
    )
    assert out[0].tolist() == accepted.tolist() == [0, 3, 0, 1, 2, 0]
    assert out[1].tolist() == final.tolist()
    for i, n in enumerate(accepted.tolist()):
        assert pool[i].nonzero().flatten().tolist() in ([2 + n], [])
        assert pool[i, 2 + n] == final[i]


@KERNELS
def test_the_engine_with_the_acceptance_kernel_equals_plain_decoding(monkeypatch) -> None:
    """The kernel in the verify step (the one a GPU runs, here interpreted): its rows found
    from the batch's input ids, its token written into the pool, oracle drafts partly
    wrong."""
    from minisgl.kernels.accept import accept_greedy

    prompts = tiny_prompts(6)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want, llm = generate(TINY["llama"], prompts, params)
    llm.shutdown()
    calls = []

    def kernel(*args):
        calls.append(args[0].numel())
        return accept_greedy(*args)

    monkeypatch.setattr("minisgl.layers.triton_ops.triton_accept", lambda logits: kernel)
    monkeypatch.setattr(NgramDrafter, "propose", oracle_drafter(prompts, want))
    got, llm = generate(TINY["llama"], prompts, params, speculative="ngram")
    spec = llm.scheduler.spec
    llm.shutdown()
    assert got == want
    assert calls and 0 < spec.num_accepted < spec.num_drafted


def sample_first_tokens(n: int) -> tuple[np.ndarray, np.ndarray]:
    """n requests, each drafting token 2 against p0 and then p1: the first token each
    emits, and the second where the draft was accepted (else -1)."""
    p0 = torch.tensor([0.1, 0.2, 0.4, 0.05, 0.25])
    p1 = torch.tensor([0.5, 0.1, 0.1, 0.2, 0.1])
    logits = torch.stack([p0, p1]).log().repeat(n, 1)
    reqs = fake_reqs(n, 1.0)
    accepted, final = accept_drafts(logits, reqs, [[2]] * n, torch.zeros(4, 16))
    first = torch.where(accepted == 1, 2, final).numpy()
    second = torch.where(accepted == 1, final, -1).numpy()
    return first, second


def distance(samples: np.ndarray, probs: list[float]) -> float:
    counts = np.bincount(samples, minlength=len(probs)) / len(samples)
    return float(np.abs(counts - np.array(probs)).sum() / 2)


def test_rejection_sampling_draws_exactly_from_the_model() -> None:
    first, second = sample_first_tokens(20000)
    assert distance(first, [0.1, 0.2, 0.4, 0.05, 0.25]) < 0.02
    assert distance(second[second >= 0], [0.5, 0.1, 0.1, 0.2, 0.1]) < 0.03


def test_a_resample_that_keeps_the_rejected_draft_is_caught(monkeypatch) -> None:
    monkeypatch.setattr(verify, "without_rejected", lambda logits, *_: logits)
    first, _ = sample_first_tokens(20000)
    assert distance(first, [0.1, 0.2, 0.4, 0.05, 0.25]) > 0.1  # token 2 drawn far too often


REPEATS = [
    "Copy this line twice: the cat sat on the mat. the cat sat on the mat.",
    "def area(w, h):\n    return w * h\n\ndef area(w, h):\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Hi",
]


def test_smollm2_greedy_equals_plain_decoding_with_verify_graphs() -> None:
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want, llm = generate(SMOL, REPEATS, params, num_page_override=512)
    llm.shutdown()
    got, llm = generate(SMOL, REPEATS, params, num_page_override=512, speculative="ngram")
    spec = llm.scheduler.spec
    llm.shutdown()
    assert got == want and spec.num_accepted > 5  # the drafts did their work
    graphs, llm = generate(
        SMOL, REPEATS, params, num_page_override=512, speculative="ngram", cuda_graph_max_bs=4
    )
    verify_graphs = llm.engine.graph_runner.graphs("verify")
    llm.shutdown()
    assert graphs == want and verify_graphs


def tiny_prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    stem = torch.randint(0, 1000, (20,), generator=gen).tolist()
    return [stem + stem[: 3 + i] for i in range(3)] + [stem[:9] * 2]


@pytest.mark.parametrize(
    ("name", "page_size", "pages", "chunk"),
    [("llama", 1, 2048, 8192), ("qwen3", 16, 6, 12)],
)
def test_tiny_models_greedy_equal_under_chunks_cache_preemption(name, page_size, pages, chunk):
    prompts = tiny_prompts(1)
    params = [SamplingParams(max_tokens=20 + 3 * i, ignore_eos=True) for i in range(4)]
    kw = dict(page_size=page_size, num_page_override=pages, max_prefill_length=chunk)
    want, llm = generate(TINY[name], prompts, params, **kw)
    llm.shutdown()
    # A stop token the plain run emits mid-output: it must end the run inside an accepted run.
    stop = want[1][12]
    params[1] = SamplingParams(max_tokens=23, ignore_eos=True, stop_token_ids=[stop])
    want[1] = want[1][: want[1].index(stop) + 1]
    got, llm = generate(TINY[name], prompts, params, speculative="ngram", **kw)
    spec, pre = llm.scheduler.spec, llm.scheduler.num_preemptions
    llm.shutdown()
    assert got == want
    assert spec.num_accepted > 0
    if pages < 2048:
        assert pre > 0  # too few pages for the four together: some are preempted


def test_oracle_drafts_with_wrong_tokens_on_the_moe_model(monkeypatch) -> None:
    """The tiny MoE's text never repeats, so n-grams draft nothing there."""
    prompts = tiny_prompts(4)
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    want, llm = generate(TINY["qwen3-moe"], prompts, params, max_prefill_length=16)
    llm.shutdown()
    monkeypatch.setattr(NgramDrafter, "propose", oracle_drafter(prompts, want))
    got, llm = generate(
        TINY["qwen3-moe"], prompts, params, max_prefill_length=16, speculative="ngram"
    )
    spec = llm.scheduler.spec
    llm.shutdown()
    assert got == want
    assert 0 < spec.num_accepted < spec.num_drafted  # some taken, the wrong ones not


def test_mixed_requests_and_seeded_sampling_are_reproducible() -> None:
    prompts = tiny_prompts(2)
    plain = SamplingParams(max_tokens=16, ignore_eos=True)
    penalised = SamplingParams(max_tokens=16, ignore_eos=True, frequency_penalty=0.5)
    sampled = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, top_k=50, seed=7)
    params = [plain, penalised, sampled, plain]
    want, llm = generate(TINY["llama"], prompts, [plain, penalised, plain, plain])
    llm.shutdown()
    runs = []
    for _ in range(2):
        got, llm = generate(TINY["llama"], prompts, params, speculative="ngram")
        llm.shutdown()
        runs.append(got)
    assert runs[0] == runs[1]  # a seed gives the same tokens again
    assert [runs[0][i] for i in (0, 1, 3)] == [want[i] for i in (0, 1, 3)]


def test_a_request_with_logprobs_gets_what_it_gets_without_drafts() -> None:
    """A verify step computes no log-probabilities, so a batch holding a request that asks
    for them takes the plain step: its tokens and log-probabilities are those of a run
    without speculation, and the other requests speculate once it has finished."""
    prompts = tiny_prompts(6)
    plain = SamplingParams(max_tokens=24, ignore_eos=True)
    asks = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=2)
    params = [plain, asks, plain, plain]

    def run(**kw) -> tuple[list[dict], LLM]:
        llm = LLM(str(need(TINY["llama"])), **{**KW, **kw})
        out = llm.generate(prompts, params, use_tqdm=False)
        llm.scheduler.check_integrity()
        return out, llm

    want, llm = run()
    llm.shutdown()
    got, llm = run(speculative="ngram")
    spec = llm.scheduler.spec
    llm.shutdown()
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
    assert len(got[1]["logprobs"]) == 6 and "logprobs" not in got[0]
    for g, w in zip(got[1]["logprobs"], want[1]["logprobs"]):
        assert g["logprob"] == pytest.approx(w["logprob"], abs=1e-5)
        assert g["top"].keys() == w["top"].keys() and len(g["top"]) == 2
    assert any("log-probabilities" in why for why in spec.skipped)
    assert spec.num_accepted > 0  # the others speculated after it


def test_a_wrong_acceptance_rule_fails(monkeypatch) -> None:
    prompts = tiny_prompts(3)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    want, llm = generate(TINY["llama"], prompts, params)
    llm.shutdown()

    def one_too_many(logits, reqs, drafts, pool):
        accepted, final = accept_drafts(logits, reqs, drafts, pool)
        most = torch.tensor([len(d) for d in drafts])
        return torch.minimum(accepted + 1, most), final

    monkeypatch.setattr("minisgl.speculative.verify.accept_drafts", one_too_many)
    monkeypatch.setattr(NgramDrafter, "propose", oracle_drafter(prompts, want))
    got, llm = generate(TINY["llama"], prompts, params, speculative="ngram")
    llm.shutdown()
    assert got != want


LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy for localhost


def scrape(base: str) -> dict[str, float]:
    with LOCAL.open(base + "/metrics", timeout=10) as answer:
        lines = answer.read().decode().splitlines()
    pairs = (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))
    return {name: float(value) for name, value in pairs}


def test_metrics_count_drafts_and_accept_lengths_on_a_live_server(tmp_path) -> None:
    flags = ("--max-seq-len-override", "256", "--speculative", "ngram", "--num-draft-tokens", "4")
    with serving(tmp_path, *CPU, *flags, "--speculative-always") as srv:
        base = srv.base
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        line = "the cat sat on the mat. "
        out = client.completions.create(
            model=SMOL.name, prompt="Copy: " + line * 3, max_tokens=24, temperature=0
        )
        assert out.choices[0].text
        m = scrape(base)
        for _ in range(40):  # the scheduler's last report may trail the answer a little
            if m["minisgl:num_requests_running"] == 0:
                break
            time.sleep(0.25)
            m = scrape(base)
    drafted = m["minisgl:spec_draft_tokens_total"]
    accepted = m["minisgl:spec_accepted_tokens_total"]
    verifies = m["minisgl:spec_accept_length_tokens_count"]
    assert drafted >= accepted > 0, (drafted, accepted)
    assert m['minisgl:spec_accept_length_tokens_bucket{le="+Inf"}'] == verifies > 0
    assert m['minisgl:spec_accept_length_tokens_bucket{le="5.0"}'] == verifies  # k + 1 at most
    assert m["minisgl:spec_accept_length_tokens_sum"] == accepted + verifies  # drafts and one


def test_with_overlap_scheduling_plain_steps_overlap_and_verify_steps_drain(monkeypatch) -> None:
    from minisgl.env import ENV

    prompts = tiny_prompts(5)
    params = [SamplingParams(max_tokens=12 + 5 * i, ignore_eos=True) for i in range(4)]
    want, llm = generate(TINY["llama"], prompts, params)
    llm.shutdown()
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", False)
    got, llm = generate(TINY["llama"], prompts, params, speculative="ngram")
    overlap, spec = llm.scheduler.overlap, llm.scheduler.spec
    llm.shutdown()
    assert overlap and got == want and spec.num_accepted > 0


def stop_inside_a_run() -> tuple[list, list, list, dict]:
    """Four requests on a pool of 5 pages (so some are preempted), the third stopped by a
    token inside what verifies will accept; and their plain output."""
    prompts = tiny_prompts(7)
    params = [SamplingParams(max_tokens=14 + 4 * i, ignore_eos=True) for i in range(4)]
    kw = dict(page_size=16, num_page_override=5, max_prefill_length=12)
    want, llm = generate(TINY["qwen3"], prompts, params, **kw)
    llm.shutdown()
    stop = want[2][9]
    params[2] = SamplingParams(max_tokens=22, ignore_eos=True, stop_token_ids=[stop])
    want[2] = want[2][: want[2].index(stop) + 1]
    return prompts, params, want, kw


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=KERNELS)])
def test_verifies_launched_ahead_give_the_plain_tokens(monkeypatch, kernel) -> None:
    """With overlap scheduling each verify whose requests guess its token is followed by the
    next one before its tokens are read: from oracle drafts with wrong drafts and wrong
    guesses, some of those die (their requests' lengths go back), and the output, a stop
    token inside an accepted run and every page are as without drafts; on a small pool of
    pages too, where requests are preempted."""
    from minisgl.env import ENV
    from minisgl.kernels.accept import accept_greedy

    prompts, params, want, kw = stop_inside_a_run()
    if kernel:
        monkeypatch.setattr("minisgl.layers.triton_ops.triton_accept", lambda _: accept_greedy)
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", False)
    monkeypatch.setattr(NgramDrafter, "propose", ahead_oracle(prompts, want))
    got, llm = generate(TINY["qwen3"], prompts, params, speculative="ngram", **kw)
    spec, sched = llm.scheduler.spec, llm.scheduler
    llm.shutdown()
    assert got == want
    assert spec.num_ahead > 0 and spec.num_ahead_dead > 0  # some went ahead, some in vain
    assert sched.num_preemptions > 0
    assert 0 < spec.num_accepted < spec.num_drafted


@pytest.mark.parametrize("ahead", ["on", "off"])
def test_verifies_launched_behind_plain_steps_give_the_plain_tokens(monkeypatch, ahead) -> None:
    """With overlap scheduling a verify after a plain step is launched behind it, its drafts
    made from the host's tokens as if that step's token were their first (every third
    guess wrong here): the output, a stop token inside an accepted run and every page are
    as without drafts, on a small pool where requests are preempted; and against the same
    run with verifies after draining, the pipeline is drained for no more steps."""
    from minisgl.env import ENV

    prompts, params, want, kw = stop_inside_a_run()
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", False)
    monkeypatch.setattr(ENV.SPECULATIVE_AHEAD, "value", ahead)
    monkeypatch.setattr(NgramDrafter, "propose", behind_oracle(prompts, want))
    drained = {}
    for behind in ("off", "on"):
        monkeypatch.setattr(ENV.SPECULATIVE_BEHIND, "value", behind)
        got, llm = generate(TINY["qwen3"], prompts, params, speculative="ngram", **kw)
        spec, sched = llm.scheduler.spec, llm.scheduler
        llm.shutdown()
        assert got == want, behind
        assert sched.num_preemptions > 0 and 0 < spec.num_accepted < spec.num_drafted
        drained[behind] = spec.num_drained
        if behind == "on":
            assert spec.num_behind > 0 and spec.num_behind_missed > 0
        else:
            assert spec.num_behind == 0
    assert drained["on"] <= drained["off"], drained  # (drained first where behind drafts nothing)


def test_a_guess_of_the_plain_steps_token_is_counted_apart() -> None:
    """Behind a plain step, a request's drafts follow its guess of that step's token: how
    often that guess holds is its own share (what a verify behind a plain step is worth);
    where it held the drafts after it count toward the request's rate as usual, where it
    did not they were checked against another token and count for nothing."""
    from minisgl.speculative.step import Speculator

    spec = Speculator.__new__(Speculator)
    spec.acceptance = a = Acceptance(8)
    spec.num_steps = spec.num_drafted = spec.num_accepted = 0
    spec.accepted_lengths = [0] * 9
    spec._count(1, 3, 5, lead=True)
    spec._count(2, 3, 5, lead=False)
    spec._count(3, 3, 5)
    fresh = a.rate(99)
    assert a.rate(1) == a.rate(3) == pytest.approx((0.8 * 2.0 + 3) / (0.8 * 2.5 + 3 + 1))
    assert a.rate(2) == fresh  # nothing learned of the drafter
    assert a.lead(1) == pytest.approx(0.8 * fresh + 0.2) and a.lead(3) == fresh
    assert a.lead(2) == pytest.approx(0.8 * fresh)
    assert spec.num_drafted == 15 and spec.num_accepted == 9 and spec.accepted_lengths[3] == 3


def plain_llama(seed: int, n: int, tokens: int) -> tuple[list, SamplingParams, list]:
    """n of the tiny prompts, greedy for `tokens` tokens, and the tiny Llama's plain output."""
    prompts = tiny_prompts(seed)[:n]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    want, llm = generate(TINY["llama"], prompts, params)
    llm.shutdown()
    return prompts, params, want


def test_guesses_that_never_hold_stop_verifies_going_ahead(monkeypatch) -> None:
    """Right drafts and a wrong guess after them, every time: the first verifies launch
    ahead (a fresh request is given even odds) and die; a request goes ahead while its
    drafts and guesses held in at least half of its recent verifies, so it stops, and
    its verifies wait for their tokens, taking every draft."""
    from minisgl.env import ENV

    prompts, params, want = plain_llama(8, 1, 40)

    def wrong_guess(self, reqs, ks, pending=None):
        out = []
        for i, (req, k) in enumerate(zip(reqs, ks)):
            done = req.seq_len + len(pending[i] if pending else []) - len(prompts[0])
            tokens = want[0][done : done + k]
            out.append(tokens[:-1] + [(tokens[-1] + 1) % 1000] if len(tokens) > 1 else [])
        return out

    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", False)
    monkeypatch.setattr(NgramDrafter, "propose", wrong_guess)
    kw = dict(speculative="ngram", speculative_always=False)
    got, llm = generate(TINY["llama"], prompts, params, **kw)
    spec = llm.scheduler.spec
    llm.shutdown()
    assert got == want and spec.num_accepted > 0
    assert 1 <= spec.num_ahead <= 2 and spec.num_ahead_dead == spec.num_ahead
    assert spec.num_steps > 2 * spec.num_ahead  # verifies went on, waiting for their tokens


def test_a_batch_not_likely_to_go_ahead_gives_up_no_draft_for_a_guess(monkeypatch) -> None:
    """Two fresh requests (even odds each: a quarter together) and a drafter that finds two
    tokens: both are verified as drafts, none kept back as the guess of a chain that the
    batch is not likely to make."""
    from minisgl.env import ENV
    from minisgl.speculative.step import Speculator

    prompts, params, want = plain_llama(9, 2, 30)

    def two(self, reqs, ks, pending=None):
        out = []
        for req, k in zip(reqs, ks):
            i = next(i for i, p in enumerate(prompts) if req.input_ids.tolist()[: len(p)] == p)
            done = req.seq_len - len(prompts[i])
            out.append(want[i][done : done + min(k, 2)])
        return out

    counts: list[int] = []
    launch = Speculator._launch

    def recorded(self, reqs, drafts, *rest, **kw):
        counts.extend(len(d) for d in drafts)
        return launch(self, reqs, drafts, *rest, **kw)

    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", False)
    monkeypatch.setattr(ENV.SPECULATIVE_BEHIND, "value", "off")  # two drafts, not a guess and one
    monkeypatch.setattr(NgramDrafter, "propose", two)
    monkeypatch.setattr(Speculator, "_launch", recorded)
    kw = dict(speculative="ngram", speculative_always=False)
    got, llm = generate(TINY["llama"], prompts, params, **kw)
    spec = llm.scheduler.spec
    llm.shutdown()
    assert got == want and spec.num_ahead == 0
    assert counts.count(2) >= 2 and counts.count(1) <= len(prompts)  # 1: at a length limit


def test_with_verifies_ahead_off_every_verify_waits_for_its_tokens(monkeypatch) -> None:
    from minisgl.env import ENV

    prompts = tiny_prompts(7)
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    want, llm = generate(TINY["llama"], prompts, params)
    llm.shutdown()
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", False)
    monkeypatch.setattr(ENV.SPECULATIVE_AHEAD, "value", "off")
    monkeypatch.setattr(NgramDrafter, "propose", ahead_oracle(prompts, want))
    got, llm = generate(TINY["llama"], prompts, params, speculative="ngram")
    spec = llm.scheduler.spec
    llm.shutdown()
    assert got == want and spec.num_ahead == 0 and spec.num_accepted > 0


def test_verify_steps_are_taken_where_the_measured_step_times_say_they_pay() -> None:
    costs = StepCosts()
    assert costs.ratio(1) == PRIOR  # nothing measured yet
    assert not costs.pays(1, PRIOR - 1.5) and costs.pays(1, PRIOR - 0.5)
    t = 0.0
    for kind, seconds in [("plain", 1.0)] * 3 + [("verify", 3.0)] * 3 + [("plain", 1.0)]:
        costs.start(kind, 1, now=t)  # the first interval of each kind is a warm-up
        t += seconds
    costs.start(None, 1, now=t)  # a prefill: the plain step before it ends, nothing starts
    costs.start("plain", 1, now=t + 100.0)  # the wait for work is no step's cost
    assert costs.ratio(1) == pytest.approx(3.0)
    assert costs.ratio(2) == PRIOR  # another bucket: its own measurements
    assert not costs.pays(1, 1.5) and costs.pays(1, 2.5)  # 1 + E tokens for 3 steps' time
    for _ in range(RETRY - 1):
        assert not costs.pays(1, 0.0)
    assert costs.pays(1, 0.0)  # declined RETRY times in a row: one is run, to measure again


def test_measured_costs_decide_and_the_output_stays_exact() -> None:
    """Without speculative_always the verify steps run where the costs measured on this
    machine say they pay; either way the tokens are those of plain decoding."""
    prompts = tiny_prompts(5)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want, llm = generate(TINY["llama"], prompts, params)
    llm.shutdown()
    got, llm = generate(
        TINY["llama"], prompts, params, speculative="ngram", speculative_always=False
    )
    costs = llm.scheduler.spec.costs
    llm.shutdown()
    assert got == want
    assert ("plain", 4) in costs.seen  # the plain decode steps of the batch were timed


def verifies(acceptance: Acceptance, need: float, lengths: range, taken: bool) -> list[int]:
    """The lengths at which a request alone in its batch verifies (every time it drafts:
    its own check is the batch's), its drafts all taken or all missed."""
    out = []
    for length in lengths:
        if acceptance.proposes(0, length, need):
            k = acceptance.draft_len(0)
            acceptance.record(0, k if taken else 0, k)
            out.append(length)
    return out


def test_drafts_that_miss_switch_a_request_off_and_probes_back_off() -> None:
    # A verify costing 2.2 plain steps (the H200 at batch 1): one verify, then one probe per
    # doubling of the wait: 5 verifies in 256 tokens, at most 1.2 plain steps lost each.
    assert verifies(Acceptance(8), 1.2, range(256), taken=False) == [0, 17, 50, 115, 244]
    # A cheap verify (1.3 plain steps) is tried three times a probe, at 0.3 steps each.
    assert len(verifies(Acceptance(8), 0.3, range(256), taken=False)) == 15
    # Drafts that are taken keep a request drafting, all 8, every step.
    copying = Acceptance(8)
    assert verifies(copying, 1.2, range(64), taken=True) == list(range(64))
    assert copying.draft_len(0) == 8
    # Switched off, a request that starts copying drafts again at its next probe, and stays.
    turning = Acceptance(8)
    assert verifies(turning, 1.2, range(10), taken=False) == [0]
    assert verifies(turning, 1.2, range(10, 40), taken=True) == list(range(1 + BACKOFF, 40))


def test_on_random_text_drafts_that_miss_cost_a_few_verify_steps(monkeypatch) -> None:
    """Drafts of random tokens, with the step costs measured on this machine: whatever
    they are, the request stops drafting (no drafter work, no verify) after a few verify
    steps, and its tokens are those of plain decoding."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (24,), generator=gen).tolist()]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    want, llm = generate(TINY["llama"], prompts, params)
    llm.shutdown()
    rng, asked = random.Random(0), []

    def guesses(self, reqs: list[Req], ks: list[int]) -> list[list[int]]:
        asked.extend(k for k in ks if k)
        return [[rng.randrange(1000) for _ in range(k)] for k in ks]

    monkeypatch.setattr(NgramDrafter, "propose", guesses)
    got, llm = generate(
        TINY["llama"], prompts, params, speculative="ngram", speculative_always=False
    )
    spec = llm.scheduler.spec
    llm.shutdown()
    assert got == want
    # The most the switch-off allows in 64 tokens, where a verify seems to cost no more
    # than a plain step (the measured costs can only make it fewer): 16, of 64 steps.
    assert 1 <= spec.num_forwards <= 16 and spec.num_accepted == 0
    assert len(asked) <= 16  # asked for drafts only before it verified them
