"""When speculation pays: the step costs the engine measures, and the decisions made from them.

The step costs are driven here with simulated clocks (StepCosts takes explicit `now`
values): a model of the overlap scheduler's pipeline gives the interval of every step, and
the truth to check against is the whole run's time with and without the verify steps. Then
the decisions: a bucket where a verify costs too much stops speculating within a few steps,
one where it pays keeps on, a bucket declined RETRY times measures again; a request whose
probes take a draft now and then still backs off; a drain for drafts that come to nothing
reaches the switch-off. The engine runs last, on the tiny model with a simulated clock: a
batch of four speculates where the verify is cheap and stops where it is dear, and its
tokens are plain decoding's either way. An offline batch, whose caller waits for every
answer, verifies only where the last answer comes sooner (by an exact expectation). And
tools/bench_verify_cost.py, which measures what these tests simulate, runs on the CPU, as
does tools/bench_speculative.py's model of a GPU's decisions. Under tensor parallelism
every rank times its steps by rank 0's clock, sent with the messages.
"""

from __future__ import annotations

import gc
import itertools
import json
import math
import random
from dataclasses import dataclass

import pytest
import torch
from helpers import TINY, need, run_tool

import minisgl.speculative.cost as cost_module
import minisgl.speculative.step as step_module
from minisgl.core import Req, SamplingParams
from minisgl.llm import LLM
from minisgl.speculative.acceptance import Acceptance, Record, last_sooner
from minisgl.speculative.cost import PRIOR, RETRY, StepCosts
from minisgl.speculative.ngram import NgramDrafter


@dataclass
class Pipeline:
    """An overlap scheduler's timeline, step by step: the host's clock and the device's.

    A plain step launches its forward (host work `launch`), then processes the step before
    it (waits for the device, then host work `process`); the device runs the forwards in
    order, `device` each. A verify drafts, drains the step in flight (waits, processes),
    prepares its batch, waits for its own forward (`verify_device`) and accepts
    (`accept`). A "drained" step drafts, drains, drafts again and launches a plain step
    that stays in flight. Without overlap a plain step waits for its own forward."""

    device: float = 1.0
    launch: float = 0.3
    process: float = 0.2
    draft: float = 0.1
    prepare: float = 0.4
    verify_device: float = 1.2
    accept: float = 0.3
    overlap: bool = True
    host: float = 0.0  # the host's clock
    free: float = 0.0  # when the device has finished everything queued
    flight: float | None = None  # when the step in flight finishes

    def run(self, kind: str) -> float:
        """One step of `kind`; the host's clock when the next step may start."""
        if kind != "plain":
            self.host += self.draft
            self.drain()
            if kind == "drained":
                self.host += self.draft
        if kind == "verify":
            self.host += self.prepare
            self.free = max(self.free, self.host) + self.verify_device
            self.host = self.free + self.accept
            return self.host
        self.host += self.launch
        self.free = max(self.free, self.host) + self.device
        launched = self.free
        if self.overlap:
            self.drain()
            self.flight = launched
        else:
            self.host = launched + self.process
        return self.host

    def drain(self) -> None:
        if self.flight is not None:
            self.host = max(self.host, self.flight) + self.process
            self.flight = None


def drive(
    costs: StepCosts, pipe: Pipeline, kinds: list[str], ratios: list[float] | None = None
) -> float:
    """The steps through the pipeline, each one's start told to `costs` (and the ratio it
    gives after it to `ratios`); the total time."""
    for kind in kinds:
        costs.start(kind, 1, now=pipe.host)
        pipe.run(kind)
        if ratios is not None:
            ratios.append(costs.ratio(1))
    costs.start(None, 1, now=pipe.host)
    pipe.drain()  # the last step's tokens too
    return pipe.host


def true_ratio(kinds: list[str], **pipe: float | bool) -> float:
    """What a verify costs in plain steps, from whole runs: the time the run with verify
    steps (and drains for nothing) takes beyond the same number of plain steps, per
    verify, plus the plain step it replaces."""
    with_verify = drive(StepCosts(), Pipeline(**pipe), kinds)
    plain_only = drive(StepCosts(), Pipeline(**pipe), ["plain"] * len(kinds))
    per_step = plain_only / len(kinds)
    return 1 + (with_verify - plain_only) / kinds.count("verify") / per_step


