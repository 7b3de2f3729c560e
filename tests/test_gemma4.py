"""Gemma 4 (text): layers of two shapes, KV-shared layers, per-layer embeddings, MoE beside MLP.

Two tiny random Gemma 4 models (seed 0, fp32) built with transformers' own classes:
- "e2b", shaped like E2B (text-only checkpoint): per-layer embeddings, the last 5 of 10
  layers KV-shared with double-wide MLPs, one KV head, 32-dim sliding heads against 64-dim
  full ones, a window of 8; its checkpoint also carries the k/v tensors of the shared
  layers, as a published one may, which the loader must skip;
- "a4b", shaped like 26B-A4B (multimodal checkpoint with a vision tower): K=V full layers with
  fewer KV heads and heads twice as wide, 4 experts (top-2) beside every dense MLP.
Each is compared with transformers under teacher forcing (a prefill in two chunks, then decode
steps, the prompt longer than the window) on the torch and the Triton backends, and in greedy
tokens through the offline API (batched, chunked prefill, the radix cache, emulated decode
graphs); speculative decoding (partly wrong drafts through verify graphs, suffix drafts),
radix hits and overlap scheduling each give the tokens of a plain run. The Triton kernels
run head_dim 512 against the torch backend; the four published configs parse and size the
engine by layer group, and tensor parallelism checks the full layers' KV heads.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from helpers import (
    TINY,
    Driver,
    all_logits,
    behind_oracle,
    free_port,
    make_engine,
    need,
    oracle_drafter,
    ours_only,
)
from safetensors.torch import save_file

from minisgl.attention.fi import FlashInferBackend
from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.attention.triton_backend import TritonAttnBackend
from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine.config import EngineConfig
from minisgl.engine.graph import EmulatedGraph
from minisgl.engine.startup import EngineShape, pages_from_budget
from minisgl.env import ENV
from minisgl.kvcache.allocator import page_slots
from minisgl.kvcache.layout import GroupedKVCache, KVGroup, KVLayout, backend_for
from minisgl.layers import activation
from minisgl.llm import LLM
from minisgl.models import gemma4
from minisgl.models.config import ModelConfig
from minisgl.models.register import create_model
from minisgl.speculative.ngram import NgramDrafter

TOL = 1e-4
VOCAB = 256
WINDOW = 8
S, F = "sliding_attention", "full_attention"
TEXT: dict[str, dict[str, Any]] = {
    "e2b": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=10,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=64,
        layer_types=[S, S, S, S, F] * 2, sliding_window=WINDOW, num_kv_shared_layers=5,
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB,
        use_double_wide_mlp=True, final_logit_softcapping=30.0, max_position_embeddings=128,
    ),
    "a4b": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, layer_types=[S] * 5 + [F],
        sliding_window=WINDOW, enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=24, hidden_size_per_layer_input=0, final_logit_softcapping=30.0,
        max_position_embeddings=128,
    ),
}  # fmt: skip
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=2, head_dim=8, patch_size=4,
              position_embedding_size=16)  # fmt: skip


def _perturb(model: torch.nn.Module) -> None:
    """Every weight random, norms and scalars included (transformers starts them at 1)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.add_(torch.randn_like(b) * 0.1)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import (
        Gemma4Config,
        Gemma4ForCausalLM,
        Gemma4ForConditionalGeneration,
        Gemma4TextConfig,
    )

    root = tmp_path_factory.mktemp("gemma4")
    torch.manual_seed(0)
    text = Gemma4ForCausalLM(Gemma4TextConfig(**TEXT["e2b"]))
    _perturb(text.float())
    text.save_pretrained(root / "e2b")
    # a published checkpoint may keep the KV-shared layers' k/v tensors: never loaded
    extra = {f"model.layers.{i}.self_attn.{n}.weight": torch.ones(32, 64) for i in (5, 9)
             for n in ("k_proj", "v_proj")}  # fmt: skip
    save_file(extra, root / "e2b" / "shared-layers.safetensors")
    torch.manual_seed(0)
    config = Gemma4Config(text_config=TEXT["a4b"], vision_config=VISION, audio_config=None)
    mm = Gemma4ForConditionalGeneration(config)
    _perturb(mm.float())
    mm.save_pretrained(root / "a4b")
    tok = need(TINY["llama"])  # a tokenizer for the offline API (the prompts are token ids)
    for folder in ("e2b", "a4b"):
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tok / f).is_file():
                (root / folder / f).write_bytes((tok / f).read_bytes())
    return {"e2b": root / "e2b", "a4b": root / "a4b"}


