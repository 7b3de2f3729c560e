"""Chapter 28: FP8 weights. Every FP8 path equals its dequantised reference; FP8 checkpoints
in Hugging Face's block-scaled layout load as they are, their scales merged and sliced
with their rows; the quantised models stay within a stated distance of the originals.

The kernels run in Triton's interpreter on the CPU (tests/conftest.py turns it on), in
fp32, where they must equal the reference to rounding. Against the unquantised model the
distance is FP8's own: teacher-forced logits within LOGIT_TOL of the largest logit on the
tiny random models, and on SmolLM2 the same next token at TOP1 of the positions of a real
sentence (measured: 33 of 36 per row, 35 of 36 with blocks of 128). A GPU runs the
bf16 paths too (the tests marked for it).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import SMOL, TINY, all_logits, make_engine, need, run_tool, tokenizer
from safetensors.torch import load_file, save_file

from minisgl.core import Req, SamplingParams
from minisgl.distributed.info import set_tp_info
from minisgl.engine.config import EngineConfig, check_model_files
from minisgl.kvcache.allocator import page_slots
from minisgl.layers.activation import silu_and_mul
from minisgl.layers.linear import Linear
from minisgl.layers.norm import RMSNorm
from minisgl.layers.triton_ops import GemvKey, GemvTable, NormedInput
from minisgl.llm import LLM
from minisgl.models.config import ModelConfig
from minisgl.models.register import create_model
from minisgl.models.weight import load_weights
from minisgl.quant import fp8, fp8_choice
from minisgl.quant.fp8 import FP8, FP8_MAX, dequantize, quantize_blocks, quantize_rows
from minisgl.quant.quantize import projections, quantize_model
from minisgl.server.args import parse_args

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or Triton's interpreter",
)
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="the bf16 paths need a GPU")
LOGIT_TOL = 0.08  # tiny models: max |FP8 logit - logit| <= this x the largest |logit|
TOP1 = 0.85  # SmolLM2: share of positions whose likeliest next token stays the same
PROMPT, DECODED = list(range(5, 17)), [7, 8]
SENTENCE = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type with an oil-based ink and a screw press, so that "
    "books could be made"
)


# ---- the numbers ----------------------------------------------------------------------


def test_rows_and_blocks_round_to_the_nearest_fp8_value() -> None:
    """Each scale maps its slice's largest magnitude to 448, and every weight comes back
    within half a step of e4m3 (1/16 of itself; subnormals, a fixed 2^-10 of the scale)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(37, 300, generator=gen) * torch.rand(37, 1, generator=gen) * 3
    rows = quantize_rows(w)
    assert rows[0].dtype == FP8 and rows[1].shape == (37, 1)
    assert torch.equal(rows[0].float().abs().amax(1), torch.full((37,), FP8_MAX))
    for q, scale, block in [(*rows, (1, 300)), (*quantize_blocks(w, (16, 128)), (16, 128))]:
        err = (dequantize(q, scale, block) - w).abs()
        bound = w.abs() / 16 + fp8.expand(scale, block, *w.shape) * 2**-10
        assert (err <= bound * (1 + 1e-6)).all()
    assert quantize_blocks(w, (16, 128))[1].shape == (3, 3)  # ceil(37 / 16), ceil(300 / 128)


# ---- the kernels against the reference -----------------------------------------------

# (rows, out, in): a plain projection has out + 5 outputs (a last block cut short), a gated
# one out per half (gate and up meet at a block boundary, as the loader makes sure they do)
SHAPES = [(1, 64, 32), (3, 32, 70), (4, 96, 1030), (8, 32, 600)]
BLOCKS = [None, (16, 16), (4, 128), (32, 32)]  # None: one scale per row


