"""Chapter 22: the loop over experts where the start-up measurement saw it beat the fused
kernel, only for batches no graph holds, and the same tokens either way.

The timer is injected (it says which path wins at which token count); the fused kernel runs
in Triton's interpreter on the CPU, as in tests/test_fused_moe.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import TINY, need

from minisgl.core import SamplingParams
from minisgl.layers.fused_moe import MoEChoice, choose_moe_path, loop_won
from minisgl.llm import LLM

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="a CPU test with Triton's interpreter",
)


def test_captured_batches_keep_the_kernel_and_others_take_the_nearest_measurement() -> None:
    choice = MoEChoice(captured=16, fused_wins={64: True, 1024: False})
    assert choice.use_fused(16)  # a graph holds it: the loop cannot be captured
    assert choice.use_fused(100)  # nearest measured: 64
    assert not choice.use_fused(700) and not choice.use_fused(5000)  # nearest: 1024
    assert MoEChoice(captured=0, fused_wins={}).use_fused(4096)  # nothing measured


def test_the_loop_where_it_won_gives_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    import minisgl.layers.moe as moe

    llm = LLM(str(need(TINY["qwen3-moe"])), device="cpu", max_running_req=2,
              num_page_override=128, max_seq_len_override=48,
              cache_type="naive")  # no prefix cache: the second run prefills in full  # fmt: skip
    prompts = [list(range(100, 120)), [5, 17, 300]]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    want = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]  # all fused

    timed: list[str] = []

    def loop_wins_from_16(what: str, run) -> float:
        timed.append(what)
        tokens = int(what.split(", ")[1].split()[0])
        return 1.0 if what.startswith("fused") == (tokens < 16) else 2.0

    choice = choose_moe_path(llm.engine.model, captured=2, max_tokens=64, timer=loop_wins_from_16)
    assert choice is not None and sorted(choice.fused_wins) == [4, 16, 64]  # above 2, up to 64
    assert choice.fused_wins == {4: True, 16: False, 64: False}
    assert timed == [f"{path}, {t} tokens" for t in (4, 16, 64) for path in ("fused", "loop")]
    experts = [m for m in llm.engine.model.modules() if isinstance(m, moe.Experts)]
    assert all(loop_won(e.gate_up_proj, 23) for e in experts)
    assert not loop_won(experts[0].gate_up_proj, 2)

    paths: list[tuple[str, int]] = []
    fused, reference = moe.fused_experts, moe.Experts.forward_reference
    monkeypatch.setattr(
        moe, "fused_experts", lambda x, *a: paths.append(("fused", len(x))) or fused(x, *a)
    )
    monkeypatch.setattr(
        moe.Experts,
        "forward_reference",
        lambda self, x, *a: paths.append(("loop", len(x))) or reference(self, x, *a),
    )
    got = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    assert got == want
    assert ("loop", 23) in paths  # the prefill of both prompts: the loop won there
    assert all(path == "fused" for path, tokens in paths if tokens <= 2)  # decode: the kernel