def hf_model(path: Path):
    from transformers import Gemma4ForCausalLM, Gemma4ForConditionalGeneration

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    cls = Gemma4ForConditionalGeneration if arch.endswith("Generation") else Gemma4ForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def hf_reference(path: Path, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(path)(torch.tensor([ids])).logits[0].float()


def hf_greedy(path: Path, ids: list[int], n: int) -> list[int]:
    """n greedy tokens, each from a whole forward over the sequence so far (no cache)."""
    model, out = hf_model(path), list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]


def token_ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def teacher_forced(engine, ids: list[int], chunk: int = 11, decode: int = 4) -> torch.Tensor:
    """Logits at every position: prefill [0, chunk), the rest of the prompt over the keys that
    chunk left, then one decode step per remaining token."""
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


# Each tiny model's pool: (KV heads, head_dim, layers, window) per group, the shared layers.
GROUPS = {  # the shared layers read the last sliding (3) or full (4) layer before them
    "e2b": ([(1, 32, (0, 1, 2, 3), WINDOW), (1, 64, (4,), None)],
            [(5, 3), (6, 3), (7, 3), (8, 3), (9, 4)]),
    "a4b": ([(2, 16, (0, 1, 2, 3, 4), WINDOW), (1, 32, (5,), None)], []),
}  # fmt: skip


@pytest.mark.parametrize(("name", "backend"), [("e2b", "torch"), ("a4b", "torch"),
                                               ("e2b", "triton")])  # fmt: skip
def test_logits_equal_transformers(folders, name: str, backend: str, caplog) -> None:
    """24 tokens against a window of 8, over pages of 4; the pool keeps one storage per
    geometry and nothing for the KV-shared layers. Our Triton kernels (in the interpreter)
    run both head dims, the window and the shared layers' reads."""
    ids = token_ids(0, 24)
    with caplog.at_level(logging.INFO):
        engine = make_engine(folders[name], page_size=4, attention_backend=backend)
    groups, shared = GROUPS[name]
    layout = KVLayout.of(engine.model_config, engine.max_seq_len)
    assert [(g.kv_heads, g.head_dim, g.layers, g.window) for g in layout.groups] == groups
    assert list(layout.shared) == shared
    pool = engine.kv_cache
    assert isinstance(pool, GroupedKVCache)
    assert [k.shape for k in pool.group_k] == [
        (len(layers), engine.num_pages + 1, 4, heads, dim) for heads, dim, layers, _ in groups
    ]
    assert engine.attn_backend.windows == (WINDOW,) * len(groups[0][2]) + (None,)
    assert "KV per token by layer group" in caplog.text
    skipped = "model.vision_tower" if name == "a4b" else "model.layers"  # the shared k/v
    assert "not loaded" in caplog.text and skipped in caplog.text
    if backend == "triton":  # and the norms in Gemma's fused kernel (kernels/gemma_norm.py)
        ours_only(torch.float32).install(engine.model)
        assert engine.model.model.norm.forward.__name__ == "fused"
        assert engine.model.model.layers[0].norm_add.__name__ == "fused"  # add, scale, norm
        assert engine.model.model.layers[0].mlp.act.__name__ == "gelu_and_mul"  # and PLE's
        activation.use_silu_and_mul(activation.silu_and_mul_reference)  # as a CPU engine has it
    got = teacher_forced(engine, ids, decode=4 if backend == "torch" else 2)
    want = hf_reference(folders[name], ids)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= TOL


