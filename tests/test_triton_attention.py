"""Our Triton attention kernels against the reference, on CPU in Triton's interpreter.

tests/conftest.py turns the interpreter on when there is no GPU. Shapes are small (the
interpreter runs every program in Python) but cover what goes wrong in such kernels:
lengths that end mid-page and mid-block, several page sizes, grouped-query attention,
cached prefixes, and batches that mix prompt chunks with single decode tokens.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from helpers import ROWS, TINY, WIDTH, attention_reference, need, paged_table

from minisgl.attention.registry import BACKENDS, select_backend
from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.attention.triton_backend import TritonAttnBackend
from minisgl.core import SamplingParams
from minisgl.env import ENV
from minisgl.kernels.attention import DECODE_MAX_SPLITS, Launch, decode_num_splits
from minisgl.kernels.decode_attention import decode_attention
from minisgl.kernels.extend_attention import extend_attention
from minisgl.llm import LLM

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or Triton's interpreter",
)
CPU = torch.device("cpu")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where the kernels run


def on_dev(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEV) for t in tensors]


CASES = [  # (q heads, kv heads, head_dim, page size)
    (4, 4, 16, 1),
    (8, 4, 32, 16),
    (8, 2, 64, 64),
    (6, 2, 24, 16),  # a head_dim that is not a power of two
]


@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim", "page_size"), CASES)
def test_decode_kernel_equals_reference(q_heads, kv_heads, head_dim, page_size) -> None:
    gen = torch.Generator().manual_seed(q_heads * head_dim + page_size)
    table = paged_table(page_size, gen)
    k_cache = torch.randn(ROWS * WIDTH, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(ROWS * WIDTH, kv_heads, head_dim, generator=gen)
    seq_lens = [1, 3, 17, 290, 64, 33]  # shorter than the number of splits, mid-page, long
    rows = [7, 0, 2, 5, 1, 3]
    q = torch.randn(len(rows), q_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    got = decode_attention(
        *on_dev(q, k_cache, v_cache, table, torch.tensor(rows, dtype=torch.int32),
                torch.tensor(seq_lens, dtype=torch.int32)),
        scale,
    ).cpu()  # fmt: skip
    one_each = list(range(len(rows) + 1))
    want = attention_reference(q, k_cache, v_cache, table, rows, seq_lens, one_each, scale)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim", "page_size"), CASES)
def test_extend_kernel_equals_reference(q_heads, kv_heads, head_dim, page_size) -> None:
    gen = torch.Generator().manual_seed(q_heads + head_dim * page_size)
    table = paged_table(page_size, gen)
    k_cache = torch.randn(ROWS * WIDTH, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(ROWS * WIDTH, kv_heads, head_dim, generator=gen)
    # (cached prefix, new tokens): a whole prompt, a prefix ending mid-page, single decode
    # tokens mixed in, a chunk longer than one block of queries
    shape = [(0, 70), (13, 9), (40, 1), (0, 1), (29, 35), (5, 1)]
    rows = [1, 4, 0, 6, 2, 7]
    seq_lens = [p + n for p, n in shape]
    qo = [0]
    for _, n in shape:
        qo.append(qo[-1] + n)
    q = torch.randn(qo[-1], q_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    got = extend_attention(
        *on_dev(q, k_cache, v_cache, table, torch.tensor(rows, dtype=torch.int32),
                torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(qo, dtype=torch.int32)),
        max(n for _, n in shape), scale,
    ).cpu()  # fmt: skip
    want = attention_reference(q, k_cache, v_cache, table, rows, seq_lens, qo, scale)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_split_count_is_a_power_of_two_that_shrinks_with_the_batch() -> None:
    splits = [decode_num_splits(bs, 8) for bs in (1, 4, 32, 256)]
    assert splits == sorted(splits, reverse=True) and splits[-1] == 1
    assert splits[0] == DECODE_MAX_SPLITS  # one request: as many splits as allowed
    assert all(s & (s - 1) == 0 for s in splits)


def test_a_launch_caps_registers_only_when_asked() -> None:
    """A sweep's register cap reaches the launch as Triton's `maxnreg`; the engine's launches
    (no cap) leave the compiler's choice."""
    assert Launch(64, 2).options() == {"num_warps": 2}
    assert Launch(64, 4, 3, registers=128).options() == {
        "num_warps": 4,
        "num_stages": 3,
        "maxnreg": 128,
    }