PATTERNS = {
    "one verify every 5 steps": (["plain"] * 4 + ["verify"]) * 40,
    "runs of 3 verifies in 8 steps": (["plain"] * 5 + ["verify"] * 3) * 25,
    "a drain for nothing before each verify": (["plain"] * 3 + ["drained", "verify"]) * 40,
}


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_a_verify_is_charged_with_the_pipeline_it_drains_and_refills(pattern, overlap) -> None:
    kinds, ratios = ["plain"] * 10 + PATTERNS[pattern] + ["plain"] * 5, []
    drive(StepCosts(), Pipeline(overlap=overlap), kinds, ratios)
    truth = true_ratio(kinds, overlap=overlap)
    # The moving average of a periodic pattern depends on where in the period it is read:
    # its mean over the last periods is the estimate.
    estimate = sum(ratios[-100:]) / 100
    assert estimate == pytest.approx(truth, rel=0.03), (estimate, truth)
    if overlap and pattern.startswith("one verify"):
        # Each kind's intervals alone (the verify's holds the wait for the step it drained,
        # the plain ones the short and long steps that refill the pipeline) are far off.
        pipe, spent = Pipeline(), {"plain": [], "verify": []}
        for kind in kinds:
            began = pipe.host
            spent[kind].append(pipe.run(kind) - began)
        naive = [sum(spent[k][-40:]) / len(spent[k][-40:]) for k in ("verify", "plain")]
        assert naive[0] / naive[1] > 1.3 * truth


def decide(costs: StepCosts, pipe: Pipeline, bs: int, gain: float, steps: int) -> list[int]:
    """`steps` steps of a batch of bs requests whose drafts are expected to add `gain`
    tokens: a verify wherever the measured costs say it pays. The steps that verified."""
    verified = []
    for i in range(steps):
        kind = "verify" if costs.pays(bs, gain) else "plain"
        costs.start(kind, bs, now=pipe.host)
        pipe.run(kind)
        if kind == "verify":
            verified.append(i)
    return verified


def test_a_bucket_where_a_verify_costs_too_much_stops_within_a_few_steps() -> None:
    # Batch 4, 5 drafts expected in all: 9 tokens a verify. The prior (2 plain steps) says
    # it pays; measured, a verify costs about 3.6 plain steps (14 request-steps > 9 tokens).
    pipe, costs = Pipeline(verify_device=2.5, prepare=0.6), StepCosts()
    verified = decide(costs, pipe, 4, 5.0, 200)
    assert costs.ratio(4) > 3.0
    assert 2 <= len([i for i in verified if i < RETRY]) <= 4
    later = [i for i in verified if i >= 10]
    assert all(b - a >= RETRY for a, b in zip(later, later[1:]))  # one per RETRY declines


def test_a_bucket_where_a_verify_pays_keeps_speculating() -> None:
    # The same batch where verifies back to back cost 0.9 plain steps (nothing to drain).
    pipe, costs = Pipeline(verify_device=0.5, prepare=0.2, accept=0.1), StepCosts()
    verified = decide(costs, pipe, 4, 5.0, 200)
    assert costs.ratio(4) < 2.0
    assert len(verified) >= 190
    assert costs.ratio(1) == PRIOR  # another bucket: nothing measured there


def test_a_declined_bucket_measures_again_and_follows_a_cheaper_verify() -> None:
    pipe, costs = Pipeline(verify_device=2.5, prepare=0.6), StepCosts()
    decide(costs, pipe, 8, 9.0, 100)  # 17 tokens a verify, which costs ~3.5 plain steps
    dear = costs.ratio(8)
    assert dear > 2.5
    pipe.verify_device, pipe.prepare = 0.3, 0.1  # e.g. the workload's batches got cheaper
    verified = decide(costs, pipe, 8, 9.0, 12 * RETRY)
    assert costs.ratio(8) < dear / 2
    # Each retry moves the average a fifth of the way: a few retries, then it speculates.
    back = next(i for i, j in zip(verified, verified[1:]) if j - i == 1)
    assert back < 6 * RETRY
    assert len([i for i in verified if i >= back]) > 0.9 * (12 * RETRY - back)