def test_logits_equal_transformers_with_the_head_kernel(folders, monkeypatch) -> None:
    """MINISGL_GEMMA4_ROPE=triton (the default): every layer's head norms and rotary in one
    kernel a tensor (kernels/gemma4_rope.py, in the interpreter): both geometries, a plain and
    a proportional RoPE, the KV-shared layers' queries alone."""
    monkeypatch.setattr(ENV.GEMMA4_ROPE, "value", "triton")
    ids = token_ids(0, 24)
    engine = make_engine(folders["e2b"], page_size=4, attention_backend="triton")
    ours_only(torch.float32).install(engine.model)
    activation.use_silu_and_mul(activation.silu_and_mul_reference)  # as a CPU engine has it
    attn = [layer.self_attn.attn for layer in engine.model.model.layers]
    assert all(a.prepare.__name__ == "fused" for a in attn)
    got = teacher_forced(engine, ids, decode=2)
    want = hf_reference(folders["e2b"], ids)
    assert (got - want).abs().max().item() <= TOL


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_prefill_runs_the_kv_shared_layers_on_last_tokens_alone(folders, backend) -> None:
    """From the first KV-shared layer on, a prefill runs each request's last token alone
    (nothing else of those layers reaches the logits or the pool): three prompts, each past
    a chunk of 11 tokens already in the pool (a window of 8 over pages of 4), give the
    logits of their last tokens that every row run through gives."""
    engine = make_engine(folders["e2b"], page_size=4, attention_backend=backend)
    layers = engine.model.model.layers
    first = engine.model.model.first_shared
    assert first == 5 and all(layer.self_attn.shared for layer in layers[first:])
    seen: list[int] = []
    layers[first].register_forward_pre_hook(lambda _, args: seen.append(args[0].size(0)))
    driver, lens = Driver(engine), (13, 22, 30)
    prompts = [token_ids(40 + i, n) for i, n in enumerate(lens)]
    params = SamplingParams(max_tokens=2)

    def prefill(rows: list[int], every_row: bool) -> torch.Tensor:
        reqs = [driver.add(ids, params, row=r) for r, ids in zip(rows, prompts)]
        for req in reqs:
            req.device_len = 11
        all_logits(engine, reqs, "prefill")  # the first chunk
        for req, n in zip(reqs, lens):
            req.device_len = n
        if every_row:
            return all_logits(engine, reqs, "prefill")[(torch.tensor(lens) - 11).cumsum(0) - 1]
        batch = Batch(reqs, "prefill")
        engine.prepare_batch(batch)
        with torch.inference_mode(), engine.ctx.forward_batch(batch):
            return engine.model.forward()

    want = prefill([0, 1, 2], every_row=True)
    assert seen[-1] == sum(lens) - 3 * 11  # every row
    got = prefill([3, 4, 5], every_row=False)
    assert seen[-1] == 3  # the last tokens alone
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= TOL


