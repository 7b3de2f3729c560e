"""Our GEMV kernel (kernels/gemv.py) equals the matmul it replaces, alone and in a model.

On CPU it runs in Triton's interpreter (tests/conftest.py turns it on without a GPU), in
fp32; on a GPU in bf16 too.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY, need

from minisgl.core import SamplingParams
from minisgl.env import ENV
from minisgl.kernels.gemv import MAX_ROWS, gemv, gemv_candidates
from minisgl.layers.activation import silu_and_mul_reference
from minisgl.layers.norm import RMSNorm
from minisgl.llm import LLM
from minisgl.models.config import ModelConfig

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or Triton's interpreter",
)
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32] + ([torch.bfloat16] if DEV.type == "cuda" else [])
# (rows of x, out features, in features): blocks that divide and blocks that do not
SHAPES = [(1, 64, 32), (1, 37, 70), (2, 96, 1030), (3, 17, 5), (MAX_ROWS, 130, 2100)]


def _tol(dtype: torch.dtype) -> dict:
    return dict(rtol=0, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.02, atol=0.02)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_gemv_equals_linear(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).to(DEV, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEV, dtype)
    b = torch.randn(n, generator=gen).to(DEV, dtype)
    torch.testing.assert_close(gemv(x, w), F.linear(x, w), **_tol(dtype))
    torch.testing.assert_close(gemv(x, w, b), F.linear(x, w, b), **_tol(dtype))
    # every block shape computes the same product, the ones the start-up measurement tries too
    for blocks in [(MAX_ROWS, 1, 64, 1), (MAX_ROWS, 8, 64, 4), *gemv_candidates(m, n, k)]:
        torch.testing.assert_close(gemv(x, w, blocks=blocks), F.linear(x, w), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_gated_gemv_equals_gate_up_then_silu_and_mul(
    m: int, n: int, k: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(7 * n + k)
    x = torch.randn(m, k, generator=gen).to(DEV, dtype)
    gate_up = (torch.randn(2 * n, k, generator=gen) / k**0.5).to(DEV, dtype)
    want = silu_and_mul_reference(F.linear(x, gate_up))
    got = gemv(x, gate_up, gated=True)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, want, **_tol(dtype))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_gemv_with_the_norm_equals_add_norm_then_the_projection(
    m: int, n: int, k: int, dtype: torch.dtype, gated: bool
) -> None:
    """norm=...: RMSNorm(x + residual) is the input, and x + residual goes to residual_out."""
    gen = torch.Generator().manual_seed(3 * n + k + gated)
    x, residual = (torch.randn(m, k, generator=gen).to(DEV, dtype) for _ in range(2))
    w = (torch.randn(2 * n if gated else n, k, generator=gen) / k**0.5).to(DEV, dtype)
    norm = RMSNorm(k, 1e-6).to(DEV, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(k, generator=gen) + 0.5)
    want_sum = x + residual
    want = F.linear(norm.reference(want_sum), w)
    want = silu_and_mul_reference(want) if gated else want
    out = torch.full_like(residual, float("nan"))
    got = gemv(x, w, gated=gated, norm=(residual, out, norm.weight, norm.eps))
    torch.testing.assert_close(got, want, **_tol(dtype))
    torch.testing.assert_close(out, want_sum, rtol=0, atol=0)


def test_gemv_refuses_what_it_cannot_take() -> None:
    w = torch.randn(8, 16, device=DEV)
    with pytest.raises(AssertionError):
        gemv(torch.randn(MAX_ROWS + 1, 16, device=DEV), w)  # too many rows
    with pytest.raises(AssertionError):
        gemv(torch.randn(1, 16, device=DEV), w.t().contiguous().t())  # W not row-major


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU test: the GPU has tests/test_gpu.py")
def test_llm_with_the_gemv_kernel_gives_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the whole model, with the kernel forced on (MINISGL_GEMV=on) and allowed for
    CPU tensors of one row: every
    decode step's projections run in it, gate_up with SiLU-and-mul, and the norms before
    qkv and gate_up inside the projections' kernels (not the LM head: its 49k rows would take
    the interpreter minutes a step; tests/test_gpu.py runs it on the GPU)."""
    from minisgl.layers import kernel_plan

    calls = {"plain": 0, "gated": 0, "normed": 0}
    head = {"rows": 0}  # the LM head's rows (the vocabulary) of the model being run

    def counted(x, weight, bias=None, blocks=None, gated=False, norm=None):
        if weight.size(0) == head["rows"]:  # the LM head: left to the matmul library
            return F.linear(x, weight, bias)
        calls["gated" if gated else "plain"] += 1
        calls["normed"] += norm is not None
        return gemv(x, weight, bias, blocks=blocks, gated=gated, norm=norm)

    prompts = [[5, 17, 300, 41, 8, 99, 23], [7, 7, 120]]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    out = []
    for name in ("llama", "qwen2"):  # qwen2: a bias on qkv
        head["rows"] = ModelConfig.from_path(need(TINY[name])).vocab_size
        for on in (False, True):
            if on:
                monkeypatch.setattr(kernel_plan, "gemv_kernel", lambda fused: counted)
                monkeypatch.setattr(ENV.GEMV, "value", "on")
                monkeypatch.setattr(ENV.GEMV_MAX_ROWS, "value", 1)
            llm = LLM(str(need(TINY[name])), device="cpu", max_running_req=1,
                      num_page_override=64, max_seq_len_override=32)  # fmt: skip
            out.append([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)])
            llm.shutdown()
            monkeypatch.undo()
    assert out[0] == out[1] and out[2] == out[3]
    assert calls["plain"] > 0 and calls["gated"] > 0 and calls["normed"] > 0
