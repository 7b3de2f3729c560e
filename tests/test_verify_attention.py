"""The verify batch's split-KV attention (kernels/verify_attention.py) against the reference,
on CPU in Triton's interpreter: a few new tokens a request (a verify's last token and its
drafts) over contexts short enough for one range of keys and long enough to be split and
merged, grouped-query attention, the padding a verify graph adds (a zero-length request),
and an engine whose verifies take it giving the tokens of one that runs the extend kernel."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import ROWS, TINY, WIDTH, attention_reference, need, paged_table

from minisgl.kernels.extend_attention import extend_attention
from minisgl.kernels.fused_decode import MIN_SPLIT_KEYS
from minisgl.kernels.rope_store import qk_rope_store
from minisgl.kernels.verify_attention import verify_attention, verify_attention_qkv, verify_blocks
from minisgl.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or Triton's interpreter",
)
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where the kernels run


def on_dev(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEV) for t in tensors]


def _batch(shape, q_heads, kv_heads, head_dim, page_size, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    table = paged_table(page_size, gen)
    k_cache = torch.randn(ROWS * WIDTH, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(ROWS * WIDTH, kv_heads, head_dim, generator=gen).to(dtype)
    rows = list(range(len(shape)))[::-1]
    seq_lens = [p + n for p, n in shape]
    qo = [0]
    for _, n in shape:
        qo.append(qo[-1] + n)
    q = torch.randn(qo[-1], q_heads, head_dim, generator=gen).to(dtype)
    ints = [torch.tensor(x, dtype=torch.int32) for x in (rows, seq_lens, qo)]
    args = (q, k_cache, v_cache, table, *ints)
    return args, rows, seq_lens, qo, max(n for _, n in shape)


# (q heads, kv heads, head_dim, page size): SmolLM2's group of 3, Qwen3's 2, none, 8
CASES = [(6, 2, 32, 16), (4, 2, 16, 1), (4, 4, 24, 16), (8, 1, 16, 64)]
# (cached prefix, new tokens): a verify of 8 drafts past one range of keys (split and
# merged), of 4 within one, a request without drafts, a zero-length slot (a graph's
# padding), drafts that start a range of their own, and one of 15 drafts
SHAPE = [(300, 9), (20, 5), (57, 1), (1, 0), (2 * MIN_SPLIT_KEYS - 3, 9), (160, 16)]


@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim", "page_size"), CASES)
def test_verify_kernel_equals_reference(q_heads, kv_heads, head_dim, page_size) -> None:
    args, rows, seq_lens, qo, longest = _batch(SHAPE, q_heads, kv_heads, head_dim, page_size,
                                               seed=q_heads * 31 + head_dim)  # fmt: skip
    scale = head_dim**-0.5
    got = verify_attention(*on_dev(*args), longest, scale).cpu()
    want = attention_reference(*args[:4], rows, seq_lens, qo, scale)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("block_tokens", "min_split"), [(4, 16), (2, 64), (3, 128)])
def test_verify_kernel_with_blocks_of_tokens_and_short_ranges(monkeypatch, block_tokens, min_split):
    """A request's tokens over several programs (a verify graph's filler takes as many blocks
    as its tokens need; sweeps try smaller blocks) and many ranges of keys: the reference."""
    from minisgl.kernels import verify_attention as module

    monkeypatch.setattr(module, "BLOCK_TOKENS", block_tokens)
    monkeypatch.setattr(module, "MIN_SPLIT", min_split)
    args, rows, seq_lens, qo, longest = _batch(SHAPE, 6, 2, 32, 16, seed=block_tokens)
    got = verify_attention(*on_dev(*args), longest, 32**-0.5).cpu()
    want = attention_reference(*args[:4], rows, seq_lens, qo, 32**-0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("head_dim", [32, 512])
def test_verify_kernel_in_bf16_matches_extend_kernel(head_dim) -> None:
    """In the model's dtype, as a GPU runs it: within the rounding of the extend kernel's;
    and Gemma 4's heads of 512, whose launch is fitted to a block's memory."""
    args, *_, longest = _batch(SHAPE[:3], 8, 2, head_dim, 16, seed=5, dtype=torch.bfloat16)
    got = verify_attention(*on_dev(*args), longest, head_dim**-0.5).float().cpu()
    want = extend_attention(*on_dev(*args), longest, head_dim**-0.5).float().cpu()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


# (q heads, kv heads, head_dim, qk norm, new tokens a program): Qwen3's norms, SmolLM2's group
# of 3 without, and a request's tokens over several programs, each storing the keys it reads
QKV_CASES = [(4, 2, 16, True, None), (6, 2, 24, False, None), (4, 2, 16, True, 2)]


@pytest.mark.parametrize(("hq", "hkv", "d", "norm", "block_tokens"), QKV_CASES)
def test_verify_from_qkv_equals_rope_store_then_verify_kernel(
    monkeypatch, hq, hkv, d, norm, block_tokens
) -> None:
    """The one kernel from qkv (heads normed and rotated, the new keys and values stored, then
    attended) against `qk_rope_store` followed by the split kernel: the output and the pool."""
    from minisgl.kernels import verify_attention as module

    monkeypatch.setattr(module, "BLOCK_TOKENS", block_tokens)
    monkeypatch.setattr(module, "MIN_SPLIT", 16)  # several ranges, new keys across two of them
    gen = torch.Generator().manual_seed(hq * d)
    table = paged_table(16, gen)
    shape = [(40, 9), (3, 5), (17, 1), (1, 0), (150, 16)]  # a 0-token slot: a graph's filler
    rows = list(range(len(shape)))[::-1]
    seq_lens = [p + n for p, n in shape]
    qo = [0]
    for _, n in shape:
        qo.append(qo[-1] + n)
    positions = torch.cat([torch.arange(p, p + n) for p, n in shape]).to(torch.int32)
    out_loc = torch.cat([table[r, p : p + n] for r, (p, n) in zip(rows, shape)])
    qkv = torch.randn(qo[-1], (hq + 2 * hkv) * d, generator=gen)
    weights = [torch.rand(d, generator=gen) + 0.5 for _ in range(2)] if norm else [None, None]
    rope = RotaryEmbedding(d, 10000.0, ROWS * WIDTH, torch.device("cpu"))
    k_cache = torch.randn(ROWS * WIDTH, hkv, d, generator=gen)
    v_cache = torch.randn(ROWS * WIDTH, hkv, d, generator=gen)
    ints = [torch.tensor(x, dtype=torch.int32) for x in (rows, seq_lens, qo)]
    longest, scale = max(n for _, n in shape), d**-0.5

    def run(fused: bool):
        kc, vc = on_dev(k_cache.clone(), v_cache.clone())
        args = on_dev(qkv, positions, rope.cos_sin, *(w for w in weights if w is not None))
        w = args[3:] if norm else [None, None]
        meta = on_dev(table, *ints)
        if fused:
            out = verify_attention_qkv(*args[:3], *w, 1e-6, kc, vc, out_loc.to(DEV), *meta,
                                       longest, scale, hq, hkv, d)  # fmt: skip
        else:
            q = qk_rope_store(*args[:3], *w, 1e-6, kc, vc, out_loc.to(DEV), hq, hkv, d)
            out = verify_attention(q, kc, vc, *meta, longest, scale)
        return out.cpu(), kc.cpu(), vc.cpu()

    want, got = run(False), run(True)
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)  # the rotated new keys
    torch.testing.assert_close(got[2], want[2], atol=0, rtol=0)  # the values
    changed = (got[1] != k_cache).any(-1).any(-1)
    assert changed.nonzero().flatten().tolist() == sorted(out_loc.tolist())


# >>> ch29 sliding windows
@pytest.mark.parametrize("window", [1, 7, 150])
def test_verify_kernel_with_a_window_matches_extend_kernel(window) -> None:
    """A sliding layer's window (each token sees the last `window` positions up to its own):
    as the extend kernel, which the window tests check against the reference."""
    args, *_, longest = _batch(SHAPE, 6, 2, 32, 16, seed=window)
    got = verify_attention(*on_dev(*args), longest, 32**-0.5, window).cpu()
    want = extend_attention(*on_dev(*args), longest, 32**-0.5, window).cpu()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


# <<< ch29
def test_blocks_take_the_longest_run_in_powers_of_two_and_rows_that_fit_the_accumulator() -> None:
    from minisgl.kernels.verify_attention import BLOCK_TOKENS

    most = BLOCK_TOKENS or 16  # new tokens a program takes at most
    for group in (1, 2, 3, 4, 8, 16):
        for n in (1, 2, 5, 9, 16, 24, 72):
            for head_dim in (64, 128, 256, 512):
                block_q, rows = verify_blocks(group, n, head_dim)
                assert rows >= max(16, block_q * group) and rows & (rows - 1) == 0
                assert block_q & (block_q - 1) == 0 and block_q <= 16  # few variants to build
                fits = max(1, 64 * 128 // head_dim // group)  # the rows the accumulator holds
                assert block_q >= min(n, most, fits) / 2 and block_q <= most
                assert block_q * group <= max(fits * group, 1)
                assert rows * head_dim <= max(64 * 128, 16 * head_dim), (group, n, head_dim)


_PLAIN: dict[str, list] = {}  # the plain run's tokens, made once for both paths


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's interpreter")
@pytest.mark.parametrize("path", ["attend", "apart", "qkv"])
def test_speculating_engine_through_the_split_kernel_gives_plain_tokens(monkeypatch, path) -> None:
    """Greedy n-gram speculation on a tiny model with our kernels: verifies through the
    split kernel (in emulated verify graphs with their padding, and eagerly in the graphs'
    warm-ups) give the tokens of plain decoding. `apart` and `qkv`: the layers' fused path
    (rotary and store forced on for CPU tensors); `apart` (MINISGL_VERIFY_ATTN=split) runs
    that kernel and then the split kernel, `qkv` (split-qkv) starts a verify's attention from
    qkv in one kernel, as a decode step's does."""
    from minisgl.core import SamplingParams
    from minisgl.env import ENV
    from minisgl.kernels import verify_attention as module
    from minisgl.layers import kernel_plan
    from minisgl.llm import LLM

    calls = []
    name = "verify_attention_qkv" if path == "qkv" else "verify_attention"
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(ENV.VERIFY_ATTN, "value", "split-qkv" if path == "qkv" else "split")
    if path != "attend":
        monkeypatch.setattr(kernel_plan, "rope_store_kernel", lambda fused: qk_rope_store)
    gen = torch.Generator().manual_seed(3)
    stem = torch.randint(0, 1000, (12,), generator=gen).tolist()
    prompts = [stem * 2 + stem[:3], stem[:5] * 3]  # repeats: the n-gram drafts from them
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    kw = dict(dtype=torch.float32, device="cpu", attention_backend="triton", page_size=4,
              max_running_req=4, max_seq_len_override=96, cuda_graph_max_bs=2)  # fmt: skip
    outs = {"off": _PLAIN.get("off")}
    for spec in [s for s in ("off", "ngram") if outs.get(s) is None]:
        llm = LLM(str(need(TINY["qwen3"])), **kw, speculative=spec, speculative_always=True)
        try:
            outs[spec] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
            if spec == "ngram":
                assert llm.scheduler.spec.num_accepted > 0
                assert llm.engine.graph_runner.graphs("verify")
        finally:
            llm.shutdown()
    _PLAIN["off"] = outs["off"]
    assert calls and outs["ngram"] == outs["off"]


COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minisgl.kernels.fused_decode import _decode_qkv_kernel
from minisgl.kernels.verify_attention import _verify_kernel

KINDS = {"*bf16": {"QKV", "K", "V", "Out", "QW", "KW", "Q"}, "*fp32": {"CosSin", "OutPartial",
         "LsePartial"}, "fp32": {"eps", "sm_scale", "k_inv", "v_inv", "v_scale"},
         "*i32": {"PageTable", "Rows", "SeqLens", "Positions", "OutLoc", "QoIndptr", "Counters"}}

def build(kernel, constants):
    if "FP16_DOTS" in kernel.arg_names:  # an FP8 cache's (chapter 28)
        constants["FP16_DOTS"] = False
    kind = {n: k for k, names in KINDS.items() for n in names}
    signature = {n: "constexpr" if n in constants else kind.get(n, "i32") for n in kernel.arg_names}
    src = ASTSource(kernel, signature, constants)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})

shape = dict(KV_HEADS=3, GROUP=3, BLOCK_N=64, HEAD_DIM=64, BLOCK_D=64, NUM_SPLITS=16,
             MIN_SPLIT=128, IEEE=False)
for norm in (True, False):
    build(_decode_qkv_kernel, dict(shape, Q_HEADS=9, BLOCK_H=16, QK_NORM=norm))
    for qkv, block_q in ((True, 16), (True, 1), (False, 8)):
        build(_verify_kernel, dict(shape, BLOCK_Q=block_q, BLOCK_R=max(16, 4 * block_q),
                                   FROM_QKV=qkv, QK_NORM=norm, STORE_T=max(2, block_q)))
print("built")
"""


def test_the_split_kernels_from_qkv_build_for_a_hopper_card() -> None:
    """The decode kernel and the verify kernel (from qkv and not, with and without head
    norms, blocks of 1 and 16 tokens) as a GPU compiles them, for sm_90: Triton compiles for a
    named target on the CPU, and the interpreter above never lowers a kernel, so a type or
    shape the compiler refuses would first show on a GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", COMPILE], capture_output=True, text=True, env=env, timeout=600
    )
    if run.returncode != 0 and ("ptxas" in run.stderr or "GPUTarget" in run.stderr):
        pytest.skip(
            f"Triton cannot compile for sm_90 here: {run.stderr[-300:]}"
        )  # pragma: no cover
    assert run.returncode == 0 and run.stdout.split()[-1] == "built", run.stderr[-2000:]