def _weights(n: int, k: int, block: tuple[int, int] | None, seed: int, device=DEV):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5
    q, scale = quantize_rows(w) if block is None else quantize_blocks(w, block)
    return q.to(device), scale.to(device), (1, k) if block is None else block


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_fp8_gemv_equals_the_dequantised_reference(m, n, k, block) -> None:
    from minisgl.kernels.fp8_gemv import fp8_gemv

    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).to(DEV)
    bias = torch.randn(n + 5, generator=gen).to(DEV)
    q, scale, blk = _weights(n + 5, k, block, n + k)
    for b in (None, bias):
        want = fp8.reference(x, q, scale, blk, b)
        torch.testing.assert_close(fp8_gemv(x, q, scale, blk, b), want, rtol=0, atol=1e-5)
    gate_up = _weights(2 * n, k, block, n)
    want = silu_and_mul(fp8.reference(x, *gate_up))
    torch.testing.assert_close(fp8_gemv(x, *gate_up, gated=True), want, rtol=0, atol=1e-5)
    # the residual add and RMSNorm folded in, as chapter 20's deferred norm hands them over
    residual, norm = torch.randn(m, k, generator=gen).to(DEV), RMSNorm(k, 1e-6).to(DEV)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(k, generator=gen) + 0.5)
    out = torch.full_like(x, float("nan"))
    got = fp8_gemv(x, *gate_up, gated=True, norm=(residual, out, norm.weight, norm.eps))
    normed = norm.reference(x + residual)
    want = silu_and_mul(fp8.reference(normed, *gate_up))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(out, x + residual, rtol=0, atol=0)


@pytest.mark.parametrize("m", [1, 3])
def test_fp8_mma_gemv_equals_the_w8a8_reference(m: int) -> None:
    """The tensor-core GEMV of a few rows: x quantised per row (with the deferred norm in the
    same kernel), then the product of the two dequantised operands; gated and with a bias."""
    from minisgl.kernels.fp8_mma import fp8_mma_candidates, fp8_mma_gemv
    from minisgl.kernels.fp8_quantize import quantize_groups

    n, k = 128, 256
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(DEV)
    bias = torch.randn(n, generator=gen).to(DEV)

    def w8a8(rows: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, b=None) -> torch.Tensor:
        qx, sx = fp8.quantize_groups_reference(rows, k)
        return F.linear(dequantize(qx, sx, (1, k)), dequantize(q, scale, (1, k)), b)

    q, scale, _ = _weights(n, k, None, 5)
    gate_up = _weights(2 * n, k, None, 6)[:2]
    candidates = fp8_mma_candidates(n, k)
    assert candidates and fp8_mma_candidates(n, k + 64) == []  # blocks must divide the shape
    for blocks in candidates:
        xq, xs = quantize_groups(x, k)
        got = fp8_mma_gemv(xq, xs, q, scale, blocks, x.dtype, bias)
        torch.testing.assert_close(got, w8a8(x, q, scale, bias), rtol=0, atol=1e-4)
        got = fp8_mma_gemv(xq, xs, *gate_up, blocks, x.dtype, gated=True)
        torch.testing.assert_close(got, silu_and_mul(w8a8(x, *gate_up)), rtol=0, atol=1e-4)
    # the residual add and RMSNorm before it, in the quantiser
    residual, norm = torch.randn(m, k, generator=gen).to(DEV), RMSNorm(k, 1e-6).to(DEV)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(k, generator=gen) + 0.5)
    out = torch.full_like(x, float("nan"))
    xq, xs = quantize_groups(x, k, norm=(residual, out, norm.weight, norm.eps))
    want_q, want_s = fp8.quantize_groups_reference(norm.reference(x + residual), k)
    torch.testing.assert_close(out, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(xs, want_s, rtol=1e-6, atol=0)
    assert (xq.float() - want_q.float()).abs().le(want_q.float().abs() / 8 + 1e-6).all()
    # chosen by the start-up table, for a projection with a norm deferred to it
    layer = _layer(q, scale, (1, k))
    table = GemvTable()
    table.blocks.update({(GemvKey(n, k, False, True, False), r): candidates[0] for r in (1, 4)})
    layer.gemv_choice = tuple(  # as the kernel plan installs it
        fp8_choice.gemv_choices(table, GemvKey.of(layer, False, normed)) for normed in (False, True)
    )
    out = torch.empty_like(x)
    got = fp8.fp8_projection(NormedInput(x, residual, out, norm.weight, norm.eps), layer)
    want = F.linear(dequantize(want_q, want_s, (1, k)), dequantize(q, scale, (1, k)))
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.02 * want.abs().max().item())
    torch.testing.assert_close(out, x + residual, rtol=0, atol=0)


