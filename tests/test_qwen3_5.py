"""Qwen3.5 (dense): Gated DeltaNet layers with a recurrent state pool, gated full attention.

A tiny random Qwen3.5 (3 linear layers + 1 attention layer, seed 0, fp32) is saved in the
published multimodal layout (a vision tower beside the text model) and as the text-only
CausalLM, and compared with transformers under teacher forcing: a prefill in two chunks
(the second over the state the first left), then decode steps. Batched and chunked runs
must give each request the tokens it gets alone, and so must emulated decode graphs, whose
state slots go through the graphs' static buffer; the published configs of Qwen3.5-0.8B and
9B must parse and size the engine; what a hybrid cannot do fails by name.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import QWEN3_5_PUBLISHED as PUBLISHED
from helpers import TINY, Driver, all_logits, make_engine, need, ours_only

from minisgl.core import Batch, SamplingParams
from minisgl.engine.config import EngineConfig, check_model_files
from minisgl.engine.graph import GraphCaptureBuffer
from minisgl.engine.startup import EngineShape, pages_from_budget
from minisgl.env import ENV
from minisgl.kvcache.mha_pool import MHAKVCache
from minisgl.kvcache.state_pool import RecurrentStatePool, state_pool_bytes
from minisgl.layers import activation
from minisgl.llm import LLM
from minisgl.models.config import ModelConfig
from minisgl.models.families import attention_layers
from minisgl.scheduler.hybrid_cache import HybridCacheManager

TOL = 1e-4
VOCAB = 256
TEXT: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=32,
    linear_conv_kernel_dim=4, max_position_embeddings=128, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                     "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                     "mrope_interleaved": True},
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip
VISION: dict[str, Any] = dict(
    depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64,
    patch_size=4, num_position_embeddings=16,
)  # fmt: skip


def _perturb(model: torch.nn.Module) -> None:
    """Every weight random: HF starts its (1 + w) norms at w = 0, its gated norm at 1."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForCausalLM,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5TextConfig,
    )

    root = tmp_path_factory.mktemp("qwen3_5")
    torch.manual_seed(0)
    mm = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=TEXT, vision_config=VISION))
    _perturb(mm.float())
    mm.save_pretrained(root / "mm")
    torch.manual_seed(0)
    text = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TEXT, tie_word_embeddings=True))
    _perturb(text.float())
    text.save_pretrained(root / "text")
    tok = need(TINY["llama"])  # a tokenizer for the offline API (the prompts are token ids)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tok / f).is_file():
            shutil.copy(tok / f, root / "mm" / f)
    return {"mm": root / "mm", "text": root / "text"}


def hf_reference(path: Path, ids: list[int]) -> torch.Tensor:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    cls = Qwen3_5ForConditionalGeneration if arch.endswith("Generation") else Qwen3_5ForCausalLM
    model = cls.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def token_ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def teacher_forced(engine, ids: list[int], chunk: int = 11, decode: int = 4) -> torch.Tensor:
    """Logits at every position: prefill [0, chunk), the rest of the prompt over the state
    that chunk left, then one decode step per remaining token."""
    req = Driver(engine).add(ids[:-decode], SamplingParams(max_tokens=decode + 1), row=2)
    out = []
    for end in (chunk, len(ids) - decode):
        req.device_len = end
        out.append(all_logits(engine, [req], "prefill"))
    for pos in range(len(ids) - decode, len(ids)):
        engine.token_pool[req.table_idx, pos] = ids[pos]  # the reference's next token
        req.append_host(ids[pos])
        out.append(all_logits(engine, [req], "decode"))
    return torch.cat(out)


@pytest.mark.parametrize("layout", ["mm", "text"])
def test_logits_equal_transformers(folders, layout: str, caplog) -> None:
    ids = token_ids(0, 24)
    with caplog.at_level(logging.INFO):
        engine = make_engine(folders[layout], page_size=4, max_running_req=4)
    if layout == "mm":
        assert "not loaded" in caplog.text and "model.visual" in caplog.text
    assert engine.kv_cache.k_cache(0).shape[1:] == (1, 32)
    assert engine.kv_cache._k.shape[0] == 1  # one attention layer of four keeps KV
    assert engine.state_pool.ssm.shape == (3, 5, 4, 16, 32)  # 3 linear layers, 4 rows + dummy
    assert "recurrent state pool" in caplog.text
    assert engine.model.model.layers[0].linear_attn.in_proj_sizes == [192, 128, 4, 4]  # merged
    got = teacher_forced(engine, ids)
    want = hf_reference(folders[layout], ids)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= TOL