PROMPTS = [token_ids(10 + i, n) for i, n in enumerate((13, 22, 30))]
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("name", ["e2b", "a4b"])
def test_served_greedy_equals_transformers(folders, name: str) -> None:
    """Through the offline API: three prompts longer than the window, batched, chunked at 7
    tokens, emulated decode graphs of 1, 2 and 4; then again, their prefixes now in the
    radix cache. Every request gets transformers' greedy tokens."""
    want = [hf_greedy(folders[name], p, PARAMS.max_tokens) for p in PROMPTS]
    llm = LLM(str(folders[name]), device="cpu", dtype="float32", max_running_req=4,
              page_size=4, num_page_override=96, max_prefill_length=7, cuda_graph_max_bs=4,
              cache_type="radix")  # fmt: skip
    assert sorted(llm.engine.graph_runner.graph_map) == [1, 2, 4]
    first = [o["token_ids"] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    again = [o["token_ids"] for o in llm.generate(PROMPTS[::-1], PARAMS, use_tqdm=False)]
    llm.shutdown()
    assert first == want
    assert again == want[::-1]


# ---- speculation, prefix caching and overlap: each gives the plain tokens ---------------

SERVE = dict(device="cpu", dtype="float32", max_running_req=4, page_size=4, num_page_override=96)
SPEC = dict(speculative_always=True, speculative_max_bs=4, num_draft_tokens=4)
# longer than the window of 8; the first two repeat themselves, so n-grams find drafts
SPEC_PROMPTS = [token_ids(20, 9) * 2, token_ids(21, 5) * 3 + token_ids(22, 4), token_ids(23, 12)]
SPEC_PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def serve(path: Path, prompts: list[list[int]], rounds: int = 1, **kw) -> tuple[list, LLM]:
    """Each round's greedy tokens for `prompts` from one engine (left running)."""
    llm = LLM(str(path), **{**SERVE, **kw})
    out = [[o["token_ids"] for o in llm.generate(prompts, SPEC_PARAMS, use_tqdm=False)]
           for _ in range(rounds)]  # fmt: skip
    return out, llm


@pytest.fixture(scope="module")
def plain(folders) -> dict[str, list[list[int]]]:
    """Each model's tokens for SPEC_PROMPTS: no drafts, the naive cache, one step at a time."""
    want = {}
    for name, path in folders.items():
        ENV.DISABLE_OVERLAP_SCHEDULING.value, saved = True, ENV.DISABLE_OVERLAP_SCHEDULING.value
        try:
            (want[name],), llm = serve(path, SPEC_PROMPTS, cache_type="naive")
        finally:
            ENV.DISABLE_OVERLAP_SCHEDULING.value = saved
        llm.shutdown()
    return want


def oracle(want: list[list[int]]):
    return oracle_drafter(SPEC_PROMPTS, want, VOCAB)


@pytest.mark.parametrize("name", ["e2b", "a4b"])
def test_partly_wrong_drafts_give_the_plain_tokens(folders, plain, name, monkeypatch) -> None:
    """Verify steps (emulated verify graphs of 1, 2 and 4) over both groups and the KV-shared
    layers, the keys of rejected drafts left in the pool past the accepted length."""
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", True)
    monkeypatch.setattr(NgramDrafter, "propose", oracle(plain[name]))
    replayed, replay = [], EmulatedGraph.replay
    counted = lambda self: (replayed.append(self.batch.phase), replay(self))[1]  # noqa: E731
    monkeypatch.setattr(EmulatedGraph, "replay", counted)
    (got,), llm = serve(folders[name], SPEC_PROMPTS, speculative="ngram", cuda_graph_max_bs=4,
                        **SPEC)  # fmt: skip
    spec = llm.scheduler.spec
    llm.shutdown()
    assert 0 < spec.num_accepted < spec.num_drafted  # some drafts taken, the wrong ones not
    assert "verify" in replayed
    assert got == plain[name]


def test_verifies_behind_plain_steps_give_the_plain_tokens(folders, plain, monkeypatch) -> None:
    """Overlap on, E2B's window of 8 freeing pages: verifies launched behind the plain step
    in flight, some of their guesses of its token wrong."""
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", False)
    monkeypatch.setattr(ENV.SPECULATIVE_BEHIND, "value", "on")
    monkeypatch.setattr(NgramDrafter, "propose", behind_oracle(SPEC_PROMPTS, plain["e2b"], VOCAB))
    (got,), llm = serve(folders["e2b"], SPEC_PROMPTS, speculative="ngram", cuda_graph_max_bs=4,
                        **SPEC)  # fmt: skip
    spec = llm.scheduler.spec
    llm.shutdown()
    assert spec.num_behind > 0 and spec.num_behind_missed > 0 and spec.num_accepted > 0
    assert got == plain["e2b"]


@pytest.mark.parametrize("name", ["e2b", "a4b"])
def test_suffix_drafts_from_an_earlier_round(folders, plain, name, monkeypatch) -> None:
    """The same prompts twice in one engine: the second round drafts the first's answers."""
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", True)
    rounds, llm = serve(folders[name], SPEC_PROMPTS, rounds=2, speculative="suffix", **SPEC)
    spec = llm.scheduler.spec
    llm.shutdown()
    assert spec.num_accepted > 0
    assert rounds == [plain[name], plain[name]]


@pytest.mark.parametrize("name", ["e2b", "a4b"])
def test_radix_hits_give_the_naive_caches_tokens(folders, name, monkeypatch) -> None:
    """Prompts that share a 14-token prefix (longer than the window), then the same prompts
    again: the radix cache serves prefixes (hits counted) and every answer is the naive
    cache's, chunked at 7 tokens."""
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", True)
    shared = token_ids(30, 14)
    prompts = [shared + token_ids(31 + i, n) for i, n in enumerate((3, 9, 6))]
    kw = dict(max_prefill_length=7, cuda_graph_max_bs=4)
    (want,), llm = serve(folders[name], prompts, cache_type="naive", **kw)
    llm.shutdown()
    got, llm = serve(folders[name], prompts, rounds=2, cache_type="radix", **kw)
    hits = llm.scheduler.prefill.cached_tokens_total
    llm.shutdown()
    assert hits >= 2 * 12 + 3 * 16  # the shared pages in round one, whole prompts in round two
    assert got == [want, want]


@pytest.mark.parametrize("name", ["e2b", "a4b"])
def test_overlap_scheduling_gives_the_plain_tokens(folders, plain, name, monkeypatch) -> None:
    """Overlap on: each step is launched before the last one's tokens are read; chunked at 7,
    radix cache, emulated decode graphs."""
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", False)
    (got,), llm = serve(folders[name], SPEC_PROMPTS, max_prefill_length=7, cuda_graph_max_bs=4)
    assert llm.scheduler.overlap
    llm.shutdown()
    assert got == plain[name]


# ---- tensor parallelism: two ranks over gloo equal one ----------------------------------


def tp_rank(paths: list[Path], ports: list[int], rank: int, results: Any) -> None:
    """Rank `rank` of two: each model's teacher-forced logits (rank 0 reports them)."""
    torch.set_num_threads(1)
    for path, port in zip(paths, ports):
        engine = make_engine(path, page_size=4, tp_size=2, tp_rank=rank,
                             dist_init_addr=f"127.0.0.1:{port}")  # fmt: skip
        try:
            logits = teacher_forced(engine, token_ids(0, 24))
        finally:
            engine.shutdown()
        if rank == 0:
            results.put((path.name, logits.numpy()))


def test_tp2_logits_equal_tp1(folders) -> None:
    """Over two ranks the one KV head (E2B-like) and the K=V full layers' one KV head
    (26B-A4B-like) are held whole by both ranks, every other projection and the experts cut
    in two: the logits are one rank's."""
    paths = [folders["e2b"], folders["a4b"]]
    ctx = mp.get_context("spawn")
    queue, ports = ctx.Queue(), [free_port() for _ in paths]
    ranks = [ctx.Process(target=tp_rank, args=(paths, ports, r, queue)) for r in (0, 1)]
    for p in ranks:
        p.start()
    try:
        got = dict(queue.get(timeout=300) for _ in paths)
    finally:
        for p in ranks:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in ranks] == [0, 0]
    for path in paths:
        want = teacher_forced(make_engine(path, page_size=4), token_ids(0, 24))
        assert (torch.from_numpy(got[path.name]) - want).abs().max().item() <= TOL