@pytest.mark.parametrize(("m", "k", "group"), [(3, 70, 16), (5, 1030, 128), (2, 600, 600)])
def test_activation_quantiser_equals_the_reference(m: int, k: int, group: int) -> None:
    """Bit for bit: the kernel rounds to e4m3 itself, ties to even, as torch's cast does."""
    from minisgl.kernels.fp8_quantize import quantize_groups

    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 40).to(DEV)
    q, scales = quantize_groups(x, group)
    want_q, want_scales = fp8.quantize_groups_reference(x, group)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scales, want_scales)
    if group < k:
        assert scales.stride() == (1, m)  # the column-major layout cuBLAS's 1x128 recipe reads


def test_scaled_mm_rows_equals_the_w8a8_reference() -> None:
    """Larger batches quantise x per row too; torch's FP8 matmul must give the product of the
    two dequantised operands (on the CPU where this torch has it, on a GPU in bf16 below)."""
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))
    q, scale, _ = _weights(48, 64, None, 2)
    q, scale = q.cpu(), scale.cpu()
    try:
        got = fp8.scaled_mm_rows(x, q, scale)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._scaled_mm does not run on this CPU: {e}")
    qx, sx = fp8.quantize_groups_reference(x, 64)
    want = dequantize(qx, sx, (1, 64)) @ dequantize(q, scale, (1, 64)).t()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@GPU
@pytest.mark.parametrize("block", [(1, 1024), (128, 128)])
def test_gpu_bf16_paths_equal_the_reference(block: tuple[int, int]) -> None:
    """On the GPU in bf16: the FP8 matmul of a batch of 64 (per-row or block scales, cuBLAS's
    block recipe where torch has it) and the GEMV of two rows, against fp32 products of the
    dequantised weights (activations quantised too where the path does)."""
    x = torch.randn(64, 1024, device="cuda").bfloat16()
    layer = _layer(*_weights(512, 1024, None if block[0] == 1 else block, 4, "cuda"))
    w = dequantize(layer.weight, layer.weight_scale, block)
    group = block[1]  # a batch's activations are quantised as W's columns are grouped
    for rows, quantised in [(x, True), (x[:2], False)]:
        xq = dequantize(*fp8.quantize_groups(rows, group), (1, group)) if quantised else rows
        want = xq.float() @ w.t()
        got = fp8.fp8_projection(rows, layer).float()
        torch.testing.assert_close(got, want, rtol=0.03, atol=0.03 * want.abs().max().item())


