"""On a CUDA device: the engine equals Hugging Face there too, and the graph runner behaves.

Skipped without CUDA. The models are built here from a seed (a GPU machine may have no
prepared model folders), with the SmolLM2 tokenizer files.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
from pathlib import Path

import pytest
import torch
from helpers import SMOL, Driver, all_logits, make_engine, need

from minisgl.core import SamplingParams
from minisgl.env import ENV
from minisgl.llm import LLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# FlashInfer is optional (`pip install 'minisgl[gpu]'`): its cases are skipped where it is missing
HAS_FI = importlib.util.find_spec("flashinfer") is not None
NEEDS_FI = pytest.mark.skipif(not HAS_FI, reason="FlashInfer is not installed")
ATTNS = [pytest.param("fi", marks=NEEDS_FI), "triton"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("gpu-llama")
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=49152,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SMOL / name, out / name)
    return out


def hf_logits_cuda(path: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        return model(torch.tensor([ids], device="cuda")).logits[0].float()


def test_logits_equal_hf_on_cuda(model_dir: Path) -> None:
    ids = torch.randint(0, 49152, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = hf_logits_cuda(model_dir, ids)
    engine = make_engine(model_dir, device="cuda", page_size=16)
    req = Driver(engine).add(ids, SamplingParams(max_tokens=1), row=0)
    req.device_len = 20  # a prefix, then the rest over the cached prefix
    first = all_logits(engine, [req], "prefill")
    req.device_len = len(ids)
    second = all_logits(engine, [req], "prefill")
    got = torch.cat([first, second])
    assert (got - ref).abs().max().item() <= 1e-3


def test_torch_backend_turns_graphs_off_on_cuda(model_dir: Path, caplog) -> None:
    with caplog.at_level(logging.INFO):
        llm = LLM(
            str(model_dir),
            dtype=torch.float32,
            device="cuda",
            max_running_req=8,
            attention_backend="torch",
        )
    assert llm.engine.graph_runner.graph_map == {}
    assert "CUDA graphs off" in caplog.text
    llm.shutdown()


def test_debug_mode_on_cuda_equals_eager(model_dir: Path) -> None:
    ENV.DISABLE_OVERLAP_SCHEDULING.value = True
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    kw = dict(dtype=torch.float32, device="cuda", max_running_req=8, max_seq_len_override=256)
    eager = LLM(str(model_dir), cuda_graph_max_bs=0, **kw)
    want = [o["token_ids"] for o in eager.generate(prompts, params, use_tqdm=False)]
    eager.shutdown()
    debug = LLM(str(model_dir), cuda_graph_max_bs=4, debug_cuda_graph=True, **kw)
    assert sorted(debug.engine.graph_runner.graph_map) == [1, 2, 4]
    got = [o["token_ids"] for o in debug.generate(prompts, params, use_tqdm=False)]
    debug.shutdown()
    ENV.DISABLE_OVERLAP_SCHEDULING.value = False
    assert got == want


def test_overlap_on_cuda_equals_serial(model_dir: Path) -> None:
    prompts = [[i, i + 1, i + 2] * (i % 5 + 1) for i in range(1, 20)]
    params = [SamplingParams(max_tokens=4 + i % 7, ignore_eos=True) for i in range(19)]
    outputs = []
    for overlap in (False, True):
        ENV.DISABLE_OVERLAP_SCHEDULING.value = not overlap
        llm = LLM(
            str(model_dir),
            dtype=torch.float32,
            device="cuda",
            max_running_req=8,
            max_seq_len_override=256,
            page_size=4,
        )
        outputs.append([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.scheduler.check_integrity()
        llm.shutdown()
    ENV.DISABLE_OVERLAP_SCHEDULING.value = False
    assert outputs[0] == outputs[1]


# ---- FlashInfer and real CUDA graphs (ch19) ------------------------------------------------

BF16 = dict(  # graphs off: the teacher-forcing helper runs the model without the runner
    dtype=torch.bfloat16,
    device="cuda",
    num_page_override=2048,
    max_running_req=16,
    cuda_graph_max_bs=0,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Random two-layer models of each family with head_dim 64, a size FlashInfer's kernels
    are built for (the CPU test models use 16 and 32, which would need kernels of their own)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    common = dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    families = {
        "llama": ("LlamaForCausalLM", {}),
        "qwen2": ("Qwen2ForCausalLM", {}),
        "qwen3": ("Qwen3ForCausalLM", {}),
        "qwen3_moe": (
            "Qwen3MoeForCausalLM",
            dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128),
        ),
    }
    out = {}
    for family, (arch, extra) in families.items():
        folder = tmp_path_factory.mktemp(f"gpu-{family}")
        config = AutoConfig.for_model(family, architectures=[arch], **common, **extra)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(SMOL / name, folder / name)
        out[family] = folder
    return out


def teacher_forced(engine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits at every position of each prompt, all requests batched: positions [0, 5) in
    one prefill, [5, 12) as an extension over the cached prefix, then one decode step per
    remaining position (the token pool holds the prompt, so each step is teacher-forced)."""
    driver = Driver(engine)
    reqs = [driver.add(ids, SamplingParams(max_tokens=1), row=i) for i, ids in enumerate(prompts)]
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    for start, end in ((0, 5), (5, 12)):
        for req in reqs:
            req.device_len = end
        logits = all_logits(engine, reqs, "prefill").split(end - start)
        for rows, piece in zip(got, logits):
            rows.append(piece)
    while live := [r for r, p in zip(reqs, prompts) if r.device_len <= len(p)]:
        for req, row in zip(live, all_logits(engine, live, "decode")):
            got[req.table_idx].append(row[None])
    return [torch.cat(rows) for rows in got]


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the logits' scale."""
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "smollm2"])
@pytest.mark.parametrize("attn", ATTNS)
def test_logits_match_torch_backend(
    tiny: dict[str, Path], attn: str, name: str, page_size: int
) -> None:
    path = need(SMOL) if name == "smollm2" else tiny[name]
    vocab = 49152
    gen = torch.Generator().manual_seed(page_size)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (20, 33, 13)]
    out = {}
    for backend in ("torch", attn):
        engine = make_engine(path, attention_backend=backend, page_size=page_size, **BF16)
        out[backend] = teacher_forced(engine, prompts)
        engine.shutdown()
    for fi, ref in zip(out[attn], out["torch"]):
        assert fi.shape == ref.shape
        assert close(fi, ref) < 0.05  # bf16 logits near 20 are spaced 0.125 apart
        # the top token agrees wherever the reference is not a near tie
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.1 * ref.abs().max()
        assert (fi.argmax(-1) == ref.argmax(-1))[clear].all()


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_gemv_decode_matches_the_matmul_library_and_hf(
    tiny: dict[str, Path], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode at batch 1, where our GEMV kernel runs every projection (the norms before qkv
    and gate_up inside it, the LM head too), against the same steps with it off (cuBLAS and
    FlashInfer's norm kernels) and against Hugging Face in fp32, under teacher forcing."""
    ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    out = {}
    for rows in (1, 0):
        monkeypatch.setattr(ENV.GEMV_MAX_ROWS, "value", rows)
        monkeypatch.setattr(ENV.GEMV, "value", "on")  # not left to the start-up measurement
        engine = make_engine(tiny[name], **BF16)
        out[rows] = teacher_forced(engine, [ids])[0][12:]  # the decode steps
        engine.shutdown()
    ref = hf_logits_cuda(tiny[name], ids)[12:]
    assert out[1].shape == out[0].shape == ref.shape
    assert close(out[1], out[0]) < 0.05  # bf16 logits near 20 are spaced 0.125 apart
    assert close(out[1], ref) < 0.05 and close(out[0], ref) < 0.05
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1 * ref.abs().max()
    assert (out[1].argmax(-1) == ref.argmax(-1))[clear].all()


@NEEDS_FI
def test_fused_kernels_match_reference() -> None:
    from types import MethodType, SimpleNamespace

    from minisgl.layers import activation
    from minisgl.layers.activation import silu_and_mul, silu_and_mul_reference
    from minisgl.layers.fused import rope as fi_rope
    from minisgl.layers.kernel_plan import KernelPlan
    from minisgl.layers.norm import RMSNorm
    from minisgl.layers.rotary import RotaryEmbedding

    # FlashInfer's kernels, as an engine whose attention is FlashInfer installs them
    plan = KernelPlan.at_start(torch.device("cuda"), torch.bfloat16, SimpleNamespace(name="fi"))
    assert plan.flashinfer is not None

    torch.manual_seed(0)
    x = torch.randn(37, 512, device="cuda", dtype=torch.bfloat16)
    res = torch.randn_like(x)
    norm = RMSNorm(512, 1e-6).cuda().to(torch.bfloat16)
    torch.nn.init.normal_(norm.weight, 1.0, 0.1)
    plan.install(norm)
    with torch.no_grad():
        assert close(norm(x), norm.reference(x)) < 1e-2
        want_h, want_r = norm.reference(x + res), x + res
        got_h, got_r = norm.forward_add(x.clone(), res.clone())
        assert close(got_h, want_h) < 1e-2 and close(got_r, want_r) < 1e-2
        qkv = torch.randn(37, (8 + 2 * 2) * 128, device="cuda", dtype=torch.bfloat16)
        q = qkv[:, : 8 * 128].view(37, 8, 128)  # strided views, as the attention layer has
        k = qkv[:, 8 * 128 : 10 * 128].view(37, 2, 128)
        rope = RotaryEmbedding(128, 1e6, 4096, torch.device("cuda"))
        rope.rotate = MethodType(fi_rope(plan.flashinfer), rope)
        pos = torch.randint(0, 4096, (37,), device="cuda", dtype=torch.int32)
        want_q, want_k = rope.reference(pos, q.clone(), k.clone())
        got_q, got_k = rope(pos, q, k)
        assert close(got_q, want_q) < 1e-2 and close(got_k, want_k) < 1e-2
        h = torch.randn(37, 2 * 768, device="cuda", dtype=torch.bfloat16)
        assert close(silu_and_mul(h), silu_and_mul_reference(h)) < 1e-2
    activation.use_silu_and_mul(silu_and_mul_reference)  # as before the plan


SMOL_PROMPTS = [
    "The capital of France is",
    "List three prime numbers:",
    "def fibonacci(n):",
    "Once upon a time",
    "The quick brown fox",
    "import numpy as np",
    "My favourite colour is",
    "1, 1, 2, 3, 5, 8,",
    "Water boils at",
    "Write a haiku about the sea.",
    "The opposite of hot is",
    "SELECT * FROM",
    "Translate 'good morning' to Spanish:",
    "The largest planet in the solar system is",
    "To be or not to be,",
    "A recipe for pancakes: first,",
]


def _greedy(path: Path, prompts: list[str], **kw) -> list[list[int]]:
    llm = LLM(str(path), dtype=torch.bfloat16, device="cuda", max_running_req=16, **kw)
    out = llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    return [o["token_ids"] for o in out]


@pytest.mark.parametrize("attn", ATTNS)
def test_smollm2_graphs_equal_debug_mode_and_report_agreement(attn: str, capsys) -> None:
    import json

    from transformers import AutoModelForCausalLM

    from minisgl.tokenizer.tokenizer import Tokenizer

    need(SMOL)
    ENV.DISABLE_OVERLAP_SCHEDULING.value = True
    kw = dict(num_page_override=4096, max_seq_len_override=256, attention_backend=attn)
    try:
        graphs = _greedy(SMOL, SMOL_PROMPTS, cuda_graph_max_bs=16, **kw)
        debug = _greedy(SMOL, SMOL_PROMPTS, cuda_graph_max_bs=16, debug_cuda_graph=True, **kw)
        eager = _greedy(SMOL, SMOL_PROMPTS, cuda_graph_max_bs=0, **kw)
    finally:
        ENV.DISABLE_OVERLAP_SCHEDULING.value = False
    assert graphs == debug  # the same kernels, replayed or run eagerly through the runner
    if attn == "triton":
        # Our kernels read lengths on the device and split the same way for the same batch
        # (16 requests decode together to the end, no padding): replay changes nothing.
        assert graphs == eager
        return

    tok = Tokenizer(str(SMOL))
    hf = AutoModelForCausalLM.from_pretrained(SMOL, dtype=torch.bfloat16).cuda().eval()
    report = {"graphs_vs_eager": 0, "graphs_vs_hf_bf16": 0, "partings": []}
    for i, prompt in enumerate(SMOL_PROMPTS):
        ids = tok.encode(prompt)
        report["graphs_vs_eager"] += graphs[i] == eager[i]
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids], device="cuda"),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
        report["graphs_vs_hf_bf16"] += graphs[i] == out
        if graphs[i] != out:
            at = next(j for j, (a, b) in enumerate(zip(graphs[i], out)) if a != b)
            with torch.no_grad():
                logits = hf(torch.tensor([ids + out[:at]], device="cuda")).logits[0, -1].float()
            gap = (logits[out[at]] - logits[graphs[i][at]]).item()
            report["partings"].append({"prompt": i, "at": at, "hf_logit_gap": round(gap, 4)})
    print("SMOLLM2_AGREEMENT", attn, json.dumps(report))
    # bf16 runs of different kernels part only where HF's own top two are nearly tied
    assert all(p["hf_logit_gap"] < 0.5 for p in report["partings"])