def test_a_probe_that_takes_a_draft_now_and_then_still_backs_off() -> None:
    # A verify costing 3.2 plain steps: a probe must take 2.2 drafts to pay. Taking one
    # draft each time, the request probes as rarely as one whose drafts all miss (the waits
    # double), not every 16 tokens.
    acceptance, verifies = Acceptance(8), []
    for length in range(256):
        if acceptance.proposes(0, length, 2.2):
            acceptance.record(0, 1, acceptance.draft_len(0))
            verifies.append(length)
    assert verifies == [0, 17, 50, 115, 244]
    # A probe that paid for itself resets the wait.
    acceptance = Acceptance(8)
    assert acceptance.proposes(0, 0, 2.2)
    acceptance.record(0, 0, 8)
    assert not acceptance.proposes(0, 1, 2.2)  # switched off for 16 tokens
    assert acceptance.proposes(0, 17, 2.2)
    acceptance.record(0, 3, 8)  # 3 >= 2.2: it paid
    assert acceptance.records[0].backoff == 16


KW = dict(dtype=torch.float32, device="cpu", max_running_req=4, max_seq_len_override=160)
PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)


def prompts(n: int = 4, length: int = 12) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 1000, (n, length), generator=gen).tolist()


def half_right(want: list[list[int]]):
    """Drafts from a plain run's output with the second one wrong: one taken per verify."""

    def propose(self, reqs: list[Req], ks: list[int]) -> list[list[int]]:
        out = []
        for req, k in zip(reqs, ks):
            ids = req.input_ids.tolist()
            i = prompts().index(ids[:12])
            draft = want[i][len(ids) - 12 :][:k]
            out.append(draft[:1] + [(t + 1) % 1000 for t in draft[1:]])
        return out

    return propose


def run(
    monkeypatch: pytest.MonkeyPatch,
    verify_cost: float,
    want: list[list[int]],
    spikes: dict[int, float] | None = None,
) -> tuple:
    """Greedy tokens of the four prompts as one batch, with drafts one of which is taken
    per verify and the speculator's clock simulated: a plain step costs 1, a verify step
    `verify_cost` (the n-th, counted from 1, `spikes[n]` where given)."""
    monkeypatch.setattr(NgramDrafter, "propose", half_right(want))
    clock = [0.0]
    fake = type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0])})
    monkeypatch.setattr(step_module, "time", fake)
    llm = LLM(str(need(TINY["llama"])), **KW, speculative="ngram")
    sched, spec = llm.scheduler, llm.scheduler.spec
    step = sched.step

    def timed() -> list:
        forwards = spec.num_forwards
        out = step()
        verified = spec.num_forwards > forwards
        cost = (spikes or {}).get(spec.num_forwards, verify_cost) if verified else 1.0
        clock[0] += cost
        return out

    sched.step = timed
    out = [o["token_ids"] for o in llm.generate(prompts(), PARAMS, use_tqdm=False)]
    sched.check_integrity()
    llm.shutdown()
    return out, spec


def test_a_batch_of_four_speculates_where_it_pays_and_stops_where_it_does_not(monkeypatch):
    """The default bound (8) lets a batch of four speculate; the measured costs decide.
    With one draft taken per verify (2 tokens per request), a verify pays where it costs
    1.2 plain steps and not where it costs 8."""
    llm = LLM(str(need(TINY["llama"])), **KW)
    want = [o["token_ids"] for o in llm.generate(prompts(), PARAMS, use_tqdm=False)]
    llm.shutdown()
    cheap_out, cheap = run(monkeypatch, 1.2, want)
    dear_out, dear = run(monkeypatch, 8.0, want)
    assert cheap_out == want and dear_out == want
    assert cheap.costs.ratio(4) == pytest.approx(1.2) and dear.costs.ratio(4) == pytest.approx(8)
    assert cheap.num_forwards >= 14  # 2 tokens each: at most 20 in 40 tokens
    assert dear.num_forwards <= 4  # the two that measure, and the prior's first
    assert cheap.num_accepted == cheap.num_steps  # one draft taken per request and verify


