"""The tensor cores' GEMV (kernels/gemv_mma.py) equals the matmul it replaces, alone and in
a verify step of eight drafts.

On CPU it runs in Triton's interpreter (tests/conftest.py turns it on without a GPU), in
fp32 (the product in full precision); on a GPU in bf16 too.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY, need

from minisgl.core import SamplingParams
from minisgl.env import ENV
from minisgl.kernels.gemv import (
    FMA_ROWS,
    FMA_TRIED,
    MAX_ROWS,
    gemv,
    gemv_blocks,
    gemv_candidates,
)
from minisgl.kernels.gemv_mma import MMA_ROWS, MmaBlocks, mma_candidates
from minisgl.layers.activation import silu_and_mul_reference
from minisgl.layers.norm import RMSNorm
from minisgl.llm import LLM
from minisgl.models.config import ModelConfig
from minisgl.speculative.ngram import NgramDrafter

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or Triton's interpreter",
)
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32] + ([torch.bfloat16] if DEV.type == "cuda" else [])
# (rows of x, out features, in features): blocks that divide and blocks that do not
SHAPES = [(2, 64, 64), (3, 37, 70), (9, 96, 1030), (MMA_ROWS, 130, 200)]
BLOCKS = [MmaBlocks(16, 16, 1, 1), MmaBlocks(32, 64, 2, 2)]


def _tol(dtype: torch.dtype) -> dict:
    return dict(rtol=0, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.02, atol=0.02)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_mma_gemv_equals_linear(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).to(DEV, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEV, dtype)
    b = torch.randn(n, generator=gen).to(DEV, dtype)
    for blocks in [*BLOCKS, *mma_candidates(n, k)]:
        torch.testing.assert_close(gemv(x, w, blocks=blocks), F.linear(x, w), **_tol(dtype))
        torch.testing.assert_close(gemv(x, w, b, blocks=blocks), F.linear(x, w, b), **_tol(dtype))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_mma_gemv_with_the_norm_equals_add_norm_then_the_projection(
    m: int, n: int, k: int, dtype: torch.dtype, gated: bool
) -> None:
    """RMSNorm(x + residual) in front, SiLU-and-mul behind where gated, and x + residual
    written out, as the CUDA cores' GEMV does."""
    gen = torch.Generator().manual_seed(3 * n + k + gated)
    x, residual = (torch.randn(m, k, generator=gen).to(DEV, dtype) for _ in range(2))
    w = (torch.randn(2 * n if gated else n, k, generator=gen) / k**0.5).to(DEV, dtype)
    norm = RMSNorm(k, 1e-6).to(DEV, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(k, generator=gen) + 0.5)
    want = F.linear(norm.reference(x + residual), w)
    want = silu_and_mul_reference(want) if gated else want
    for blocks in [BLOCKS[1], *mma_candidates(n, k, gated)]:
        out = torch.full_like(residual, float("nan"))
        got = gemv(x, w, blocks=blocks, gated=gated, norm=(residual, out, norm.weight, norm.eps))
        torch.testing.assert_close(got, want, **_tol(dtype))
        torch.testing.assert_close(out, x + residual, rtol=0, atol=0)


def test_the_tensor_cores_take_the_rows_the_cuda_cores_cannot() -> None:
    """One row: the CUDA cores only. Two to FMA_TRIED: both are tried (the CUDA cores in
    their default blocks). Past that: the tensor cores only, and past FMA_ROWS by default
    too. Past MMA_ROWS: neither (the library)."""
    assert MAX_ROWS == MMA_ROWS and FMA_TRIED <= FMA_ROWS < MMA_ROWS
    n, k = 4096, 1024
    assert not any(isinstance(b, MmaBlocks) for b in gemv_candidates(1, n, k))
    for m in range(2, FMA_TRIED + 1):
        found = gemv_candidates(m, n, k)
        assert found[0] == gemv_blocks(m, n, k) and not isinstance(found[0], MmaBlocks)
        assert all(isinstance(b, MmaBlocks) for b in found[1:]) and len(found) > 1
    for m in (FMA_TRIED + 1, FMA_ROWS, MMA_ROWS):
        assert all(isinstance(b, MmaBlocks) for b in gemv_candidates(m, n, k, gated=True))
    for m in (FMA_ROWS + 1, MMA_ROWS):
        assert isinstance(gemv_blocks(m, n, k), MmaBlocks)
    for n, k, gated in [(576, 576, False), (1536, 576, True), (151936, 4096, False)]:
        for b in mma_candidates(n, k, gated):  # the tiles fit the shapes they are tried on
            assert b.block_n >= 16 and b.block_k <= max(64, 2 * k) and b.warps in (1, 2, 4, 8)
    with pytest.raises(AssertionError):
        gemv(torch.randn(MMA_ROWS + 1, 16, device=DEV), torch.randn(8, 16, device=DEV))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU test: the GPU has tests/test_gpu.py")