@pytest.mark.parametrize("attn", ATTNS)
def test_graph_replay_across_buckets_equals_debug_mode(tiny: dict[str, Path], attn: str) -> None:
    ENV.DISABLE_OVERLAP_SCHEDULING.value = True
    kw = dict(
        attention_backend=attn,
        dtype=torch.bfloat16,
        device="cuda",
        max_running_req=24,
        num_page_override=4096,
        max_seq_len_override=128,
        cuda_graph_max_bs=16,
    )
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 49152, (int(n),), generator=gen).tolist() for n in range(3, 23)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    try:
        graphs = LLM(str(tiny["llama"]), **kw)
        assert sorted(graphs.engine.graph_runner.graph_map) == [1, 2, 4, 8, 16]
        assert isinstance(graphs.engine.graph_runner.graph_map[1], torch.cuda.CUDAGraph)
        debug = LLM(str(tiny["llama"]), debug_cuda_graph=True, **kw)
        for bs in range(1, 21):  # every bucket boundary, and past the largest (eager)
            want = [o["token_ids"] for o in debug.generate(prompts[:bs], params, use_tqdm=False)]
            got = [o["token_ids"] for o in graphs.generate(prompts[:bs], params, use_tqdm=False)]
            assert got == want, f"batch size {bs}"
        graphs.shutdown()
        debug.shutdown()
    finally:
        ENV.DISABLE_OVERLAP_SCHEDULING.value = False


