"""Speculative decoding with a draft model: a smaller model's greedy tokens as drafts.

Whatever the draft model guesses, greedy output must equal greedy output without drafts,
token for token: with the model as its own draft (it then guesses nearly everything),
with a smaller, different model (it guesses little), under chunked prefill, pages of 16,
preemption, requests finishing at different times and graphs. The draft engine's pages
and rows must all come back, and its drafts must be the draft model's own greedy tokens
after each step cut away what the model rejected.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import TINY, need
from safetensors.torch import load_file, save_file

from minisgl.core import Req, SamplingParams
from minisgl.engine.config import EngineConfig, check_model_files
from minisgl.llm import LLM
from minisgl.server.args import parse_args
from minisgl.speculative.draft_model import DraftModelDrafter

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


def derived_model(src: Path, out: Path, layers: int, vocab: int | None = None) -> Path:
    """A copy of `src` cut to its first `layers` layers (and `vocab` tokens), every weight
    nudged by seeded noise: the same family, another model."""
    out.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = layers
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:layers]
    config["vocab_size"] = vocab or config["vocab_size"]
    (out / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(1)
    weights = {}
    for name, w in sorted(load_file(src / "model.safetensors").items()):
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= layers:
            continue
        w = w[:vocab] if "embed_tokens" in name or "lm_head" in name else w
        weights[name] = w + 0.004 * torch.randn(w.shape, generator=gen)
    save_file(weights, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def small_qwen3(tmp_path_factory) -> Path:
    return derived_model(need(TINY["qwen3"]), tmp_path_factory.mktemp("d") / "small", 1)


@pytest.fixture
def checked(monkeypatch):
    """Check the draft engine's pages and rows after every proposal."""
    propose = DraftModelDrafter.propose

    def checked_propose(self, reqs, ks):
        drafts = propose(self, reqs, ks)
        self.check_integrity()
        assert all(len(d) <= k for d, k in zip(drafts, ks))
        return drafts

    monkeypatch.setattr(DraftModelDrafter, "propose", checked_propose)


def generate(path, prompts, params, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(need(path)), **{**KW, **kw})
    out = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.scheduler.check_integrity()  # every KV page of the model back where it belongs
    return out, llm


def finish(llm: LLM):
    """Shut down after checking that the draft engine gave back every page and row as its
    requests finished; the speculator, for its counters."""
    spec = llm.scheduler.spec
    drafter = spec.drafter
    drafter.check_integrity()
    assert drafter.cache.allocator.num_free == drafter.engine.num_pages
    assert drafter.table.available == drafter.rows and not drafter.held
    llm.shutdown()
    return spec


def tiny_prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    stem = torch.randint(0, 1000, (20,), generator=gen).tolist()
    return [stem + stem[: 3 + i] for i in range(3)] + [stem[:9] * 2]


def mixed_params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=20 + 3 * i, ignore_eos=True) for i in range(4)]


@pytest.mark.usefixtures("checked")
def test_the_model_as_its_own_draft_accepts_nearly_everything() -> None:
    prompts, params = tiny_prompts(1), mixed_params()
    kw = dict(page_size=16, num_page_override=64, max_prefill_length=12, cuda_graph_max_bs=4)
    want, llm = generate(TINY["qwen3"], prompts, params, **kw)
    llm.shutdown()
    # A stop token the plain run emits mid-output: it must end the run inside an accepted run.
    stop = want[1][12]
    params[1] = SamplingParams(max_tokens=23, ignore_eos=True, stop_token_ids=[stop])
    want[1] = want[1][: want[1].index(stop) + 1]
    path = TINY["qwen3"]
    got, llm = generate(path, prompts, params, speculative="draft", draft_model=str(path), **kw)
    graphs = llm.scheduler.spec.drafter.engine.graph_runner.graphs("decode")
    spec = finish(llm)
    assert got == want
    assert spec.num_accepted >= 0.9 * spec.num_drafted > 0, (spec.num_accepted, spec.num_drafted)
    assert spec.num_forwards < max(len(w) for w in want) / 2  # several tokens per verify
    assert graphs  # the draft engine decodes through (emulated) graphs too


@pytest.mark.usefixtures("checked")
@pytest.mark.parametrize(
    ("target", "page_size", "pages", "chunk"),
    [("qwen3", 1, 2048, 8192), ("qwen3", 16, 6, 12)],
)
def test_a_smaller_draft_model_keeps_the_output_exact(small_qwen3, target, page_size, pages, chunk):
    prompts, params = tiny_prompts(2), mixed_params()
    kw = dict(page_size=page_size, num_page_override=pages, max_prefill_length=chunk)
    want, llm = generate(TINY[target], prompts, params, **kw)
    llm.shutdown()
    got, llm = generate(
        TINY[target], prompts, params, speculative="draft", draft_model=str(small_qwen3), **kw
    )
    preempted = llm.scheduler.num_preemptions
    spec = finish(llm)
    assert got == want
    assert 0 < spec.num_accepted < spec.num_drafted  # some guesses taken, many not
    if pages < 2048:
        assert preempted > 0  # too few pages for the four together: some are preempted