def test_a_verify_slowed_once_by_a_kernel_build_does_not_switch_speculation_off_for_good(
    monkeypatch,
) -> None:
    """The first verify whose cost counts waits for a kernel build (a fresh machine's): it
    costs a thousand plain steps, and with that no request proposes drafts, so no declined
    verify could measure again. EXPIRE plain steps later the cost is forgotten, and the
    verifies that pay come back; the tokens are plain decoding's throughout."""
    llm = LLM(str(need(TINY["llama"])), **KW)
    want = [o["token_ids"] for o in llm.generate(prompts(), PARAMS, use_tqdm=False)]
    llm.shutdown()
    monkeypatch.setattr(cost_module, "EXPIRE", 8)  # 256 on an engine: tokens enough here
    out, spec = run(monkeypatch, 1.2, want, spikes={2: 1000.0})
    assert out == want
    assert spec.costs.ratio(4) == pytest.approx(1.2)  # measured again, without the build
    assert spec.num_forwards >= 8, spec.num_forwards  # (2 where the cost never went)


def test_a_verify_cost_that_many_plain_steps_have_passed_is_forgotten() -> None:
    costs, t = StepCosts(), 0.0
    for kind, seconds in [("plain", 1.0)] * 2 + [("verify", 2.0), ("verify", 900.0)]:
        costs.start(kind, 1, now=t)  # a warm-up of each kind, then a verify during a build
        t += seconds
    ratios = []
    for _ in range(cost_module.REFILL + 1 + cost_module.EXPIRE):
        costs.start("plain", 1, now=t)
        t += 1.0
        ratios.append(costs.ratio(1))
    # charged once the pipeline refilled; forgotten at the EXPIRE-th plain step after
    assert ratios[: cost_module.REFILL] == [PRIOR] * cost_module.REFILL
    assert min(ratios[cost_module.REFILL : -1]) == pytest.approx(900.0)
    assert ratios[-1] == PRIOR and costs.measured(1) is False


@pytest.mark.parametrize("behind", ["off", "on"])
def test_drains_for_drafts_that_come_to_nothing_reach_the_switch_off(monkeypatch, behind) -> None:
    """With overlap, the drafter here proposes a wrong token from the stale text (an even
    length) and nothing from the fresh (odd): every drain ends in a plain step. Counted as
    misses, they switch the request off; the tokens stay plain decoding's. Launched behind
    the plain step instead, each verify's guess of that step's token is wrong: the share of
    its guesses that held falls, and verifies behind plain steps stop paying as soon."""
    from minisgl.env import ENV

    monkeypatch.setattr(ENV.SPECULATIVE_BEHIND, "value", behind)

    one = prompts(1)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    llm = LLM(str(need(TINY["llama"])), **KW)
    want = llm.generate(one, params, use_tqdm=False)[0]["token_ids"]
    llm.shutdown()
    asked: list[int] = []

    def wrong_when_stale(self, reqs: list[Req], ks: list[int]) -> list[list[int]]:
        out = []
        for req, k in zip(reqs, ks):
            done = req.seq_len - len(one[0])
            if k and req.seq_len % 2 == 0 and done < len(want):
                asked.append(req.seq_len)
                out.append([(want[done] + 1) % 1000] * k)  # not the token in flight
            else:
                out.append([])
        return out

    monkeypatch.setattr(NgramDrafter, "propose", wrong_when_stale)
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", False)
    llm = LLM(str(need(TINY["llama"])), **KW, speculative="ngram")
    got = llm.generate(one, params, use_tqdm=False)[0]["token_ids"]
    spec = llm.scheduler.spec
    llm.scheduler.check_integrity()
    llm.shutdown()
    assert got == want and llm.scheduler.overlap
    if behind == "off":
        assert spec.num_forwards == 0  # never a verify: every drain came to nothing
        assert ("drained", 1) in spec.costs.seen
    else:
        assert spec.num_behind == spec.num_behind_missed > 0, (spec.num_forwards, asked)
    # Without the misses the request drafts at every other step, 24 times in 48 tokens.
    assert 1 <= len(asked) <= 6, asked


