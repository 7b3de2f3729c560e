"""Each GEMV asks the L2 cache for the next projection's weights (kernels/prefetch.py).

On the CPU the kernels run in Triton's interpreter, which cannot run the prefetch
instruction: there the tests check which weight each GEMV is given to prefetch, how the
lines are shared among programs, and, compiling the kernels for a Hopper GPU (Triton's own
compiler and ptxas, no GPU needed), that the instruction and the evict-first loads are in
the code only where asked for. On a GPU the products with the prefetch equal those without.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY, need

from minisgl.core import SamplingParams
from minisgl.engine.kernel_choice import choose_gemv
from minisgl.env import ENV
from minisgl.kernels.gemv import gemv
from minisgl.kernels.prefetch import LINE, Prefetch, prefetch_args, share
from minisgl.llm import LLM

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or Triton's interpreter",
)
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU test")


@pytest.mark.parametrize("nbytes", [0, 100, LINE, 5 * LINE + 3, 1 << 20, 3_000_017])
@pytest.mark.parametrize("programs", [1, 7, 64, 4096])
def test_every_line_is_asked_for_by_exactly_one_program(nbytes: int, programs: int) -> None:
    lines, per, chunk = share(nbytes, programs)
    assert lines == nbytes // LINE and chunk & (chunk - 1) == 0 and 1 <= chunk <= 128
    asked: list[int] = []  # the kernel's loop: chunks of `chunk` over each program's `per`
    for pid in range(programs):
        for c in range(0, per, chunk):
            asked += [pid * per + c + i for i in range(chunk) if c + i < per]
    assert sorted(line for line in asked if line < lines) == list(range(lines))


def test_no_prefetch_on_the_cpu_and_none_of_an_empty_share() -> None:
    w, nxt = torch.zeros(64, 32), torch.zeros(128, 64)
    for prefetch in (None, Prefetch(nxt, 4096)):  # the interpreter cannot run it
        args = prefetch_args(prefetch, 16, w)
        assert args["PREFETCH"] is False and args["PF"] is w and args["pf_lines"] == 0


@CPU_ONLY
def test_the_products_are_the_same_with_a_prefetch_given() -> None:
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 70, generator=gen), torch.randn(37, 70, generator=gen)
    nxt = torch.randn(50, 70, generator=gen)
    tensor_cores = []
    if importlib.util.find_spec("minisgl.kernels.gemv_mma"):  # from chapter 26 on
        mma = importlib.import_module("minisgl.kernels.gemv_mma")
        tensor_cores.append(mma.MmaBlocks(16, 64, 2, 1))
    for blocks in (None, *tensor_cores):
        got = gemv(x, w, blocks=blocks, prefetch=Prefetch(nxt, nxt.nbytes))
        torch.testing.assert_close(got, F.linear(x, w), rtol=0, atol=1e-4)


HOPPER = """
import importlib, importlib.util, json, re, sys

sys.path.insert(0, "tools")
import kernel_report as report  # (drops TRITON_INTERPRET before Triton loads)
from minisgl.kernels.gemv import _gemv_kernel

pointers = {n: "*bf16" for n in ("X", "W", "Y", "BIAS", "R", "R_OUT", "NW", "PF")}
pointers |= {"N": "i32", "K": "i32"}
flags = dict(M=1, HAS_BIAS=False, GATED=True, NORM=True, PF_LINE_ELEMS=64, PF_CHUNK=32,
             PREFETCH=sys.argv[1] == "1")
launches = {"gemv": (_gemv_kernel, dict(flags, BLOCK_M=1, BLOCK_N=1, BLOCK_K=1024), 1)}
if importlib.util.find_spec("minisgl.kernels.gemv_mma"):  # the tensor cores', from chapter 26
    mma = dict(flags, BLOCK_N=64, BLOCK_K=64, EVEN_K=True, PRECISION="tf32")
    kernel = importlib.import_module("minisgl.kernels.gemv_mma")._mma_gemv_kernel
    launches["mma"] = (kernel, mma, 4)
code = {}
for name, (kernel, consts, warps) in launches.items():
    built = report.build(kernel, consts, pointers, {"eps"}, num_warps=warps)
    code[name] = sorted(set(re.findall(r"\\b(?:CCTL|LDG)[\\w.]*", report.sass(built))))