def _layer(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> Linear:
    layer = Linear(q.size(1), q.size(0)).to(q.device)
    fp8.set_fp8_weight(layer, q, scale, block)
    return layer


def test_a_deferred_norm_is_done_before_the_matmul_when_rows_are_many() -> None:
    """More rows than the GEMV takes: the norm chapter 20 left to the projection runs first."""
    layer = _layer(*_weights(32, 64, (16, 16), 3, "cpu"))
    x, residual = torch.randn(fp8.GEMV_MAX_ROWS + 3, 64), torch.randn(fp8.GEMV_MAX_ROWS + 3, 64)
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.fill_(1.5)
    out = torch.empty_like(x)
    got = fp8.fp8_projection(NormedInput(x, residual, out, norm.weight, 1e-6), layer)
    want = fp8.reference(norm.reference(x + residual), layer.weight, layer.weight_scale, (16, 16))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(out, x + residual, rtol=0, atol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU test: the timer is injected")
def test_the_start_up_measurement_chooses_the_fp8_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8 projections are measured at start-up as chapter 20's are (engine/kernel_choice.py):
    at 1, 2, 4 and 8 rows, with the norm folded in at one row (where a norm is deferred). The
    table decides: where the GEMV wins only at qkv, only qkv runs in it and the norm before
    gate_up is not deferred; where it loses everywhere, none does. The tokens stay the same."""
    from minisgl.engine.kernel_choice import choose_gemv
    from minisgl.env import ENV
    from minisgl.layers import kernel_plan
    from minisgl.layers.kernel_plan import KernelPlan

    kernels = fp8._kernels()
    llm = LLM(str(need(TINY["llama"])), device="cpu", quantization="fp8", max_running_req=1,
              num_page_override=64, max_seq_len_override=32)  # fmt: skip
    prompts, params = [[5, 17, 300, 41, 8, 99, 23]], SamplingParams(max_tokens=4, ignore_eos=True)
    want = llm.generate(prompts, params, use_tqdm=False)[0]["token_ids"]  # first-guess blocks
    calls: list[tuple[int, bool, bool]] = []  # (out rows, gated, normed) of each FP8 GEMV
    real = kernels.fp8_gemv

    def counted(x, weight, scale, block, bias=None, gated=False, norm=None, blocks=None):
        calls.append((weight.size(0), gated, norm is not None))
        return real(x, weight, scale, block, bias, gated=gated, norm=norm, blocks=blocks)

    monkeypatch.setattr(kernels, "fp8_gemv", counted)
    # chapter 20's GEMV gate, open for one row on the CPU: norms may be deferred
    monkeypatch.setattr(kernel_plan, "gemv_kernel", lambda fused: real)
    monkeypatch.setattr(ENV.GEMV, "value", "auto")
    monkeypatch.setattr(ENV.GEMV_MAX_ROWS, "value", 1)
    e = llm.engine
    timed: list[str] = []

    def timer_where(wins):
        def timer(what: str, run) -> float:
            timed.append(what)
            return (0.5 if wins(what) else 2.0) if "fp8 gemv" in what.split(": ")[-1] else 1.0

        return timer

    for name, wins in {"matmul": lambda w: False, "qkv only": lambda w: "qkv_proj" in w}.items():
        kernels = KernelPlan.at_start(e.device, e.dtype, e.attn_backend)
        table = choose_gemv(e, kernels, timer_where(wins))  # and installed
        assert table is not None
        calls.clear()
        got = llm.generate(prompts, params, use_tqdm=False)[0]["token_ids"]
        assert got == want, name
        qkv_rows = llm.engine.model.model.layers[0].self_attn.qkv_proj.weight.size(0)
        if name == "matmul":
            assert not calls
        else:  # qkv in the GEMV with its norm folded (layers 1..), gate_up's norm not deferred
            assert calls and all(rows == qkv_rows and not gated for rows, gated, _ in calls)
            assert any(normed for *_, normed in calls)
    fp8_keys = {(key, m) for key, m in table.blocks if m > 1}
    assert fp8_keys and all(not key.normed for key, _ in fp8_keys)  # no norm deferred there
    assert {m for _, m in table.blocks} == set(fp8_choice.gemv_rows()) == {1, 2, 4, 8}
    assert any("gate_up_proj" in t and "gated +norm" in t and "rows 1" in t for t in timed)
    llm.shutdown()


# ---- checkpoints in FP8 ---------------------------------------------------------------

MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """FP8 copies made by tools/make_fp8_model.py, and their dequantised twins: blocks of 16
    (tiny-llama, tiny-qwen3-moe), and of 128 (tiny-qwen2: q's 64 rows and k's 32 share a
    block of 128 rows, and the loader has to split it)."""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for name, block in [("llama", 16), ("qwen3-moe", 16), ("qwen2", 128)]:
        folder = root / name
        done = run_tool("make_fp8_model.py", str(need(TINY[name])), str(folder),
                        "--block-size", str(block))  # fmt: skip
        assert done.returncode == 0, done.stderr
        out[name] = folder
        out[f"{name}-dequantised"] = dequantised_copy(folder, root / f"{name}-dq")
    return out


def dequantised_copy(folder: Path, dst: Path) -> Path:
    """The same model with every FP8 weight times its scales, in fp32 and no FP8 config."""
    shutil.copytree(folder, dst)
    raw = json.loads((dst / "config.json").read_text())
    block = tuple(raw.pop("quantization_config")["weight_block_size"])
    (dst / "config.json").write_text(json.dumps(raw))
    tensors = load_file(dst / "model.safetensors")
    for name in [n for n in tensors if n.endswith("_scale_inv")]:
        weight = name.removesuffix("_scale_inv")
        tensors[weight] = dequantize(tensors[weight], tensors.pop(name), block)
    save_file(tensors, dst / "model.safetensors")
    return dst


def loaded(path: Path) -> torch.nn.Module:
    with torch.device("cpu"):
        model = create_model(ModelConfig.from_path(path))
    load_weights(model, path)
    return model


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, FP8 projections dequantised."""
    out = {n: p.detach().float() for n, p in model.named_parameters()}
    for name, layer in projections(model):
        if fp8.is_fp8(layer):
            out[f"{name}.weight"] = dequantize(layer.weight, layer.weight_scale, layer.fp8_block)
    return out


@pytest.mark.parametrize("name", ["llama", "qwen3-moe", "qwen2"])
def test_block_scaled_folder_loads_as_stored(folders: dict[str, Path], name: str) -> None:
    """Projections stay FP8 (their scales merged with q/k/v and gate/up), the experts are
    dequantised to the model dtype, and every weight equals the checkpoint's, dequantised."""
    model = loaded(folders[name])
    layers = projections(model)
    assert layers and all(fp8.is_fp8(layer) for _, layer in layers)
    want = weights(loaded(folders[f"{name}-dequantised"]))
    got = weights(model)
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    qkv = dict(layers)["model.layers.0.self_attn.qkv_proj"]
    # tiny-qwen2's q (64 rows) and k (32) meet inside a block of 128: blocks of 32 rows here
    assert qkv.fp8_block == ((32, 128) if name == "qwen2" else (16, 16))


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_scales_follow_rows_on_every_rank(folders: dict[str, Path], name: str) -> None:
    """With two tensor-parallel ranks each loads its slice of every FP8 weight and of its
    scales: what it holds, dequantised, is its slice of the dequantised checkpoint (as the
    plain loader of chapter 21 cuts it)."""
    try:
        for rank in range(2):
            set_tp_info(rank, 2)
            want = weights(loaded(folders[f"{name}-dequantised"]))
            got = weights(loaded(folders[name]))
            for key in want:
                assert torch.equal(got[key], want[key]), (rank, key)
    finally:
        set_tp_info(0, 1)


# ---- whole models ---------------------------------------------------------------------


def teacher_forced(path: Path, prepare=None, **kw) -> torch.Tensor:
    """Logits of a prefill and two decode steps (their projections in the FP8 GEMV, run by
    the interpreter), every position; `prepare(model)` first, if given; `kw`: engine
    settings."""
    engine = make_engine(path, **kw)
    if prepare is not None:
        prepare(engine.model)
    try:
        n = len(PROMPT) + len(DECODED)
        req = Req(torch.tensor(PROMPT, dtype=torch.int32), 0, 0, n, 0, SamplingParams())
        engine.page_table[0, :n] = page_slots(list(range(1, n + 1)), 1)
        engine.token_pool[0, : len(PROMPT)] = req.input_ids
        out = [all_logits(engine, [req], "prefill")]
        for token in DECODED:
            engine.token_pool[0, req.device_len] = token
            req.append_host(token)
            out.append(all_logits(engine, [req], "decode"))
        return torch.cat(out)
    finally:
        engine.shutdown()


def per_row(model: torch.nn.Module) -> None:
    quantize_model(model, "fp8")


@pytest.mark.parametrize("name", ["llama", "qwen3-moe"])
def test_block_scaled_model_equals_its_dequantised_reference(folders, name: str) -> None:
    """The FP8 model (GEMV at decode, the dequantising reference at prefill) gives the
    logits of the same weights dequantised; and stays within FP8's distance of the
    original model."""
    got = teacher_forced(folders[name])
    torch.testing.assert_close(got, teacher_forced(folders[f"{name}-dequantised"]),
                               rtol=0, atol=1e-4)  # fmt: skip
    original = teacher_forced(need(TINY[name]))
    assert (got - original).abs().max() <= LOGIT_TOL * original.abs().max()


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3-moe"])
def test_per_row_model_equals_its_dequantised_reference(name: str) -> None:
    """quantize_model: every projection FP8 with one scale per row (the experts, router and
    LM head not); the logits those of the same weights dequantised, and within FP8's
    distance of the original model's."""
    model = loaded(need(TINY[name]))
    per_row(model)
    for _, layer in projections(model):
        assert layer.fp8_block == (1, layer.weight.size(1)) and layer.weight_scale.size(1) == 1
    assert model.lm_head.weight.dtype == torch.float32
    dequantised = weights(model)

    def put_back(model: torch.nn.Module) -> None:
        with torch.no_grad():
            for key, p in model.named_parameters():
                p.copy_(dequantised[key])

    got = teacher_forced(need(TINY[name]), per_row)
    torch.testing.assert_close(got, teacher_forced(need(TINY[name]), put_back), rtol=0, atol=1e-4)
    original = teacher_forced(need(TINY[name]))
    assert (got - original).abs().max() <= LOGIT_TOL * original.abs().max()


def test_smollm2_keeps_its_next_tokens() -> None:
    """Real weights: over a sentence of 36 tokens, teacher-forced in one prefill (the
    dequantising reference on a CPU), per-row FP8 keeps the likeliest next token at TOP1 of
    the positions or more (measured 33 of 36) and the distributions close (KL, measured
    0.024 nats per position). So does an FP8 KV cache, which the prefill reads back (measured:
    34 of 36, KL 0.006)."""
    ids = tokenizer(need(SMOL))(SENTENCE)["input_ids"]

    def prefill(prepare=None, **kw) -> torch.Tensor:
        engine = make_engine(SMOL, **kw)
        if prepare is not None:
            prepare(engine.model)
        req = Req(torch.tensor(ids, dtype=torch.int32), 0, 0, len(ids) + 1, 0, SamplingParams())
        engine.page_table[0, : len(ids) + 1] = page_slots(list(range(1, len(ids) + 2)), 1)
        engine.token_pool[0, : len(ids)] = req.input_ids
        try:
            return all_logits(engine, [req], "prefill")
        finally:
            engine.shutdown()

    original = prefill()
    for got in (prefill(per_row), prefill(kv_cache_dtype="fp8_e4m3")):
        same = (got.argmax(-1) == original.argmax(-1)).float().mean().item()
        kl = F.kl_div(got.log_softmax(-1), original.log_softmax(-1), log_target=True,
                      reduction="batchmean").item()  # fmt: skip
        assert same >= TOP1 and kl < 0.1, (same, kl)


# ---- through the API, and bad input ---------------------------------------------------


def generate(path: Path, quantization: str | None = None) -> tuple[list[list[int]], bool]:
    """(greedy tokens of two prompts, whether every projection ran in FP8) through LLM."""
    llm = LLM(str(path), device="cpu", quantization=quantization, max_running_req=2,
              num_page_override=64, max_seq_len_override=32)  # fmt: skip
    try:
        in_fp8 = all(fp8.is_fp8(layer) for _, layer in projections(llm.engine.model))
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        out = llm.generate([[5, 17, 300, 41, 8], [7, 7, 120]], params, use_tqdm=False)
        return [o["token_ids"] for o in out], in_fp8
    finally:
        llm.shutdown()


def test_llm_loads_an_fp8_checkpoint_without_a_flag(folders: dict[str, Path]) -> None:
    """An FP8 folder runs in FP8 with no flag, and generates what its dequantised twin does."""
    tokens, in_fp8 = generate(folders["llama"])
    assert in_fp8 and (tokens, False) == generate(folders["llama-dequantised"])


def test_llm_quantises_on_load_by_flag() -> None:
    tokens, in_fp8 = generate(need(TINY["llama"]), "fp8")
    assert in_fp8 and [len(t) for t in tokens] == [4, 4]


def _folder_with(tmp_path: Path, quantization_config: dict) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(need(TINY["llama"]), folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"quant_method": "gptq"}, "quantised with 'gptq'"),
        ({"fmt": "e5m2"}, "e5m2"),
        ({"activation_scheme": "static"}, "static"),
        ({"weight_block_size": None}, "without weight_block_size"),
        ({"weight_block_size": [128]}, "two positive integers"),
    ],
)
def test_checkpoints_we_cannot_load_are_named(tmp_path: Path, change: dict, message: str) -> None:
    folder = _folder_with(tmp_path, {**FP8_CONFIG, **change})
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_path(folder)
    with pytest.raises(ValueError, match=message):  # before any process starts
        check_model_files(EngineConfig(str(folder), quantization="fp8"))


