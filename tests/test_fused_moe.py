"""Chapter 22: the fused Triton MoE equals the loop over experts, on the CPU (Triton interpreter).

The grouping is checked on its own (every pair once, every block one expert, nothing read
back to the host), then the fused experts against the reference loop on random tiny shapes,
then a whole Qwen3-MoE engine: the same greedy tokens with the fused path as without.
Where there is a GPU the same tests run the compiled kernel there instead.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import TINY, need

from minisgl.core import SamplingParams
from minisgl.layers.fused_moe import use_fused_moe
from minisgl.layers.moe import Experts
from minisgl.llm import LLM
from minisgl.models.qwen3_moe import Qwen3MoeForCausalLM

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":  # Triton reads this when it is imported, and interprets from then on
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")


def route(tokens: int, num_experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct experts per token, never expert 0 (so one expert always receives no tokens)."""
    scores = torch.rand(tokens, num_experts, generator=gen)
    scores[:, 0] = -1.0
    return scores.topk(top_k, dim=-1).indices


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_grouping_puts_each_pair_once_in_its_experts_blocks(block_m: int) -> None:
    from minisgl.kernels.moe import group_by_expert, max_blocks

    gen = torch.Generator().manual_seed(block_m)
    num_experts, top_k = 8, 2
    ids = route(13, num_experts, top_k, gen)
    num_pairs = ids.numel()
    groups = group_by_expert(ids, num_experts, block_m)

    n_blocks = max_blocks(num_pairs, num_experts, block_m)
    assert groups.pair_of_row.shape == (n_blocks * block_m,)
    rows = groups.pair_of_row.view(n_blocks, block_m)
    real = rows[rows < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair exactly once
    counts = torch.bincount(ids.flatten(), minlength=num_experts)
    used = int((counts > 0).sum())
    for b, expert in enumerate(groups.block_expert.tolist()):
        pairs = [p for p in rows[b].tolist() if p < num_pairs]
        if expert == num_experts:  # past the end: an idle block
            assert not pairs, f"block {b} is idle but holds pairs {pairs}"
            continue
        assert pairs, f"block {b} of expert {expert} holds no pairs"
        assert all(ids.flatten()[p] == expert for p in pairs)
        assert pairs == sorted(pairs)  # stable: a token's order is kept within an expert
    # An expert with tokens gets just enough blocks; one with none gets no block.
    blocks = torch.bincount(groups.block_expert, minlength=num_experts + 1)[:num_experts]
    assert blocks.tolist() == ((counts + block_m - 1) // block_m).tolist()
    assert counts[0] == 0 and blocks[0] == 0 and used < num_experts


def test_grouping_never_reads_the_device() -> None:
    # Meta tensors have shapes but no values: any .item(), .tolist() or value-sized output
    # (bincount, nonzero, repeat_interleave) raises, as it would break CUDA-graph capture.
    from minisgl.kernels.moe import group_by_expert, max_blocks

    ids = torch.zeros(64, 8, dtype=torch.long, device="meta")
    groups = group_by_expert(ids, 128, 16)
    assert groups.pair_of_row.shape == (max_blocks(512, 128, 16) * 16,)
    assert groups.block_expert.shape == (max_blocks(512, 128, 16),)
    with pytest.raises((RuntimeError, NotImplementedError)):
        torch.bincount(ids.flatten()).tolist()  # the reference's way does read the device


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("num_experts", [4, 8])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_fused_equals_reference(tokens: int, num_experts: int, top_k: int) -> None:
    gen = torch.Generator().manual_seed(tokens * 100 + num_experts * 10 + top_k)
    hidden, inter = 32, 24  # not powers of two: the kernel's edge masks are exercised
    experts = Experts(num_experts, hidden, inter).to(DEVICE)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=gen) / 4)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen) / 4)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    ids = route(tokens, num_experts, top_k, gen).to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=gen).to(DEVICE)

    with torch.no_grad():
        assert use_fused_moe(x)
        fused = experts(x, ids, weights)
        reference = experts.forward_reference(x, ids, weights)
    assert fused.shape == reference.shape == (tokens, hidden)
    torch.testing.assert_close(fused, reference, rtol=1e-4, atol=1e-4)
    assert reference.abs().max() > 0.1  # the comparison is not between two near-zero tensors


def test_cpu_runs_the_kernel_only_in_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_fused_moe(torch.zeros(1, 4))
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not use_fused_moe(torch.zeros(1, 4))
    assert Qwen3MoeForCausalLM.cuda_graph_blocker is None  # with triton, CUDA graphs may run


def test_llm_tokens_fused_equal_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    from minisgl.kernels.moe import fused_moe

    calls: list[int] = []

    def counted(*args: torch.Tensor) -> torch.Tensor:
        calls.append(args[0].size(0))
        return fused_moe(*args)

    monkeypatch.setattr("minisgl.kernels.moe.fused_moe", counted)
    prompts = [[5, 17, 300, 41, 9], [7, 7, 1200], list(range(100, 120))]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    outputs = {}
    for path in ("fused", "reference"):
        graphs: dict[
            str, int
        ] = {}  # on CUDA the fused run captures decode graphs; the loop cannot be captured
        if path == "reference":
            monkeypatch.setattr("minisgl.layers.moe.use_fused_moe", lambda x: False)
            graphs["cuda_graph_max_bs"] = 0
        llm = LLM(
            str(need(TINY["qwen3-moe"])),
            dtype=torch.float32,
            device=DEVICE,
            max_running_req=4,
            num_page_override=256,
            max_seq_len_override=64,
            **graphs,
        )
        if path == "fused" and DEVICE == "cuda":
            assert llm.engine.graph_runner.graph_map, "no decode graphs were captured"
        outputs[path] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
        if path == "fused":
            assert calls, "the fused kernel was never called"
            calls.clear()
    assert not calls, "the reference run called the fused kernel"
    assert outputs["fused"] == outputs["reference"]
    assert all(len(t) == 5 for t in outputs["fused"])