def plain_greedy(path: Path, ids: list[int], n: int) -> list[int]:
    llm = LLM(str(path), **KW)
    out = llm.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    return out[0]["token_ids"]


def test_drafts_are_the_draft_models_greedy_tokens_after_rejections(small_qwen3) -> None:
    prompt = tiny_prompts(3)[0]
    path = str(TINY["llama"])
    llm = LLM(path, **KW, page_size=4, speculative="draft", draft_model=str(small_qwen3))
    drafter = llm.scheduler.spec.drafter
    req = Req(torch.tensor(prompt, dtype=torch.int32), 0, 0, 64, 7, SamplingParams())
    first = drafter.propose([req], [8])[0]
    assert first == plain_greedy(small_qwen3, prompt, 8)
    assert drafter.held[req.uid].req.alloc_len == 32  # 23 tokens and 7 drafts, pages of 4
    # The model took one draft and said a token of its own, then a plain step added one:
    # the pool keeps the prompt and that draft (what the text and the pool share), gives
    # back the pages past them, and drafts from the new text.
    for token in [first[0], (first[1] + 1) % 1000, 5]:
        req.append_host(token)
    second = drafter.propose([req], [2])[0]
    assert second == plain_greedy(small_qwen3, req.input_ids.tolist(), 2)
    assert drafter.held[req.uid].tokens.tolist() == req.input_ids.tolist() + second[:1]
    assert drafter.held[req.uid].req.alloc_len == 28  # 26 tokens and 1 draft
    assert drafter.cache.allocator.num_free == drafter.engine.num_pages - 7
    drafter.check_integrity()
    assert drafter.propose([], []) == []  # a request not asked about has left
    assert drafter.cache.allocator.num_free == drafter.engine.num_pages
    llm.shutdown()


@pytest.mark.usefixtures("checked")
def test_mixed_requests_and_seeded_sampling_are_reproducible(small_qwen3) -> None:
    prompts = tiny_prompts(4)
    plain = SamplingParams(max_tokens=16, ignore_eos=True)
    penalised = SamplingParams(max_tokens=16, ignore_eos=True, frequency_penalty=0.5)
    sampled = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, top_k=50, seed=7)
    want, llm = generate(TINY["qwen3"], prompts, [plain, penalised, plain, plain])
    llm.shutdown()
    runs = []
    for _ in range(2):
        got, llm = generate(
            TINY["qwen3"],
            prompts,
            [plain, penalised, sampled, plain],
            speculative="draft",
            draft_model=str(small_qwen3),
        )
        finish(llm)
        runs.append(got)
    assert runs[0] == runs[1]  # a seed gives the same tokens again
    assert [runs[0][i] for i in (0, 1, 3)] == [want[i] for i in (0, 1, 3)]


def test_draft_settings_are_checked(small_qwen3, tmp_path) -> None:
    target = str(TINY["llama"])
    other = derived_model(TINY["llama"], tmp_path / "other", 1, vocab=1000)
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens, the model 49152"):
        check_model_files(EngineConfig(target, speculative="draft", draft_model=str(other)))
    with pytest.raises(ValueError, match="needs draft_model"):
        EngineConfig(target, speculative="draft")
    with pytest.raises(ValueError, match="only with speculative 'draft'"):
        EngineConfig(target, speculative="ngram", draft_model=str(small_qwen3))
    with pytest.raises(ValueError, match="not a model folder"):
        config = EngineConfig(target, speculative="draft", draft_model=str(tmp_path / "nothing"))
        check_model_files(config)
    with pytest.raises(ValueError, match="needs tp_size 1"):
        EngineConfig(target, speculative="draft", draft_model=str(small_qwen3), tp_size=2)
    short = derived_model(TINY["llama"], tmp_path / "short", 1)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    with pytest.raises(ValueError, match="context of 64 tokens, the model 160"):
        LLM(target, **KW, speculative="draft", draft_model=str(short))
    args = ["--model", target, "--speculative", "draft", "--draft-model", str(small_qwen3)]
    assert parse_args(args).scheduler.draft_model == str(small_qwen3)
    with pytest.raises(SystemExit):  # the command line says what is wrong, and exits
        parse_args(["--model", target, "--speculative", "draft", "--draft-model", str(other)])


def test_with_overlap_scheduling_drafts_come_from_the_fresh_tokens(monkeypatch, small_qwen3):
    from minisgl.env import ENV

    prompts, params = tiny_prompts(5), mixed_params()
    want, llm = generate(TINY["qwen3"], prompts, params)
    llm.shutdown()
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", False)
    got, llm = generate(
        TINY["qwen3"], prompts, params, speculative="draft", draft_model=str(small_qwen3)
    )
    overlap = llm.scheduler.overlap
    spec = finish(llm)
    assert overlap and got == want and spec.num_accepted > 0