@NEEDS_FI
def test_chunked_radix_overlap_on_cuda_equal_serial(tiny: dict[str, Path]) -> None:
    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(0, 49152, (40,), generator=gen).tolist()
    prompts = [
        shared[: 10 + 3 * i] + torch.randint(0, 49152, (5 + i,), generator=gen).tolist()
        for i in range(12)
    ]
    params = [SamplingParams(max_tokens=4 + i % 6, ignore_eos=True) for i in range(12)]
    outputs = []
    for overlap in (False, True):
        ENV.DISABLE_OVERLAP_SCHEDULING.value = not overlap
        llm = LLM(
            str(tiny["qwen3"]),
            dtype=torch.bfloat16,
            device="cuda",
            max_running_req=8,
            num_page_override=1024,
            max_seq_len_override=128,
            page_size=4,
            max_prefill_length=24,  # chunks
            cuda_graph_max_bs=8,
            attention_backend="fi",
        )
        assert llm.engine.attn_backend.name == "fi"
        outputs.append([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.scheduler.check_integrity()
        llm.shutdown()
    ENV.DISABLE_OVERLAP_SCHEDULING.value = False
    assert outputs[0] == outputs[1]


def test_auto_picks_the_measured_backend_with_graphs(tiny: dict[str, Path], caplog) -> None:
    """triton on an H200, where it was measured faster (attention/registry.py); fi elsewhere,
    where it is installed."""
    with caplog.at_level(logging.INFO):
        llm = LLM(str(tiny["llama"]), dtype=torch.bfloat16, device="cuda", max_running_req=8)
        measured = "H200" in torch.cuda.get_device_name()
        if measured or HAS_FI:
            assert llm.engine.attn_backend.name == ("triton" if measured else "fi")
        else:  # FlashInfer, first in the default order, passed over
            assert llm.engine.attn_backend.name != "fi" and "passed over" in caplog.text
        assert llm.engine.graph_runner.graph_map
        llm.shutdown()
    assert "captured CUDA graphs" in caplog.text and "(auto; " in caplog.text


def test_moe_runs_fused_in_graphs_and_equals_eager(tiny: dict[str, Path]) -> None:
    """With Triton (it ships with CUDA torch) Qwen3-MoE decodes in CUDA graphs."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (5, 9, 17, 30)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    out = {}
    ENV.DISABLE_OVERLAP_SCHEDULING.value = True
    try:
        for graph_bs in (4, 0):
            kw = dict(dtype=torch.bfloat16, device="cuda", max_running_req=4)
            moe = LLM(str(tiny["qwen3_moe"]), cuda_graph_max_bs=graph_bs, **kw)
            assert bool(moe.engine.graph_runner.graph_map) == (graph_bs > 0)
            out[graph_bs] = [o["token_ids"] for o in moe.generate(prompts, params, use_tqdm=False)]
            moe.shutdown()
    finally:
        ENV.DISABLE_OVERLAP_SCHEDULING.value = False
    assert out[4] == out[0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_tp2_matches_tp1_with_graphs(tiny: dict[str, Path], name: str) -> None:
    """Two ranks over NCCL, all-reduces inside each rank's decode graphs: teacher-forced
    log-probabilities of the prompt equal one rank's within bf16 tolerance."""
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (9, 30, 64)]
    params = SamplingParams(max_tokens=8, ignore_eos=True, prompt_logprobs=True, logprobs=True)
    out = {}
    for tp in (1, 2):
        kw = dict(dtype=torch.bfloat16, device="cuda", max_running_req=4, cuda_graph_max_bs=4)
        llm = LLM(str(tiny[name]), tp_size=tp, **kw)
        assert llm.engine.graph_runner.graph_map  # decode graphs, all-reduces captured
        out[tp] = llm.generate(prompts, params, use_tqdm=False)
        llm.shutdown()
    for one, two in zip(out[1], out[2]):
        a = torch.tensor([p["logprob"] for p in one["prompt_logprobs"][1:]])
        b = torch.tensor([p["logprob"] for p in two["prompt_logprobs"][1:]])
        assert close(b, a) < 0.05


@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("mode", ["breakable", "full"])
def test_prefill_graphs_on_cuda_equal_debug(tiny: dict[str, Path], attn: str, mode: str) -> None:
    """Real prefill graphs replay what debug mode runs eagerly through the same runner
    (same padding, buffers and metadata): chunks, cached prefixes, decode in between."""
    gen = torch.Generator().manual_seed(4)
    shared = torch.randint(0, 49152, (30,), generator=gen).tolist()
    prompts = [
        shared[: 5 + 2 * i] + torch.randint(0, 49152, (3 + i,), generator=gen).tolist()
        for i in range(10)
    ]
    params = [SamplingParams(max_tokens=3 + i % 5, ignore_eos=True) for i in range(10)]
    kw = dict(
        attention_backend=attn,
        dtype=torch.bfloat16,
        device="cuda",
        max_running_req=4,
        num_page_override=2048,
        max_seq_len_override=128,
        page_size=4,
        max_prefill_length=32,
        cuda_graph_max_bs=4,
        prefill_graph=mode,
        prefill_graph_tokens=[8, 16, 32],
    )
    if attn == "fi" and mode == "full":
        with pytest.raises(ValueError, match="use 'breakable'"):
            LLM(str(tiny["qwen3"]), **kw)
        return
    outputs = []
    ENV.DISABLE_OVERLAP_SCHEDULING.value = True
    try:
        for debug in (False, True):
            llm = LLM(str(tiny["qwen3"]), debug_cuda_graph=debug, **kw)
            graph = llm.engine.graph_runner.graphs("prefill")[4, 16]
            if mode == "breakable":
                assert type(graph).__name__ == "BreakableGraph"  # (chapter 23's)
                layers = llm.engine.model_config.num_layers
                assert len(graph.breaks) == layers + 1  # attention per layer, the LM-head rows
                assert len(graph.segments) == (0 if debug else layers + 2)
            elif not debug:
                assert isinstance(graph, torch.cuda.CUDAGraph)
            out = [llm.generate(prompts, params, use_tqdm=False) for _ in range(2)]
            outputs.append([o["token_ids"] for wave in out for o in wave])
            llm.scheduler.check_integrity()
            llm.shutdown()
    finally:
        ENV.DISABLE_OVERLAP_SCHEDULING.value = False
    assert outputs[0] == outputs[1]