def test_the_verify_cost_tool_compares_knobs_in_alternating_engines(tmp_path) -> None:
    """--variants: every round a fresh engine per variant (the knob set while it is built),
    one round of its curve each; the table has each variant's rounds side by side."""
    out = tmp_path / "variants.json"
    args = ["--model", str(need(TINY["llama"])), "--device", "cpu", "--ks", "2", "--batches"]
    args += ["1", "--steps", "4", "--rounds", "2", "--timeline-k", "2", "--output-json", str(out)]
    spec = "ahead:SPECULATIVE_AHEAD=on;waits:SPECULATIVE_AHEAD=off"
    done = run_tool("bench_verify_cost.py", *args, "--variants", spec)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["variants"] == {"ahead": {"SPECULATIVE_AHEAD": "on"},
                                  "waits": {"SPECULATIVE_AHEAD": "off"}}  # fmt: skip
    for name in ("ahead", "waits"):
        rounds = result["runs"][name]
        assert len(rounds) == 2 and all(len(r) == 1 and r[0]["verify_ms"] > 0 for r in rounds)
        ratios = " / ".join(f"{r[0]['ratio']:.2f}" for r in rounds)
        assert f"| {name} | 1 | 2 |" in done.stdout and ratios in done.stdout
    order = [line.split()[2].rstrip(":") for line in done.stdout.splitlines()
             if line.startswith("round ")]  # fmt: skip
    assert order == ["ahead", "waits", "ahead", "waits"]