def test_registry_offers_triton_but_auto_keeps_torch_on_cpu(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend("triton", CPU, torch.float32, 16) is TritonAttnBackend
    assert select_backend("auto", CPU, torch.float32, 16) is TorchAttnBackend
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1"):
        select_backend("triton", CPU, torch.float32, 16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU test: the GPU has tests/test_gpu.py")
@pytest.mark.parametrize("page_size", [1, 16])
def test_llm_with_triton_gives_the_torch_backends_tokens(page_size: int) -> None:
    path = need(TINY["qwen3"])
    prompts = [[5, 6, 7, 8, 9, 10, 11], [8, 9, 10, 11, 12] * 5, [13]]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    kw = dict(
        max_running_req=4,
        num_page_override=256,
        max_seq_len_override=64,
        page_size=page_size,
        max_prefill_length=16,  # the long prompt comes in chunks next to the others
    )
    out = {}
    saved = ENV.DISABLE_OVERLAP_SCHEDULING.value
    ENV.DISABLE_OVERLAP_SCHEDULING.value = True
    try:
        for attn, graphs in (("torch", 0), ("triton", 0), ("triton", 4)):
            llm = LLM(str(path), attention_backend=attn, cuda_graph_max_bs=graphs, **kw)
            assert llm.engine.attn_backend.name == attn
            out[attn, graphs] = [o["token_ids"] for o in llm.generate(prompts, params, False)]
            llm.shutdown()
    finally:
        ENV.DISABLE_OVERLAP_SCHEDULING.value = saved
    assert out["triton", 0] == out["torch", 0]
    assert out["triton", 4] == out["torch", 0]  # emulated graphs through the static buffers


# ---- the flash-attn adapter, with a stand-in module ------------------------------------------


def _paged_sdpa(q, k_pages, v_pages, pages, n_kv, scale) -> torch.Tensor:
    """q [n, heads, dim] are the last n of n_kv positions; keys come page by page."""
    keys = k_pages[pages].flatten(0, 1)[:n_kv].transpose(0, 1)
    values = v_pages[pages].flatten(0, 1)[:n_kv].transpose(0, 1)
    q_pos = torch.arange(n_kv - len(q), n_kv)
    mask = torch.arange(n_kv)[None, :] <= q_pos[:, None]
    return F.scaled_dot_product_attention(
        q.transpose(0, 1), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    ).transpose(0, 1)


def _with_kvcache(q, k_cache, v_cache, *, cache_seqlens, block_table, softmax_scale, causal):
    assert causal and q.dim() == 4 and q.size(1) == 1 and k_cache.dim() == 4
    out = torch.empty_like(q)
    for i, n_kv in enumerate(cache_seqlens.tolist()):
        pages = block_table[i, : -(-n_kv // k_cache.size(1))].long()
        out[i] = _paged_sdpa(q[i], k_cache, v_cache, pages, n_kv, softmax_scale)
    return out


def _varlen(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
            causal, block_table):  # fmt: skip
    assert causal and cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    out = torch.empty_like(q)
    qo, lens = cu_seqlens_q.tolist(), cu_seqlens_k.diff().tolist()
    assert max(lens) <= max_seqlen_k and max(b - a for a, b in zip(qo, qo[1:])) == max_seqlen_q
    for i, n_kv in enumerate(lens):
        pages = block_table[i, : -(-n_kv // k.size(1))].long()
        out[qo[i] : qo[i + 1]] = _paged_sdpa(q[qo[i] : qo[i + 1]], k, v, pages, n_kv, softmax_scale)
    return out


@pytest.fixture
def fake_flash_attn(monkeypatch):
    import importlib.util
    import sys
    import types

    module = types.ModuleType("flash_attn")
    module.flash_attn_with_kvcache = _with_kvcache
    module.flash_attn_varlen_func = _varlen
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        "importlib.util.find_spec",
        lambda name, *a: object() if name == "flash_attn" else (
            None if name == "flash_attn_interface" else find_spec(name, *a)
        ),
    )  # fmt: skip


def test_fa_says_what_it_needs(monkeypatch, fake_flash_attn) -> None:
    cuda = torch.device("cuda")  # only the declarations are asked; nothing touches a GPU
    assert select_backend("fa", cuda, torch.bfloat16, 256).name == "fa"
    with pytest.raises(ValueError, match="multiple of 256 tokens, and the page size is 16"):
        select_backend("fa", cuda, torch.bfloat16, 16)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_backend("fa", CPU, torch.bfloat16, 256)
    assert BACKENDS["fa"].auto_devices == ()  # only by name
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match="flash_attn package is not installed.*--attn triton"):
        select_backend("fa", cuda, torch.bfloat16, 256)


def test_fa_adapter_plumbing_equals_torch_backend(fake_flash_attn) -> None:
    from helpers import SMOL, Driver, make_engine

    from minisgl.attention.fa import FlashAttnBackend
    from minisgl.engine.graph import GraphKind, GraphPlan, GraphRunner, GraphShape

    path = need(SMOL)  # a real model: its next token depends on the context it attends to
    prompts = [[504, 3575, 282, 4649, 314], [1971, 1377, 4159, 3054, 28], [504], [1, 2, 3, 4]]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    want = Driver(make_engine(path, page_size=4)).generate(prompts, params)
    engine = make_engine(path, page_size=4)
    mc = engine.model_config
    fa = FlashAttnBackend(engine.kv_cache, engine.page_table, mc.head_dim**-0.5, mc.num_heads)
    engine.attn_backend = engine.ctx.attn_backend = fa
    decode = GraphKind([GraphShape(bs, bs) for bs in (1, 2, 4)], engine.dummy_req)
    plan = GraphPlan([decode], engine.max_seq_len, emulated=True)
    engine.graph_runner = GraphRunner(engine.model, fa, plan, mc.vocab_size, CPU)
    engine.graph_runner.capture()
    assert Driver(engine).generate(prompts, params) == want  # decode steps replay graphs