# ---- our Triton kernels with head_dim 512 against the torch backend ----------------------


def test_triton_kernels_with_two_head_dims_match_torch() -> None:
    """A pool of a 256-dim sliding group (window 5) and a 512-dim full group, 2 query heads
    on 1 KV head: a prefill of two requests (one over a cached prefix), then a decode step;
    the Triton backend's outputs (in the interpreter) are the torch backend's."""
    layout = KVLayout(
        groups=(KVGroup(1, 256, (0,), 5), KVGroup(1, 512, (1,), None)),
        place=((0, 0), (1, 0)), windows=(5, None), shared=(), recurrent=(),
        every_layer=((1, 256), (1, 512)),
    )  # fmt: skip
    cpu, page_size, rows, width = torch.device("cpu"), 4, 3, 24
    pool = GroupedKVCache(layout, 16, page_size, torch.float32, cpu)
    table = torch.zeros(rows, width, dtype=torch.int32)
    for row in range(rows - 1):
        table[row] = page_slots(list(range(1 + 6 * row, 7 + 6 * row)), page_size)
    backends = [cls(pool, table, 0.07, 2) for cls in (TorchAttnBackend, TritonAttnBackend)]
    for b in backends:
        b.set_windows(list(layout.windows))
    gen = torch.Generator().manual_seed(0)
    reqs = [Req(torch.arange(n, dtype=torch.int32), row, cached, 4, row, SamplingParams())
            for row, (n, cached) in enumerate([(11, 0), (17, 6)])]  # fmt: skip

    def step(phase: str) -> None:
        batch = Batch(reqs, phase)  # type: ignore[arg-type]
        batch.out_loc = torch.cat([table[r.table_idx, r.cached_len : r.device_len] for r in reqs])
        n = batch.out_loc.numel()
        for layer, dim in enumerate((256, 512)):
            q, k, v = (torch.randn(n, h, dim, generator=gen) for h in (2, 1, 1))
            outs = []
            for b in backends:
                b.prepare_metadata(batch)
                outs.append(b.forward(q, k, v, layer, batch))
            torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)

    prefix = torch.randn(6, 1, 256, generator=gen)  # the second request's cached positions
    pool.store_kv(prefix, prefix, table[1, :6], 0)
    pool.store_kv(prefix.repeat(1, 1, 2), prefix.repeat(1, 1, 2), table[1, :6], 1)
    step("prefill")
    for r in reqs:
        r.complete_one()
    step("decode")