def test_a_reused_row_starts_from_a_zero_state(folders) -> None:
    """A row's next request must not inherit the state its last one left."""
    ids = token_ids(1, 16)
    engine = make_engine(folders["mm"], max_running_req=4)
    teacher_forced(engine, token_ids(2, 20))  # leaves row 2's state behind
    got = teacher_forced(engine, ids, chunk=5)
    assert (got - hf_reference(folders["mm"], ids)).abs().max().item() <= TOL


@pytest.fixture(scope="module")
def alone(folders) -> list[list[int]]:
    """Each prompt's greedy tokens, run alone."""
    out = []
    for p in PROMPTS:
        llm = LLM(str(folders["mm"]), **SERVE)
        out.append(llm.generate([p], PARAMS, use_tqdm=False)[0]["token_ids"])
        llm.shutdown()
    return out


PROMPTS = [token_ids(10 + i, n) for i, n in enumerate((5, 13, 22))]
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
SERVE: dict[str, Any] = dict(device="cpu", dtype="float32", max_running_req=4, page_size=4,
                             num_page_override=64)  # fmt: skip


@pytest.mark.parametrize("overlap", [False, True])
def test_batched_and_chunked_as_each_alone(folders, alone, monkeypatch, overlap: bool) -> None:
    """Through the scheduler, with overlap scheduling off and on: prompts of different
    lengths, batched, chunked inside a prompt (max_prefill_length 7), give the greedy tokens
    each gets alone; the radix cache keeps state snapshots (tests/test_hybrid_prefix_cache.py
    runs it)."""
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", not overlap)
    llm = LLM(str(folders["mm"]), max_prefill_length=7, cache_type="radix", **SERVE)
    assert llm.scheduler.overlap == overlap
    assert isinstance(llm.scheduler.cache, HybridCacheManager)
    together = [o["token_ids"] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    again = [o["token_ids"] for o in llm.generate(PROMPTS[::-1], PARAMS, use_tqdm=False)]
    llm.shutdown()
    assert together == alone
    assert again == alone[::-1]


def test_preempted_requests_start_again_from_a_zero_state(folders, alone, monkeypatch) -> None:
    """Too few pages for all three at once: the newest is preempted and later recomputed."""
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", False)
    llm = LLM(str(folders["mm"]), **{**SERVE, "num_page_override": 12})
    out = [o["token_ids"] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    preemptions = llm.scheduler.num_preemptions
    llm.shutdown()
    assert preemptions > 0
    assert out == alone


def test_what_a_hybrid_cannot_do_fails_by_name(folders, monkeypatch) -> None:
    path = folders["mm"]
    config = EngineConfig(str(path), speculative="draft", draft_model=str(path))
    with pytest.raises(ValueError, match=r"\(Qwen3_5\w+\) has linear-attention"):
        check_model_files(config)  # before any process: a hybrid draft model
    monkeypatch.setattr(ENV.CPU_KV_CACHE_MB, "value", 1)
    states = "recurrent states of 64 requests and 0 prefix-cache snapshots take 1.95 MB"
    with pytest.raises(MemoryError, match=states):
        make_engine(path, num_page_override=None, max_running_req=64)


# ---- the published configs: Qwen3.5-0.8B and 9B (helpers.py holds them) -----------------


@pytest.mark.parametrize(("name", "state_mb", "kv_kb"), [("0.8B", 18, 12), ("9B", 48, 32)])
def test_published_configs_parse_and_size(tmp_path: Path, name: str, state_mb: int, kv_kb: int):
    """KV pages for the attention layers only; per request, every linear layer's state:
    value_heads x 128 x 128 x 4 bytes plus its conv's last 3 inputs (bf16)."""
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED[name]))
    mc = ModelConfig.from_path(tmp_path)
    layers = mc.num_layers
    assert mc.architecture == "Qwen3_5ForConditionalGeneration" and mc.head_dim == 256
    assert attention_layers(mc) == list(range(3, layers, 4))
    assert mc.rope is not None and mc.rope.rotary_dim == 64 and mc.rope.theta == 1e7
    assert mc.tie_word_embeddings == (name == "0.8B") and mc.linear is not None
    kv = MHAKVCache.bytes_per_page(
        len(attention_layers(mc)), 1, mc.num_kv_heads, 256, torch.bfloat16
    )
    assert kv == kv_kb * 1024  # a token's K and V, in bf16, for a quarter of the layers
    linear = layers - len(attention_layers(mc))
    ssm = linear * mc.linear.num_value_heads * 128 * 128 * 4
    conv = linear * mc.linear.conv_dim * 3 * 2
    per_req = RecurrentStatePool.bytes_per_slot(linear, mc.linear, torch.bfloat16)
    assert per_req == ssm + conv and ssm == state_mb * 2**20
    config = EngineConfig(str(tmp_path), device="cpu", max_running_req=8, state_snapshots=1)
    shape = EngineShape(config, mc, torch.device("cpu"), torch.bfloat16, torch.bfloat16,
                        4096, mc.num_heads, mc.num_kv_heads, 0)  # fmt: skip
    assert state_pool_bytes(shape) == 10 * per_req  # 8 rows, the dummy request's, a snapshot
    pages = pages_from_budget(shape)
    assert pages * kv <= 512 * 2**20 - 10 * per_req < (pages + 1) * kv  # the CPU budget


