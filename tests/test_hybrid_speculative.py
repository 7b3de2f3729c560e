"""Speculative decoding on a hybrid model: the linear layers' state rolled back to the drafts
a verify step accepted.

A verify step runs the model over each request's last token and its drafts, so the
recurrent state (SSM and conv) advances over every draft; when some are rejected, each
request's slot must hold the state after its accepted tokens only (`keep_accepted`). Greedy
tokens with speculation must equal those without, in fp32: with drafts that are partly
wrong (an oracle that spoils every third step) and with suffix drafts from earlier
answers, batched. Without the roll back the same run gives other tokens, so the test can fail.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import QWEN3_5_PUBLISHED, TINY, behind_oracle, need, oracle_drafter
from test_qwen3_5 import TEXT, VOCAB, _perturb, token_ids

from minisgl.core import SamplingParams
from minisgl.engine.config import EngineConfig, check_model_files
from minisgl.engine.startup import EngineShape
from minisgl.env import ENV
from minisgl.kvcache.state_pool import RecurrentStatePool, state_pool_bytes, verify_capacity
from minisgl.llm import LLM
from minisgl.models.config import ModelConfig
from minisgl.models.families import LinearAttention
from minisgl.speculative.ngram import NgramDrafter

pytestmark = pytest.mark.usefixtures("serial")

KW = dict(device="cpu", dtype="float32", max_running_req=4, page_size=4, num_page_override=96)
SPEC = dict(speculative_always=True, speculative_max_bs=4, num_draft_tokens=4)
PROMPTS = [token_ids(20, 9) * 2, token_ids(21, 5) * 3 + token_ids(22, 4), token_ids(23, 12)]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    root = tmp_path_factory.mktemp("qwen3_5_spec")
    torch.manual_seed(0)
    hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TEXT, tie_word_embeddings=True))
    _perturb(hf.float())
    hf.save_pretrained(root)
    tok = need(TINY["llama"])  # the offline API wants a tokenizer; the prompts are token ids
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tok / f).is_file():
            shutil.copy(tok / f, root / f)
    return root


def generate(path: Path, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), **{**KW, **kw})
    out = [o["token_ids"] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    return out, llm


@pytest.fixture(scope="module")
def plain(model: Path) -> list[list[int]]:
    out, llm = generate(model)
    llm.shutdown()
    return out


def oracle(want: list[list[int]]):
    return oracle_drafter(PROMPTS, want, VOCAB)


def test_partly_wrong_drafts_give_the_plain_tokens(model, plain, monkeypatch) -> None:
    monkeypatch.setattr(NgramDrafter, "propose", oracle(plain))
    got, llm = generate(model, speculative="ngram", **SPEC)
    spec = llm.scheduler.spec
    llm.shutdown()
    assert 0 < spec.num_accepted < spec.num_drafted  # some drafts taken, the wrong ones not
    assert got == plain


def test_without_the_roll_back_the_tokens_change(model, plain, monkeypatch) -> None:
    """The test above can fail: a verify that keeps the state after its rejected drafts."""
    monkeypatch.setattr(NgramDrafter, "propose", oracle(plain))
    monkeypatch.setattr(RecurrentStatePool, "keep_accepted", lambda self, batch, accepted: None)
    got, llm = generate(model, speculative="ngram", **SPEC)
    llm.shutdown()
    assert got != plain


def test_verifies_behind_plain_steps_give_the_plain_tokens(model, plain, monkeypatch) -> None:
    """Overlap on: a verify launched behind the plain step in flight reads the state that
    step leaves, and where its guess of that step's token was wrong keeps the state after
    the one token it makes."""
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", False)
    monkeypatch.setattr(ENV.SPECULATIVE_BEHIND, "value", "on")
    monkeypatch.setattr(NgramDrafter, "propose", behind_oracle(PROMPTS, plain, VOCAB))
    got, llm = generate(model, speculative="ngram", **SPEC)
    spec = llm.scheduler.spec
    llm.shutdown()
    assert spec.num_behind > 0 and spec.num_behind_missed > 0 and spec.num_accepted > 0
    assert got == plain


def test_suffix_drafts_from_earlier_answers_give_the_plain_tokens(model, plain) -> None:
    """The same prompts again, in one engine: the suffix drafter proposes the first round's
    answers, batched, and the second round must still be the plain tokens."""
    llm = LLM(str(model), **KW, speculative="suffix", **SPEC)
    rounds = [
        [o["token_ids"] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] for _ in range(2)
    ]
    spec = llm.scheduler.spec
    llm.shutdown()
    assert spec.num_accepted > 0  # the second round's drafts were taken
    assert rounds == [plain, plain]


triton_only = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or Triton's interpreter",
)


@triton_only
@pytest.mark.parametrize("roll_back", [True, False])
def test_our_kernels_verify_on_copies_and_roll_back(model, plain, monkeypatch, roll_back):
    """With our Triton kernels (in the interpreter on a CPU) a verify runs the linear layers
    on copies of the states, and the roll back replays each request's accepted tokens into
    its slot: partly wrong drafts give the plain tokens, and without the roll back (the
    slots left as they were before the verify) other tokens."""
    monkeypatch.setattr(ENV.GATED_DELTA, "value", "triton")
    monkeypatch.setattr(NgramDrafter, "propose", oracle(plain))
    if not roll_back:
        monkeypatch.setattr(RecurrentStatePool, "keep_accepted", lambda self, batch, acc: None)
    got, llm = generate(model, speculative="ngram", **SPEC)
    spec, kernels = llm.scheduler.spec, llm.engine.state_pool.kernels
    llm.shutdown()
    assert kernels == "triton" and 0 < spec.num_accepted < spec.num_drafted
    assert (got == plain) == roll_back


class Frozen(dict):
    """`RecurrentStatePool.gates` once the engine is built: those its capture left stay,
    whatever a later forward sets, as when a CUDA graph replays (no Python runs)."""

    frozen = False

    def __setitem__(self, key, value) -> None:
        if not self.frozen:
            super().__setitem__(key, value)


@triton_only
@pytest.mark.parametrize("roll_back", [True, False])
def test_verify_graphs_of_our_kernels_roll_back_from_their_buffers(
    model, plain, monkeypatch, roll_back
):
    """With our kernels verify graphs run for a hybrid (emulated on a CPU): partly wrong
    drafts, verified in graphs padded with a filler request, give the plain tokens, though
    the layers' gate parameters are those the capture left (a graph's replay sets none: the
    roll back reads the pool's buffers, which every verify writes, and the live batch); without
    the roll back, other tokens."""
    monkeypatch.setattr(ENV.GATED_DELTA, "value", "triton")
    monkeypatch.setattr(NgramDrafter, "propose", oracle(plain))
    if not roll_back:
        monkeypatch.setattr(RecurrentStatePool, "keep_accepted", lambda self, batch, acc: None)
    llm = LLM(str(model), **KW, speculative="ngram", **SPEC, cuda_graph_max_bs=4)
    pool, runner = llm.engine.state_pool, llm.engine.graph_runner
    gates = Frozen(pool.gates)
    pool.gates, gates.frozen = gates, True
    assert len(gates) == 3 and runner.graphs("verify")  # the three linear layers' own
    graphed, replay = [], type(runner).replay

    def logged(batch):
        graphed.append((batch.phase, batch.size, batch.padded_size))
        return replay(runner, batch)

    runner.replay = logged
    got = [o["token_ids"] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    spec = llm.scheduler.spec
    llm.shutdown()
    verifies = [r for r in graphed if r[0] == "verify"]
    assert verifies and any(size < padded for _, size, padded in verifies)
    assert 0 < spec.num_accepted < spec.num_drafted
    assert (got == plain) == roll_back


def test_the_verify_buffers_are_sized_and_counted(tmp_path, monkeypatch) -> None:
    """Our kernels' verify buffers hold the largest verify: 8 requests of 8 drafts (72
    tokens; 9 rows with a graph's filler), for Qwen3.5-0.8B's 18 linear layers their qkv
    before and after the conv, a and b, and 9 conv states, in the state pool's bytes; none
    without speculation or on the torch path. A larger verify is an error, not a write past
    them."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_5_PUBLISHED["0.8B"]))
    mc = ModelConfig.from_path(tmp_path)

    def shape(**kw) -> EngineShape:
        config = EngineConfig(str(tmp_path), device="cpu", max_running_req=16, **kw)
        return EngineShape(config, mc, torch.device("cpu"), torch.bfloat16, torch.bfloat16,
                           4096, mc.num_heads, mc.num_kv_heads, 0)  # fmt: skip

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(ENV.GATED_DELTA, "value", "triton")
    plain, spec = shape(state_snapshots=1), shape(state_snapshots=1, speculative="ngram")
    assert verify_capacity(plain) == (0, 0) and verify_capacity(spec) == (72, 9)
    conv_dim, heads = 6144, 16
    want = 18 * (72 * 2 * (conv_dim + heads) + 9 * conv_dim * 3) * 2  # bf16
    assert state_pool_bytes(spec) - state_pool_bytes(plain) == want  # 36 MiB
    monkeypatch.setattr(ENV.GATED_DELTA, "value", "torch")
    assert verify_capacity(spec) == (0, 0)

    monkeypatch.setattr(ENV.GATED_DELTA, "value", "triton")
    small = LinearAttention(1, 2, 4, 4, 4)
    pool = RecurrentStatePool(2, 3, small, torch.float32, torch.device("cpu"), verify=(4, 2))
    assert pool.bytes == RecurrentStatePool.verify_bytes(2, small, torch.float32, (4, 2)) + (
        RecurrentStatePool.bytes_per_slot(2, small, torch.float32) * 3
    )
    with pytest.raises(RuntimeError, match="sized for 4 and 2"):
        pool.verify_views(0, 5, 2)
    with pytest.raises(RuntimeError, match="sized for 4 and 2"):
        pool.verify_views(0, 4, 3)
    views = pool.verify_views(1, 4, 2)
    views.mixed.fill_(2.0)
    assert pool.verify_qkv[1, 1].sum() == 2 * 4 * small.conv_dim  # views, not copies
    assert views.conv.shape == (2, small.conv_dim, 3) and views.a.shape == (4, 2)


def test_a_hybrid_draft_model_is_refused(model) -> None:
    config = EngineConfig(str(model), speculative="draft", draft_model=str(model))
    with pytest.raises(ValueError, match="linear-attention layers"):
        check_model_files(config)