# ---- which backend reads the pool; the MoE's two paths ------------------------------------


def test_a_backend_of_one_geometry_is_refused_or_passed_over(folders) -> None:
    """FlashInfer plans one head_dim: asked for by name it is refused with the reason; under
    `auto` another backend is taken. A model of one geometry keeps it."""
    mc = ModelConfig.from_path(folders["a4b"])
    shape = SimpleNamespace(model_config=mc, max_seq_len=128, page_size=4, dtype=torch.float32,
                            kv_dtype=torch.float32, device=torch.device("cpu"),
                            config=SimpleNamespace(attention_backend="fi"))  # fmt: skip
    with pytest.raises(ValueError, match="'fi' cannot run here: .* 2 x 16 and 1 x 32"):
        backend_for(shape, FlashInferBackend)
    shape.config.attention_backend = "auto"
    # wrapped: the sliding layers read a page table of their own (kvcache/window_pages.py)
    assert backend_for(shape, FlashInferBackend).__mro__[2] is TorchAttnBackend
    assert backend_for(shape, TritonAttnBackend).__mro__[2] is TritonAttnBackend
    one = ModelConfig.from_path(need(TINY["qwen3"]))
    assert backend_for(SimpleNamespace(**{**vars(shape), "model_config": one}),
                       FlashInferBackend) is FlashInferBackend  # fmt: skip


def test_experts_fused_kernel_equals_the_loop(monkeypatch) -> None:
    """GELU experts: the fused kernel's grouped GEMMs (in the interpreter) and the loop over
    experts give the same mixture."""
    torch.manual_seed(0)
    experts = gemma4.GeluExperts(4, 32, 24)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    x, ids = torch.randn(5, 32), torch.randint(0, 4, (5, 2))
    weights = torch.rand(5, 2)
    fused = experts(x, ids, weights)
    monkeypatch.setattr(gemma4, "use_fused_moe", lambda x: False)
    torch.testing.assert_close(experts(x, ids, weights), fused, atol=1e-5, rtol=1e-5)


# ---- the published configs: E2B, E4B, 26B-A4B and 31B (shapes from their config.json) -----


def published(hidden: int, inter: int, layers: int, pattern: int, heads: int, kv: int,
              global_kv: int | None, window: int, shared: int, ple: int, context: int,
              moe: bool = False, double_wide: bool = False) -> dict[str, Any]:  # fmt: skip
    k_eq_v = global_kv is not None
    text = dict(
        model_type="gemma4_text", vocab_size=262144, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
        num_global_key_value_heads=global_kv, head_dim=256, global_head_dim=512,
        attention_k_eq_v=k_eq_v, layer_types=([S] * (pattern - 1) + [F]) * (layers // pattern),
        sliding_window=window, num_kv_shared_layers=shared, hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=262144, use_double_wide_mlp=double_wide,
        enable_moe_block=moe, num_experts=128 if moe else None,
        top_k_experts=8 if moe else None, moe_intermediate_size=704 if moe else None,
        final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=context, rms_norm_eps=1e-6, tie_word_embeddings=True,
        attention_bias=False, dtype="bfloat16",
        rope_parameters={F: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                             "rope_theta": 1000000.0},
                         S: {"rope_type": "default", "rope_theta": 10000.0}},
    )  # fmt: skip
    return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
            "text_config": text, "vision_config": {"model_type": "gemma4_vision"},
            "tie_word_embeddings": True}  # fmt: skip