print(json.dumps(code))
"""


def _for_hopper(prefetch: bool) -> dict[str, list[str]]:
    """The GEMV kernels built for an H100 (sm_90) by Triton and ptxas, no GPU needed
    (tools/kernel_report.py), in a process of their own (this one runs Triton's interpreter,
    which cannot build): name -> the kinds of global loads and cache controls in its code."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "tools" / "kernel_report.py").exists():  # a chapter's tree, without it
        pytest.skip("tools/kernel_report.py is not in this tree")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", HOPPER, "1" if prefetch else "0"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if done.returncode != 0 and any(w in done.stderr for w in ("ptxas", "GPUTarget", "nvdisasm")):
        pytest.skip(f"Triton cannot build for sm_90 here: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@CPU_ONLY
@pytest.mark.parametrize("prefetch", [False, True])
def test_the_kernels_built_for_a_gpu_prefetch_only_when_asked(prefetch: bool) -> None:
    """In the machine code: the L2 prefetch (CCTL.E.PML2) where asked for and nowhere else;
    and the GEMV's loads of W evict-first (LDG.E.EF) with it. (The tensor cores' kernel
    loads W by asynchronous copies, LDGSTS, whose code carries no such hint either way.)"""
    built = _for_hopper(prefetch)
    for name, ops in built.items():
        assert any(op.startswith("CCTL") and "PML2" in op for op in ops) == prefetch, (name, ops)
        assert any(op.startswith("LDG") for op in ops), (name, ops)
    assert any(op.startswith("LDG.") and ".EF" in op for op in built["gemv"]) == prefetch


@CPU_ONLY
def test_each_gemv_prefetches_the_projection_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a decode step's order, each GEMV is given the next projection's weight, at most
    the plan's bytes of it, whether or not the GEMV runs that one; the LM head's next is the
    first layer's qkv (the next step's first), here left to the library (the interpreter
    would take minutes over its 49,152 rows)."""
    from minisgl.layers import kernel_plan
    from minisgl.layers.kernel_plan import KernelPlan

    llm = LLM(str(need(TINY["llama"])), device="cpu", max_running_req=1,
              num_page_override=64, max_seq_len_override=32)  # fmt: skip
    prompts, params = [[5, 17, 300, 41, 8, 99, 23]], SamplingParams(max_tokens=4, ignore_eos=True)
    want = llm.generate(prompts, params, use_tqdm=False)[0]["token_ids"]  # the library alone
    calls: list[tuple[torch.Tensor, Prefetch | None]] = []

    def counted(x, weight, bias=None, blocks=None, gated=False, norm=None, prefetch=None):
        calls.append((weight, prefetch))
        return gemv(x, weight, bias, blocks=blocks, gated=gated, norm=norm, prefetch=prefetch)

    monkeypatch.setattr(kernel_plan, "gemv_kernel", lambda fused: counted)  # on the CPU too
    monkeypatch.setattr(ENV.GEMV, "value", "auto")
    monkeypatch.setattr(ENV.GEMV_MAX_ROWS, "value", 1)
    monkeypatch.setattr(ENV.GEMV_PREFETCH_MB, "value", 1)
    engine = llm.engine
    kernels = KernelPlan.at_start(engine.device, engine.dtype, engine.attn_backend)
    assert kernels.gemv is not None and kernels.gemv.prefetch_bytes == 1 << 20
    kernels.gemv.prefetch_bytes = 3000  # less than most of the tiny model's weights

    def gemv_wins(what: str, run) -> float:  # but at the LM head (the interpreter is slow)
        return 0.5 if "gemv" in what.split(": ")[-1] and "lm_head" not in what else 1.0

    choose_gemv(engine, kernels, gemv_wins)  # and installed
    calls.clear()
    assert llm.generate(prompts, params, use_tqdm=False)[0]["token_ids"] == want
    model = engine.model.model
    order = [w for layer in model.layers for w in (layer.self_attn.qkv_proj.weight,
             layer.self_attn.o_proj.weight, layer.mlp.gate_up_proj.weight,
             layer.mlp.down_proj.weight)] + [engine.model.lm_head.weight]  # fmt: skip
    assert len(calls) >= 2 * (len(order) - 1)  # two decode steps or more, all but the head
    for weight, prefetch in calls:
        i = next(i for i, w in enumerate(order) if w is weight)
        nxt = order[(i + 1) % len(order)]  # the last layer's down: the head's, whose GEMV
        assert prefetch is not None and prefetch.weight is nxt  # did not win but is next
        assert prefetch.nbytes == min(3000, nxt.nbytes)
    assert calls[0][0] is order[0] and calls[-1][0] is order[-2]
    head = kernels.gemv.prefetch(order[-1])  # where the head runs the GEMV, it asks for
    assert head is not None and head.weight is order[0]  # the next step's first weights

    monkeypatch.setattr(ENV.GEMV_PREFETCH_MB, "value", 0)  # the default: nothing asked for
    kernels = KernelPlan.at_start(engine.device, engine.dtype, engine.attn_backend)
    choose_gemv(engine, kernels, gemv_wins)
    calls.clear()
    assert llm.generate(prompts, params, use_tqdm=False)[0]["token_ids"] == want
    assert calls and all(prefetch is None for _, prefetch in calls)
    monkeypatch.setattr(ENV.GEMV_PREFETCH_MB, "value", -1)
    with pytest.raises(ValueError, match="MINISGL_GEMV_PREFETCH_MB"):
        KernelPlan.at_start(engine.device, engine.dtype, engine.attn_backend)
    llm.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_on_the_gpu_the_products_are_the_same_with_the_prefetch(rows: int) -> None:
    from minisgl.kernels.gemv import gemv_candidates

    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1024, generator=gen).cuda().bfloat16()
    w = (torch.randn(3072, 1024, generator=gen) / 32).cuda().bfloat16()
    nxt = torch.randn(4096, 1024, generator=gen).cuda().bfloat16()
    want = F.linear(x, w)
    for blocks in gemv_candidates(rows, 3072, 1024):
        for nbytes in (LINE, 1 << 20, nxt.nbytes):
            got = gemv(x, w, blocks=blocks, prefetch=Prefetch(nxt, nbytes))
            torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)