def test_a_verify_of_eight_drafts_in_the_tensor_cores_keeps_the_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A verify step of one request and its eight drafts is nine rows: with the GEMV forced
    on up to 16 rows, its projections (the norms folded in, gate_up with SiLU-and-mul) run on
    the tensor cores, and the tokens equal plain decoding's."""
    from minisgl.layers import kernel_plan

    vocab = ModelConfig.from_path(need(TINY["llama"])).vocab_size
    rows: list[tuple[int, bool, bool]] = []

    def counted(x, weight, bias=None, blocks=None, gated=False, norm=None):
        if weight.size(0) == vocab:  # the LM head: left to the library (the interpreter is slow)
            return F.linear(x, weight, bias)
        if isinstance(blocks, MmaBlocks):
            rows.append((x.size(0), gated, norm is not None))
        return gemv(x, weight, bias, blocks=blocks, gated=gated, norm=norm)

    def eight_drafts(self, reqs, ks, pending=None):  # right or wrong, always eight
        return [[(7 * i + 3) % 50 for i in range(8)] if k else [] for k in ks]

    prompts = [[5, 17, 300, 41, 8, 99, 23]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    kw = dict(device="cpu", dtype=torch.float32, max_running_req=1, num_page_override=64,
              max_seq_len_override=48, speculative_always=True, num_draft_tokens=8)  # fmt: skip
    out = []
    for on in (False, True):
        if on:
            monkeypatch.setattr(kernel_plan, "gemv_kernel", lambda fused: counted)
            monkeypatch.setattr(ENV.GEMV, "value", "on")
            monkeypatch.setattr(ENV.GEMV_MAX_ROWS, "value", MMA_ROWS)
            monkeypatch.setattr(NgramDrafter, "propose", eight_drafts)
            kw["speculative"] = "ngram"
        llm = LLM(str(need(TINY["llama"])), **kw)
        out.append([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.scheduler.check_integrity()
        llm.shutdown()
        monkeypatch.undo()
    assert out[0] == out[1]
    nine = {(gated, normed) for m, gated, normed in rows if m == 9}
    assert {(False, True), (True, True), (False, False)} <= nine, rows


def test_the_sweep_tries_tiles_that_fit_and_the_tensor_cores_alone_past_the_cuda_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """tools/bench_gemv.py --sweep: from two rows up the tensor cores' tiles, each within
    160 KB of shared memory over its pipeline's stages; past FMA_ROWS rows only those."""
    from pathlib import Path

    from minisgl.layers.triton_ops import GemvKey

    tools = Path(__file__).resolve().parent.parent / "tools"
    if not (tools / "bench_gemv.py").exists():  # a chapter's tree, which has no such tool
        pytest.skip("tools/bench_gemv.py is not in this tree")
    monkeypatch.syspath_prepend(str(tools))
    from bench_gemv import sweep_blocks

    for gated in (False, True):
        key = GemvKey(3072, 1024, gated, True, False)
        assert not any(isinstance(b, MmaBlocks) for b in sweep_blocks(1, key))
        both = sweep_blocks(4, key)
        assert any(isinstance(b, MmaBlocks) for b in both)
        assert any(not isinstance(b, MmaBlocks) for b in both)
        alone = sweep_blocks(FMA_ROWS + 1, key)
        assert alone and all(isinstance(b, MmaBlocks) for b in alone)
        for b in alone:
            assert (b.block_n * (1 + gated) + 16) * b.block_k * 2 * b.stages <= 160 * 1024
        assert set(mma_candidates(3072, 1024, gated)) <= set(alone)  # the candidates came from it