def test_bad_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="'int3' is not supported"):
        EngineConfig(str(need(TINY["llama"])), quantization="int3")
    with pytest.raises(SystemExit):
        parse_args(["--model", str(need(TINY["llama"])), "--quantization", "int3"])
    args = parse_args(["--model", str(need(TINY["llama"])), "--quantization", "fp8"])
    assert args.scheduler.quantization == "fp8"


def test_missing_or_wrong_scales_are_named(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "fp8"
    shutil.copytree(folders["llama"], folder)
    tensors = load_file(folder / "model.safetensors")
    key = "model.layers.1.self_attn.k_proj.weight_scale_inv"
    save_file({n: t for n, t in tensors.items() if n != key}, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"qkv_proj.*part 1.*without a weight_scale_inv"):
        loaded(folder)
    save_file({**tensors, key: tensors[key][:1]}, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"qkv_proj.*does not cover"):
        loaded(folder)


def test_agreement_tool_reports(folders: dict[str, Path]) -> None:
    """tools/bench_fp8.py agreement: greedy text with and without FP8, compared."""
    done = run_tool("bench_fp8.py", "agreement", "--model", str(need(TINY["llama"])),
                    "--fp8-model", str(folders["llama"]), "--device", "cpu",
                    "--prompts", "2", "--max-tokens", "4")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "prompts identical to the end" in done.stdout and "tokens equal" in done.stdout


# ---- an FP8 KV cache --------------------------------------------------------------------

KV_TOL = 0.05  # tiny models: max |logit with FP8 K/V - logit| <= this x the largest |logit|


def test_attention_kernels_read_an_fp8_cache_as_its_values() -> None:
    """Decode and extend over e4m3 keys and values equal the same kernels over those values
    widened to q's dtype: the cache's only error is the rounding when it is written."""
    from minisgl.kernels.decode_attention import decode_attention
    from minisgl.kernels.extend_attention import extend_attention

    gen = torch.Generator().manual_seed(3)
    slots, kv_heads, q_heads, d = 96, 2, 4, 32
    k8, v8 = ((torch.randn(slots, kv_heads, d, generator=gen) * 3).to(FP8) for _ in range(2))
    table = torch.randperm(slots, generator=gen).view(2, 48).int()
    rows, lens = torch.tensor([1, 0], dtype=torch.int32), torch.tensor([37, 5], dtype=torch.int32)
    q = torch.randn(2, q_heads, d, generator=gen)
    dev = [t.to(DEV) for t in (q, k8, v8, table, rows, lens)]
    wide = [dev[0], dev[1].float(), dev[2].float(), *dev[3:]]
    torch.testing.assert_close(decode_attention(*dev, d**-0.5), decode_attention(*wide, d**-0.5),
                               rtol=0, atol=1e-6)  # fmt: skip
    q = torch.randn(9, q_heads, d, generator=gen).to(DEV)  # 4 new tokens of row 1, 5 of row 0
    qo = torch.tensor([0, 4, 9], dtype=torch.int32, device=DEV)
    got = extend_attention(q, *dev[1:], qo, 5, d**-0.5)
    want = extend_attention(q, *wide[1:], qo, 5, d**-0.5)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_rope_store_writes_an_fp8_cache_as_torch_casts() -> None:
    """The fused kernel's K/V store into an e4m3 cache: saturated at 448 and rounded to the
    nearest value, bit for bit what torch's cast of the unfused result stores."""
    from minisgl.kernels.rope_store import qk_rope_store
    from minisgl.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(4)
    hq, hkv, d, tokens = 4, 2, 16, 5
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen) * 300  # some beyond 448
    positions = torch.randint(0, 100, (tokens,), generator=gen).int()
    out_loc = torch.tensor([3, 9, 0, 12, 7], dtype=torch.int32)
    rope = RotaryEmbedding(d, 10000.0, 128, DEV)
    k8, v8 = (torch.zeros(16, hkv, d, dtype=FP8, device=DEV) for _ in range(2))
    qk_rope_store(qkv.to(DEV), positions.to(DEV), rope.cos_sin, None, None, 1e-6, k8, v8,
                  out_loc.to(DEV), hq, hkv, d)  # fmt: skip
    _, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    _, k = rope.reference(positions.long().to(DEV), k.reshape(tokens, hkv, d).to(DEV),
                          k.reshape(tokens, hkv, d).to(DEV))  # fmt: skip
    v = v.reshape(tokens, hkv, d).to(DEV)
    assert v.abs().max() > FP8_MAX
    for got, want in [(k8, k), (v8, v)]:
        assert torch.equal(got[out_loc.long()].view(torch.uint8), want.to(FP8).view(torch.uint8))