# ---- decode graphs: the state slots go through the graphs' static buffer -----------------


def graph_run(llm: LLM, params: SamplingParams = PARAMS) -> tuple[list[list[int]], list[str]]:
    """The greedy tokens of the three prompts together, and each replay's batch size and
    the size it padded to."""
    runner, log = llm.engine.graph_runner, []
    replay = type(runner).replay

    def logged(batch):
        log.append(f"{batch.phase} {batch.size}->{batch.padded_size}")
        return replay(runner, batch)

    runner.replay = logged
    try:
        out = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        del runner.replay
    return [o["token_ids"] for o in out], log


def test_decode_graphs_replay_as_eager(folders, alone) -> None:
    """Emulated decode graphs of 1, 2 and 4 requests: three requests pad to four (the
    padding row writes only the dummy request's slot), and the tokens are those of eager
    runs; no prefill graph is planned for a hybrid."""
    llm = LLM(str(folders["mm"]), cuda_graph_max_bs=4, prefill_graph="full", **SERVE)
    runner = llm.engine.graph_runner
    assert sorted(runner.graph_map) == [1, 2, 4] and runner.graphs("prefill") == {}
    buffer = runner.buffer.state_slots
    assert buffer is not None and buffer.tolist() == [llm.engine.dummy_req.table_idx] * 4
    got, log = graph_run(llm)
    llm.shutdown()
    assert "decode 3->4" in log and len(log) >= PARAMS.max_tokens - 1
    assert got == alone


def test_decode_graph_logits_equal_eager(folders) -> None:
    """Teacher-forced decode steps of three requests, padded to a graph of four: the logits
    of the replays equal those of eager forwards."""
    ids = [token_ids(20 + i, 12) for i in range(3)]

    def decode_logits(engine, replays: list[int]) -> torch.Tensor:
        driver, out = Driver(engine), []
        reqs = [driver.add(p[:-3], SamplingParams(max_tokens=4), row=i) for i, p in enumerate(ids)]
        all_logits(engine, reqs, "prefill")
        for k in (3, 2, 1):
            for r, p in zip(reqs, ids):
                engine.token_pool[r.table_idx, len(p) - k] = p[-k]  # the reference's token
                r.append_host(p[-k])
            batch = Batch(reqs, "decode")
            engine.prepare_batch(batch)
            if engine.graph_runner.can_use_cuda_graph(batch):
                replays.append(batch.padded_size)
            out.append(engine.logits(batch).clone())
            for r in reqs:
                r.complete_one()
        return torch.cat(out)

    eager_replays: list[int] = []
    eager = decode_logits(make_engine(folders["mm"], max_running_req=4), eager_replays)
    engine = make_engine(folders["mm"], max_running_req=4, cuda_graph_max_bs=4)
    replays: list[int] = []
    graphed = decode_logits(engine, replays)
    assert eager_replays == [] and replays == [4, 4, 4]
    assert (graphed - eager).abs().max().item() <= 1e-5