def test_the_verify_cost_tool_prints_the_curve_the_timeline_and_the_kernels(tmp_path) -> None:
    """tools/bench_verify_cost.py on the tiny model: every (batch, k) of the curve, a host
    timeline per batch, the profiler's table; the times are times (positive)."""
    out = tmp_path / "cost.json"
    args = ["--model", str(need(TINY["llama"])), "--device", "cpu", "--ks", "1,3"]
    args += ["--batches", "1,2", "--steps", "4", "--rounds", "1", "--timeline-k", "3"]
    done = run_tool("bench_verify_cost.py", *args, "--profile", "--output-json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "| batch | drafts k | decode ms | verify ms |" in done.stdout
    result = json.loads(out.read_text())
    curve = result["curve"]
    assert [(r["batch"], r["k"]) for r in curve] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    for r in curve:
        assert r["decode_ms"] > 0 and r["verify_ms"] > 0 and r["ratio"] > 0
        assert r["engine_ratio"] >= 0 and math.isfinite(r["among_ms"])  # noise: 4 steps a run
        assert f"| {r['batch']} | {r['k']} | {r['decode_ms']:.3f} |" in done.stdout
    assert sorted(result["timeline"]) == ["1", "2"]
    for table in result["timeline"].values():
        rows = 14  # ten phases, the rest, the step, outside it, the interval
        rows += 1  # a hybrid's roll back, none here  # [ch31]
        assert len(table) == rows
        assert set(table["a hybrid's states rolled back (launched)"].values()) == {0}  # [ch31]
        assert table["acceptance (launched)"]["verify"] > 0 and table["drafting"]["verify"] > 0
        assert table["sampling (launched)"]["decode"] > 0
        assert table["acceptance (launched)"]["decode"] == 0  # a decode step has none
        for sides in table.values():
            assert all(ms >= 0 for ms in sides.values()), table
        for side in ("verify", "decode"):
            assert table["interval between steps"][side] >= table["the step"][side] > 0
    kernels = result["kernels"]
    assert kernels[0]["name"] == "all" and len(kernels) > 3
    assert kernels[0]["verify_ms"] > 0 and kernels[0]["decode_ms"] > 0


def brute_last_sooner(remain: list[int], rates: list[float], ks: list[int]) -> float:
    """The same expectation by enumerating every combination of drafts taken: a request
    takes j < k drafts with probability a^j (1 - a), all k with a^k."""
    expected_last = 0.0
    for takes in itertools.product(*[range(k + 1) for k in ks]):
        p = 1.0
        for a, k, j in zip(rates, ks, takes):
            p *= a**j * (1 - a) if j < k else a**k
        expected_last += p * max(r - j for r, j in zip(remain, takes))
    return max(remain) - expected_last


def test_how_much_sooner_the_last_answer_comes_is_exact() -> None:
    gen = random.Random(0)
    for _ in range(60):
        n = gen.randint(1, 3)
        remain = [gen.randint(3, 12) for _ in range(n)]
        rates = [gen.random() for _ in range(n)]
        ks = [gen.randint(0, 4) for _ in range(n)]
        assert last_sooner(remain, rates, ks) == pytest.approx(brute_last_sooner(remain, rates, ks))
    # One request: its expected gain. A request that ends sooner anyway adds nothing.
    acceptance = Acceptance(8)
    assert last_sooner([50], [0.8], [8]) == pytest.approx(acceptance.expected(0, 8))
    alone = last_sooner([50], [0.8], [8])
    assert last_sooner([50, 30], [0.8, 0.99], [8, 8]) == pytest.approx(alone)
    # Tied, the last is the one that takes least: four at 0.8 bring it 0.69 sooner, not 3.3.
    assert last_sooner([50] * 4, [0.8] * 4, [8] * 4) == pytest.approx(
        sum(0.8 ** (4 * j) for j in range(1, 9))
    )


class Batch2:
    """The parts of a speculator that `_pays` reads, for a batch of two requests."""

    def __init__(self, together: bool, waiting: bool = False) -> None:
        self.always, self.together = False, together
        self.acceptance, self.costs = Acceptance(8), StepCosts()
        self.costs.seconds = {("plain", 2): 1.0, ("verify", 2): 1.5}  # a verify: 1.5 steps
        self.costs.since_plain = {2: 0}
        prefill = type("Prefill", (), {"has_work": waiting})()
        self.scheduler = type("Scheduler", (), {"prefill": prefill})()

    def pays(self, remain: list[int], drafts: list[int]) -> bool:
        reqs = [type("Req", (), {"uid": i, "remain_len": r})() for i, r in enumerate(remain)]
        return step_module.Speculator._pays(self, reqs, [[7] * k for k in drafts])  # type: ignore[arg-type]


def test_an_offline_batch_verifies_where_it_brings_the_last_answer_sooner() -> None:
    """Request 0 takes 6 of 10 drafts, request 1, 60 tokens further from its end, 1 of
    10; a verify costs 1.5 plain steps. A server's batch verifies: the two requests' gains
    (0.96 + 0.1 tokens) pay for the step's cost to both (0.5 each). Where one caller waits
    for both, request 1's answer is likely last, and a verify brings it only 0.1 sooner:
    the midpoint of 1.06 and 0.2 does not pay. Unless request 1's rate is still a guess
    (it learns by verifying), or more requests wait to start (a token is a token to them)."""

    def learned(spec: Batch2) -> Batch2:
        for uid, taken in ((0, 6), (1, 1)):
            spec.acceptance.records[uid] = Record(taken, 10 - taken, verified=3)
        return spec

    assert learned(Batch2(together=False)).pays([100, 160], [2, 1])
    assert not learned(Batch2(together=True)).pays([100, 160], [2, 1])
    assert learned(Batch2(together=True, waiting=True)).pays([100, 160], [2, 1])
    fresh = learned(Batch2(together=True))
    fresh.acceptance.records[1].verified = 0
    assert fresh.pays([100, 160], [2, 1])
    # When the request that takes more is the last, its drafts bring the last answer sooner.
    assert learned(Batch2(together=True)).pays([160, 100], [2, 1])
    # The offline API waits for every answer; the server's scheduler is built without it.
    llm = LLM(str(need(TINY["llama"])), **KW, speculative="ngram")
    assert llm.scheduler.spec.together
    llm.shutdown()


def test_the_speculation_tool_models_a_gpus_decisions_on_the_cpu(tmp_path) -> None:
    """tools/bench_speculative.py --costs: the scheduler decides with the step costs given,
    and each side's time is the sum of its steps' costs; the speculator's host time on
    plain steps, added, can only lower the speed-up; --ignore-eos: every answer 8 tokens."""
    out = tmp_path / "spec.json"
    args = ["--model", str(need(TINY["llama"])), "--device", "cpu", "--smoke", "--ignore-eos"]
    args += ["--speculative", "suffix", "--costs", "1:1.0:1.5,4:1.2:1.8"]
    done = run_tool("bench_speculative.py", *args, "--output-json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "| workload | set | off ms | suffix ms | modelled speed-up |" in done.stdout
    for key, row in json.loads(out.read_text()).items():
        off_steps, on_steps = row["steps"]
        assert row["first_difference"] is None, key  # fp32: the same tokens
        # Off: every decode step a plain one, at 1.0 ms (batch 1) or 1.067 (batch 2).
        per_step = 1.0 if key.endswith("batch 1") else 1.0 + 0.2 / 3
        assert row["off_ms"] == pytest.approx(off_steps * per_step)
        assert row["speedup"] == pytest.approx(row["off_ms"] / row["on_ms"])
        assert on_steps <= off_steps == 7  # 8 tokens: a prefill and 7 decode steps
        assert 0 < row["speedup_with_host"] <= row["speedup"]


def test_the_speculation_tool_names_each_plain_step_for_what_it_did(monkeypatch) -> None:
    """tools/bench_speculative.py's step trace: a plain decode step is a refill for REFILL
    steps after a verify or a drain (within a run), then declined (drafts given, none
    verified), nothing drafted (asked, none given) or plain (not asked); the speculator's
    `_propose` is given back after."""
    from pathlib import Path
    from types import SimpleNamespace

    tools = Path(__file__).resolve().parent.parent / "tools"
    if not (tools / "bench_speculative.py").exists():  # a chapter's tree, without the tool
        pytest.skip("tools/bench_speculative.py is not in this tree")
    monkeypatch.syspath_prepend(str(tools))
    from bench_speculative import StepTrace

    empty = [False]  # whether the drafter finds nothing

    def original(reqs, ks, pending=None, lead=None):  # the speculator's `_propose`
        return [[] if empty[0] else [7] * k for k in ks], [None] * len(ks)

    spec = SimpleNamespace(_propose=original, num_forwards=0, num_drained=0)
    plan: list[str] = []  # what each coming step does
    decode = SimpleNamespace(is_decode=True)

    def step() -> list:
        sched._schedule()
        what = plan.pop(0)
        if what in ("asked", "declined"):  # two requests, drafts asked of the first
            empty[0] = what == "asked"
            spec._propose([None, None], [2, 0], None, None)
        spec.num_forwards += what == "verify"
        spec.num_drained += what == "drained"
        return []

    sched = SimpleNamespace(spec=spec, step=step, _schedule=lambda: decode)
    trace = StepTrace(SimpleNamespace(scheduler=sched))
    plan += ["plain", "declined", "verify", *["plain"] * cost_module.REFILL, "asked"]
    plan += ["drained", "declined", "declined", "plain"]
    for _ in range(len(plan)):
        sched.step()
    refill = ["decode, refill"] * cost_module.REFILL
    assert [kind for kind, _ in trace] == [
        "decode", "decode, declined", "verify", *refill, "decode, nothing drafted",
        "drained", *refill, "decode",
    ]  # fmt: skip
    plan += ["verify", "plain"]
    sched.step()
    trace.clear()  # a new run: no verify behind it, so no refill
    sched.step()
    assert [kind for kind, _ in trace] == ["decode"]
    trace.stop()
    assert sched.step is step and spec._propose is original
    assert trace._collecting not in gc.callbacks


def test_under_tensor_parallelism_every_rank_times_its_steps_by_rank_0s_clock(monkeypatch):
    """The ranks must take the same steps, and verifies are decided from timed steps: so
    rank 0 sends its clock with the messages each step starts from (scheduler/ranks.py),
    and every rank's speculator times its steps by it, never by its own clock."""
    data = cost_module.stamp_clock(b"messages")
    sent = cost_module.leader_clock()
    monkeypatch.setattr(cost_module, "_leader_clock", [0.0])  # another rank's
    assert cost_module.read_clock(data) == b"messages"
    assert cost_module.leader_clock() == sent
    llm = LLM(str(need(TINY["llama"])), **KW, speculative="ngram")
    spec = llm.scheduler.spec
    spec.tp_size = 2  # as a rank of two would be; the clock it reads is the shared one
    monkeypatch.setattr(step_module, "leader_clock", lambda: 42.0)
    starts: list[float | None] = []
    start = spec.costs.start
    monkeypatch.setattr(
        spec.costs, "start", lambda k, bs, now=None: (starts.append(now), start(k, bs, now))[1]
    )
    llm.generate(prompts(2), PARAMS, use_tqdm=False)
    llm.shutdown()
    assert starts and set(starts) == {42.0}