def kv_logits(name: str, **kw) -> torch.Tensor:
    """Teacher-forced logits of a tiny model with the engine settings `kw`."""
    return teacher_forced(need(TINY[name]), **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU test (fp32, both backends)")
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_fp8_kv_cache_keeps_the_logits_close(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole model with `kv_cache_dtype="fp8_e4m3"`: the pool holds e4m3 (four times the
    pages of an fp32 one in the same bytes), the Triton kernels and the torch backend agree on
    it, and the logits stay within KV_TOL of the unquantised cache's."""
    from minisgl.env import ENV

    monkeypatch.setattr(ENV.CPU_KV_CACHE_MB, "value", 1)  # pages from the budget, not the cap
    engine = make_engine(need(TINY[name]), kv_cache_dtype="fp8", num_page_override=None)
    pages_fp8 = engine.num_pages
    assert engine.kv_cache.dtype == FP8 and engine.config.kv_cache_dtype == "fp8_e4m3"
    engine.shutdown()
    engine = make_engine(need(TINY[name]), num_page_override=None)
    assert pages_fp8 == 4 * engine.num_pages  # fp32 here: 4 bytes a value against 1
    engine.shutdown()
    monkeypatch.undo()
    original = kv_logits(name)
    torch_fp8 = kv_logits(name, kv_cache_dtype="fp8_e4m3", attention_backend="torch")
    triton_fp8 = kv_logits(name, kv_cache_dtype="fp8_e4m3", attention_backend="triton")
    torch.testing.assert_close(triton_fp8, torch_fp8, rtol=0, atol=1e-4)
    assert not torch.equal(torch_fp8, original)  # the cache really is FP8
    assert (torch_fp8 - original).abs().max() <= KV_TOL * original.abs().max()


def test_kv_cache_dtype_is_checked() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype 'int4' is not supported"):
        EngineConfig(str(need(TINY["llama"])), kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="'fi' does not read an FP8 KV cache"):
        EngineConfig(str(need(TINY["llama"])), kv_cache_dtype="fp8", attention_backend="fi")
    args = parse_args(["--model", str(need(TINY["llama"])), "--kv-cache-dtype", "fp8"])
    assert args.scheduler.kv_cache_dtype == "fp8_e4m3"
