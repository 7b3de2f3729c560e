"""Our RMSNorm, add + RMSNorm and SiLU-and-mul kernels (kernels/elementwise.py) equal the
layers' torch references, and the layers use them unless FlashInfer is the attention backend.

On CPU they run in Triton's interpreter (tests/conftest.py turns it on without a GPU). Its
casts from fp32 to bf16 truncate where a GPU rounds to nearest, so on CPU bf16 results are
held to a few units in the last place; fp16 casts round as on a GPU, and there the kernels
must match the references' rounding step by step (one unit at most, for a sum taken in
another order). `assert_ulps` and `ours_only` live in helpers.py: later chapters' kernel
tests hold their kernels to the same tolerance.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from helpers import DEV, DTYPES, TINY, assert_ulps, need, ours_only

from minisgl.core import SamplingParams
from minisgl.env import ENV
from minisgl.kernels import elementwise
from minisgl.kernels.elementwise import fused_add_rmsnorm, rmsnorm, silu_and_mul
from minisgl.layers import activation, kernel_plan
from minisgl.layers import elementwise_ops as ops
from minisgl.layers.activation import silu_and_mul_reference
from minisgl.layers.kernel_plan import KernelPlan
from minisgl.layers.norm import RMSNorm
from minisgl.llm import LLM

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or Triton's interpreter",
)


def _norm(n: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(n, 1e-6).to(DEV)
    gen = torch.Generator().manual_seed(seed)
    norm.weight.data = (1 + 0.5 * torch.randn(n, generator=gen)).to(DEV, dtype)
    return norm


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (2 * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(DEV, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n"), [(1, 64), (3, 70), (5, 1031)])
def test_rmsnorm_and_add_rmsnorm_equal_the_reference(rows: int, n: int, dtype: torch.dtype):
    norm = _norm(n, dtype, n)
    x, r = _randn(rows, n, dtype=dtype, seed=1), _randn(rows, n, dtype=dtype, seed=2)
    assert_ulps(rmsnorm(x, norm.weight.data, norm.eps), norm.reference(x))
    # in place, rows read from wider buffers (strided), as FlashInfer's
    xs, rs = _randn(rows, n + 9, dtype=dtype, seed=3), _randn(rows, n + 5, dtype=dtype, seed=4)
    xs[:, :n], rs[:, :n] = x, r
    fused_add_rmsnorm(xs[:, :n], rs[:, :n], norm.weight.data, norm.eps)
    assert_ulps(rs[:, :n], x + r)
    assert_ulps(xs[:, :n], norm.reference(rs[:, :n]))  # the norm of the sum it wrote
    assert (xs[:, n:] == _randn(rows, n + 9, dtype=dtype, seed=3)[:, n:]).all()  # untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_of_heads_read_where_they_lie_in_qkv(dtype: torch.dtype) -> None:
    """q and k norms of Qwen3 take [tokens, heads, head_dim] views of the wider qkv."""
    tokens, hq, hkv, d = 3, 4, 2, 24
    qkv = _randn(tokens, (hq + 2 * hkv) * d, dtype=dtype, seed=5)
    q = qkv[:, : hq * d].reshape(tokens, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].reshape(tokens, hkv, d)
    assert q.stride(0) != hq * d  # the views really are strided
    norm = _norm(d, dtype, 6)
    for heads in (q, k):
        got = rmsnorm(heads, norm.weight.data, norm.eps)
        assert_ulps(got, norm.reference(heads))
    assert_ulps(
        rmsnorm(q.transpose(0, 1), norm.weight.data, 1e-6), norm.reference(q.transpose(0, 1))
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n"), [(1, 37), (3, 1500), (2, 2 * elementwise.SILU_BLOCK)])
def test_silu_and_mul_equals_the_reference(rows: int, n: int, dtype: torch.dtype) -> None:
    gate_up = _randn(rows, 2 * n, dtype=dtype, seed=n)
    assert_ulps(silu_and_mul(gate_up), silu_and_mul_reference(gate_up))
    wide = _randn(rows, 2 * n + 3, dtype=dtype, seed=7)  # rows of a wider buffer
    assert_ulps(silu_and_mul(wide[:, : 2 * n]), silu_and_mul_reference(wide[:, : 2 * n]))
    batched = gate_up.reshape(1, rows, 2 * n)  # leading dimensions stay
    assert_ulps(silu_and_mul(batched), silu_and_mul_reference(batched))


def test_bad_input_is_refused_with_a_reason() -> None:
    x = torch.zeros(2, 8, device=DEV)
    with pytest.raises(ValueError, match="even width"):
        silu_and_mul(torch.zeros(2, 7, device=DEV))
    with pytest.raises(ValueError, match="does not fit"):
        rmsnorm(x, torch.ones(6, device=DEV), 1e-6)
    with pytest.raises(ValueError, match="one 2-D shape"):
        fused_add_rmsnorm(x, torch.zeros(2, 6, device=DEV), torch.ones(8, device=DEV), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        fused_add_rmsnorm(x.t(), x.t(), torch.ones(2, device=DEV), 1e-6)


def test_ours_unless_flashinfer_attends() -> None:
    for name in ("triton", "fa", "torch"):
        assert ops.elementwise_ops(True, name) is elementwise, name
    assert ops.elementwise_ops(True, "fi") is None  # FlashInfer's own, JIT paid anyway
    assert ops.elementwise_ops(False, "triton") is None  # CPU, fp32 or MINISGL_FUSED_KERNELS=0


def test_the_plan_reads_the_knob_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """MINISGL_FUSED_KERNELS=0: no fused kernel in the plan, whatever the device; the CPU
    never has them."""
    backend = SimpleNamespace(name="triton")
    assert not KernelPlan.at_start(torch.device("cpu"), torch.bfloat16, backend).fused
    monkeypatch.setattr(ENV.FUSED_KERNELS, "value", False)
    plan = KernelPlan.at_start(torch.device("cuda"), torch.bfloat16, backend)
    assert not plan.fused and plan.elementwise is None and plan.gemv is None
    assert plan.flashinfer is None and plan.rope_store is None


def test_layers_run_our_kernels_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """RMSNorm.forward_add hands back the tensors it overwrote, equal to the reference."""
    monkeypatch.setattr(activation, "_silu_and_mul", activation._silu_and_mul)  # restored after
    norm, calls = _norm(40, torch.float16, 8), []
    monkeypatch.setattr(
        elementwise, "fused_add_rmsnorm", lambda *a: calls.append(1) or fused_add_rmsnorm(*a)
    )
    ours_only(torch.float16).install(norm)
    x, r = _randn(3, 40, dtype=torch.float16, seed=9), _randn(3, 40, dtype=torch.float16, seed=10)
    want = norm.reference(x + r), x + r
    got = norm.forward_add(x.clone(), r.clone())
    assert calls == [1]
    assert_ulps(got[0], want[0])
    assert_ulps(got[1], want[1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU test: the GPU has tests/test_gpu.py")
def test_llm_with_our_kernels_gives_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the whole model (fp32 on CPU): the kernels forced on give the same tokens."""
    prompts = [[5, 17, 300, 41, 8, 99, 23], [7, 7, 120]]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    out, calls = [], []
    for ours in (False, True):
        if ours:
            monkeypatch.setattr(
                kernel_plan, "elementwise_ops", lambda *a: calls.append(1) or elementwise
            )
        llm = LLM(str(need(TINY["qwen3"])), device="cpu", max_running_req=2, cuda_graph_max_bs=0,
                  num_page_override=64, max_seq_len_override=32)  # fmt: skip
        out.append([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.shutdown()
    assert calls and out[0] == out[1]
    activation.use_silu_and_mul(activation.silu_and_mul_reference)  # as a CPU engine has it