def test_a_state_slot_that_bypasses_the_buffer_breaks_replay(folders, alone, monkeypatch):
    """If the copy before replay leaves the state slots out, the graph reads the slots it
    was captured with (the dummy request's): the tokens change."""
    copy_from = GraphCaptureBuffer.copy_from

    def forgetful(self: GraphCaptureBuffer, batch) -> None:
        slots, self.state_slots = self.state_slots, None
        try:
            copy_from(self, batch)
        finally:
            self.state_slots = slots

    monkeypatch.setattr(GraphCaptureBuffer, "copy_from", forgetful)
    llm = LLM(str(folders["mm"]), cuda_graph_max_bs=4, **SERVE)
    got, log = graph_run(llm)
    llm.shutdown()
    assert log and got != alone


# ---- our Triton kernels (in the interpreter on a CPU): prefill graphs may then run --------

triton_only = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or Triton's interpreter",
)

# Emulated graphs (the interpreter is slow: few of them, few tokens): decode graphs of 4
# requests, prefill graphs (attention in them too) of 48 tokens: the three prompts (40
# tokens) and a filler of 8 in the dummy slot.
KERNEL_GRAPHS: dict[str, Any] = dict(cuda_graph_bs=[4], prefill_graph="full",
                                     prefill_graph_tokens=[48])  # fmt: skip
THREE = SamplingParams(max_tokens=3, ignore_eos=True)


@triton_only
def test_kernels_replay_prefill_and_decode_graphs_as_eager(folders, alone, monkeypatch) -> None:
    """With our kernels the linear layers read every length and slot from the graphs'
    buffers, so a hybrid captures prefill graphs too; three prompts of 5, 13 and 22 tokens,
    prefilled together and padded (a filler and empty requests in the dummy slot), and
    decoded in graphs, give the tokens each gets alone on the torch path."""
    monkeypatch.setattr(ENV.GATED_DELTA, "value", "triton")
    llm = LLM(str(folders["mm"]), **KERNEL_GRAPHS, **SERVE)
    assert llm.engine.state_pool.kernels == "triton"
    assert llm.engine.graph_runner.graphs("prefill")
    got, log = graph_run(llm, THREE)
    llm.shutdown()
    assert "prefill 3->4" in log and "decode 3->4" in log
    assert got == [a[:3] for a in alone]


@triton_only
def test_token_offsets_that_bypass_the_buffer_break_prefill_replay(folders, alone, monkeypatch):
    """If the copy before replay leaves the token offsets out, a prefill graph reads those
    it was captured with (every request empty): the tokens change."""
    copy_from = GraphCaptureBuffer.copy_from

    def forgetful(self: GraphCaptureBuffer, batch) -> None:
        offsets, self.state_offsets = self.state_offsets, self.state_offsets.clone()
        try:
            copy_from(self, batch)
        finally:
            self.state_offsets = offsets

    monkeypatch.setattr(ENV.GATED_DELTA, "value", "triton")
    monkeypatch.setattr(GraphCaptureBuffer, "copy_from", forgetful)
    llm = LLM(str(folders["mm"]), **KERNEL_GRAPHS, **SERVE)
    got, log = graph_run(llm, THREE)
    llm.shutdown()
    assert "prefill 3->4" in log and got != [a[:3] for a in alone]


@triton_only
def test_logits_equal_transformers_with_the_norms_fused(folders) -> None:
    """Where fused kernels run, the kernel plan gives every GemmaRMSNorm (the layers' and
    the final one) Gemma's one-kernel norm (kernels/gemma_norm.py), residual add included."""
    engine = make_engine(folders["text"], page_size=4, max_running_req=4)
    ours_only(torch.float32).install(engine.model)
    activation.use_silu_and_mul(activation.silu_and_mul_reference)  # as a CPU engine has it
    layer = engine.model.model.layers[0]
    assert layer.post_attention_layernorm.forward_add.__name__ == "fused_add"
    ids = token_ids(0, 24)
    got = teacher_forced(engine, ids)
    assert (got - hf_reference(folders["text"], ids)).abs().max().item() <= TOL