PUBLISHED = {
    "E2B": published(1536, 6144, 35, 5, 8, 1, None, 512, 20, 256, 131072, double_wide=True),
    "E4B": published(2560, 10240, 42, 6, 8, 2, None, 512, 18, 256, 131072),
    "26B-A4B": published(2816, 2112, 30, 6, 16, 8, 2, 1024, 0, 0, 262144, moe=True),
    "31B": published(5376, 21504, 60, 6, 32, 16, 4, 1024, 0, 0, 262144),
}
B = 2  # bytes of a bf16 number
# By hand from the published shapes, a token's K and V in bf16 of the layers that store them
# ((sliding group), (full group)), and of every attention layer keeping its own.
# E2B: the first 15 layers store: 12 sliding and 3 full; the last 20 read theirs.
# E4B: the first 24: 20 sliding and 4 full. 26B-A4B and 31B: every layer stores.
EXPECTED_BYTES = {
    "E2B": ((2 * 12 * 1 * 256 * B, 2 * 3 * 1 * 512 * B), 2 * (28 * 1 * 256 + 7 * 1 * 512) * B),
    "E4B": ((2 * 20 * 2 * 256 * B, 2 * 4 * 2 * 512 * B), 2 * (35 * 2 * 256 + 7 * 2 * 512) * B),
    "26B-A4B": ((2 * 25 * 8 * 256 * B, 2 * 5 * 2 * 512 * B), 2 * (25 * 8 * 256 + 5 * 2 * 512) * B),
    "31B": ((2 * 50 * 16 * 256 * B, 2 * 10 * 4 * 512 * B), 2 * (50 * 16 * 256 + 10 * 4 * 512) * B),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_parse_and_size(tmp_path: Path, name: str) -> None:
    """Bytes per token by group as counted by hand, the saving against every layer keeping
    its own KV, the pages that fit the CPU budget; and the model built on the meta device has
    exactly the tensors of transformers' (parameters counted)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED[name]))
    mc = ModelConfig.from_path(tmp_path)
    assert mc.gemma4 is not None and mc.head_dim == 256 and mc.query_pre_attn_scalar == 1.0
    assert mc.rope is not None and mc.rope.rope_type == "proportional" and mc.rope.theta == 1e6
    assert mc.local_rope is not None and mc.local_rope.theta == 1e4
    groups, every = EXPECTED_BYTES[name]
    layout = KVLayout.of(mc, mc.max_position_embeddings)
    assert [g.bytes_per_token(torch.bfloat16) for g in layout.groups] == list(groups)
    assert [g.window for g in layout.groups] == [mc.sliding_window, None]
    assert layout.every_layer_bytes_per_token(torch.bfloat16) == every
    assert len(layout.shared) == mc.gemma4.kv_shared_layers
    config = EngineConfig(str(tmp_path), device="cpu", max_running_req=8)
    shape = EngineShape(config, mc, torch.device("cpu"), torch.bfloat16, torch.bfloat16,
                        4096, mc.num_heads, mc.num_kv_heads, 0)  # fmt: skip
    pages = pages_from_budget(shape)
    # the sliding group's pages apart (window_pages.py), the full ones filling the rest, at
    # most every row filled
    windowed, full = groups[0] * config.window_pages, groups[1] * pages
    assert config.window_pages <= pages and windowed + full <= 512 * 2**20  # the CPU budget
    # one page more (a full one; or of both, where the budget could not hold them apart)
    more = groups[1] if config.window_pages < pages else sum(groups)
    assert pages == 8 * 4096 or windowed + full + more > 512 * 2**20
    assert f"{sum(groups):,} B in all, against {every:,} B" in layout.describe(torch.bfloat16)
    text = PUBLISHED[name]["text_config"]
    hf_config = Gemma4TextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    with torch.device("meta"):
        ours = create_model(mc)
        theirs = Gemma4ForCausalLM(hf_config)
    count = sum(t.numel() for n, t in theirs.state_dict().items() if n != "lm_head.weight")
    assert sum(p.numel() for p in ours.parameters()) == count


def test_tensor_parallel_check_counts_the_global_kv_heads(tmp_path: Path) -> None:
    """Start-up splits the full layers' KV heads too: 2 of them over 4 ranks are held whole
    by pairs of ranks (as one KV head is by every rank), 3 over 2 ranks cannot be split and
    are refused by name before anything loads."""
    from minisgl.layers.parallel import check_tp

    config = json.loads(json.dumps(PUBLISHED["26B-A4B"]))
    (tmp_path / "config.json").write_text(json.dumps(config))
    check_tp(ModelConfig.from_path(tmp_path), 4)
    config["text_config"]["num_global_key_value_heads"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_global_key_value_heads 3 neither divides 2"):
        check_tp(ModelConfig.from_path(tmp_path), 2)


def test_kernel_launches_fit_a_block_at_head_dim_512() -> None:
    """The decode and extend launches keep their measured blocks up to head_dim 256 and fit
    227 KB of shared memory at 512 (bf16 and FP8 caches), where the measured ones do not;
    decode there takes the warps its accumulator needs."""
    from minisgl.kernels.attention import Launch, decode_launch, extend_launch, launch_override
    from minisgl.kernels.tile_fit import SMEM_PER_BLOCK, fit_launch, tile_bytes

    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    launches = [(decode_launch(bs, kv), kv) for bs in (1, 8, 256) for kv in (bf16, fp8)]
    launches += [(extend_launch(n, kv), kv) for n in (16, 1024) for kv in (bf16, fp8)]
    too_big = 0
    for launch, kv in launches:
        rows = launch.block_m or 16  # 8 query heads a KV head: decode's 16 rows
        for head_dim in (64, 128, 256):
            assert fit_launch(launch, 8, head_dim, bf16, kv) is launch
            assert tile_bytes(rows, launch, head_dim, bf16, kv) <= SMEM_PER_BLOCK
        fitted = fit_launch(launch, 8, 512, bf16, kv)
        assert tile_bytes(fitted.block_m or 16, fitted, 512, bf16, kv) <= SMEM_PER_BLOCK
        too_big += tile_bytes(rows, launch, 512, bf16, kv) > SMEM_PER_BLOCK
    assert too_big >= 4
    # bf16 decode at batch 8: 64 keys a block need 415,744 B at 512, 32 need 218,112 B
    assert fit_launch(decode_launch(8, bf16), 8, 512, bf16, bf16).block_n == 32
    # and 4 warps share a decode program's 16 x 512 accumulator (2 held 128 numbers a thread),
    # but a sweep's launch keeps the warps it asked for
    assert [
        fit_launch(decode_launch(bs, bf16), 8, 512, bf16, bf16).warps for bs in (1, 8, 256)
    ] == [4, 4, 4]
    assert fit_launch(decode_launch(8, bf16), 8, 256, bf16, bf16).warps == 2
    with launch_override("decode", Launch(64, 2)):
        assert fit_launch(Launch(64, 2), 8, 512, bf16, bf16).warps == 2
    long = fit_launch(extend_launch(1024, bf16), 8, 512, bf16, bf16)
    assert (long.block_m, long.block_n, long.stages) == (32, 16, 3)  # 64 x 512 fp32 spills


@pytest.mark.parametrize(
    "name",
    [
        "E2B",
        "qwen3.5-0.8B",  # [ch31]
    ],
)
def test_fp8_kv_scales_land_on_the_pool_layer_a_layer_stores_in(tmp_path, name) -> None:
    """A checkpoint numbers its KV scales by model layer; the pool numbers only the layers
    that store KV. E2B's last 20 layers store none (they read their source's keys, so its
    scale); Qwen3.5-0.8B's attention layers are every fourth (3, 7, ...), pool layers 0, 1, ...
    Each pool layer gets its own model layer's scales, and each layer attends with those of
    the layer whose keys it reads."""
    from minisgl.models.families import attention_layers, kv_pool_layers, kv_source
    from minisgl.quant.kv_scales import KVScales, use_kv_scales

    raw = PUBLISHED.get(name)
    # >>> ch31 Qwen3.5-0.8B's published config
    if name == "qwen3.5-0.8B":
        from helpers import QWEN3_5_PUBLISHED

        raw = QWEN3_5_PUBLISHED["0.8B"]
    # <<< ch31
    (tmp_path / "config.json").write_text(json.dumps(raw))
    mc = ModelConfig.from_path(tmp_path)
    layout = KVLayout.of(mc, 4096)
    pool = layout.new_pool(2, 4, torch.float8_e4m3fn, torch.device("cpu"))
    scales = KVScales(mc.num_layers)
    layers = attention_layers(mc)
    scales.k = {i: 0.01 * (i + 1) for i in layers}  # shared layers too: never read
    scales.v = {i: 0.02 * (i + 1) for i in layers}
    model = torch.nn.Module()
    model.kv_scales = scales
    use_kv_scales(model, pool)
    pool_layer = kv_pool_layers(mc)
    assert len(pool.k_scale) == len(layout.stored_layers()) < mc.num_layers
    for i in layers:  # the scales layer i attends with: those of the layer it reads
        source = kv_source(mc, i)
        assert pool.scales(pool_layer[i]) == (scales.k[source], scales.v[source])
    del scales.k[layers[1]]
    with pytest.raises(ValueError, match=f"no KV-cache scales for layers \\[{layers[1]}\\]"):
        use_kv_scales(model, layout.new_pool(2, 4, torch.float8_e4m3fn, torch.device("cpu")))
