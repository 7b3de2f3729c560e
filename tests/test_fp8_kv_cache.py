"""Chapter 28: an FP8 KV cache's per-layer scales. Every path that writes the cache stores
x / scale, saturated and rounded to e4m3; every path that reads it computes with stored *
scale; a checkpoint's calibrated scales load into the cache (and only into an FP8 one);
bad ones are refused by name; with them the logits stay close to the unquantised cache's.

The reference is torch: quantise x / scale, widen and multiply by the scale, attend in fp32.
The kernels run in Triton's interpreter on the CPU (tests/conftest.py turns it on).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY, all_logits, make_engine, need, run_tool
from safetensors.torch import save_file

from minisgl.core import Req, SamplingParams
from minisgl.distributed.info import set_tp_info
from minisgl.kernels.decode_attention import decode_attention
from minisgl.kernels.extend_attention import extend_attention
from minisgl.kernels.fused_decode import decode_attention_qkv
from minisgl.kernels.rope_store import qk_rope_store
from minisgl.kvcache.allocator import page_slots
from minisgl.kvcache.mha_pool import MHAKVCache
from minisgl.layers.rotary import RotaryEmbedding
from minisgl.models.config import ModelConfig
from minisgl.models.register import create_model
from minisgl.models.weight import load_weights
from minisgl.quant.fp8 import FP8, FP8_MAX

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or Triton's interpreter",
)
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KS, VS = 0.37, 1.9  # scales of the kernel tests: far from 1, neither a power of two
# tiny-qwen3's scales, per layer: about max|K| / 448 and max|V| / 448 of the prompt below
K_SCALES, V_SCALES = [0.01, 0.02], [0.0015, 0.002]
AS_STORED = torch.tensor(K_SCALES).tolist(), torch.tensor(V_SCALES).tolist()  # in fp32
KV_TOL = 0.05  # max |logit with scaled FP8 K/V - logit| <= this x the largest |logit|
PROMPT, DECODED = list(range(5, 17)), [7, 8]


def stored(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an FP8 cache must hold for x: x / scale, saturated at 448, rounded to e4m3. As
    every store computes it: x * (1 / scale) in fp32 (on a GPU x / scale can differ from
    that by a unit in the last place, and so land on the other side of an e4m3 midpoint)."""
    return (x.float() * (1 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


def attention(q, keys, values, q_pos, sm_scale) -> torch.Tensor:
    """q [n, q_heads, d] at positions q_pos over keys/values [len, kv_heads, d], causal, fp32."""
    visible = torch.arange(keys.size(0), device=q.device)[None, :] <= q_pos[:, None]
    return F.scaled_dot_product_attention(
        q.transpose(0, 1).float(), keys.transpose(0, 1).float(), values.transpose(0, 1).float(),
        attn_mask=visible, scale=sm_scale, enable_gqa=True,
    ).transpose(0, 1)  # fmt: skip


# ---- the kernels against torch --------------------------------------------------------


def test_store_kv_holds_x_over_its_layers_scale() -> None:
    pool = MHAKVCache(2, 8, 4, 2, 16, FP8, DEV)
    pool.k_scale, pool.v_scale = [1.0, KS], [1.0, VS]
    x = torch.randn(10, 2, 16, generator=torch.Generator().manual_seed(0)).to(DEV) * 200
    slots = torch.arange(3, 13, device=DEV)
    pool.store_kv(x, -x, slots, 1)
    assert (x.abs() / KS).max() > FP8_MAX  # some saturate
    assert same_bytes(pool.k_cache(1)[slots], stored(x, KS))
    assert same_bytes(pool.v_cache(1)[slots], stored(-x, VS))
    pool.store_kv(x, x, slots, 0)  # layer 0 keeps 1.0: stored as they are
    assert same_bytes(pool.k_cache(0)[slots], stored(x, 1.0))


def test_attention_kernels_read_stored_times_scale() -> None:
    """Decode and extend over a scaled e4m3 cache equal torch over the widened values times
    their scales: k_scale folded into the softmax scale, v_scale on the output."""
    gen = torch.Generator().manual_seed(3)
    slots, kv_heads, q_heads, d = 96, 2, 4, 32
    k8, v8 = (stored(torch.randn(slots, kv_heads, d, generator=gen) * 3, s) for s in (KS, VS))
    table = torch.randperm(slots, generator=gen).view(2, 48).int()
    lens = [37, 5]
    rows, seq_lens = torch.tensor([1, 0], dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    dev = [t.to(DEV) for t in (k8, v8, table, rows, seq_lens)]
    sm = d**-0.5

    def want(q: torch.Tensor, b: int, q_pos: torch.Tensor) -> torch.Tensor:
        ids = table[rows[b], : lens[b]].long()
        return attention(q.cpu(), k8[ids].float() * KS, v8[ids].float() * VS, q_pos, sm)

    q = torch.randn(2, q_heads, d, generator=gen)
    got = decode_attention(q.to(DEV), *dev, sm, k_scale=KS, v_scale=VS).cpu()
    for b in range(2):
        ref = want(q[b : b + 1], b, torch.tensor([lens[b] - 1]))
        torch.testing.assert_close(got[b : b + 1], ref, rtol=0, atol=1e-5)
    q = torch.randn(9, q_heads, d, generator=gen)  # 4 new tokens of row 1, 5 of row 0
    qo = torch.tensor([0, 4, 9], dtype=torch.int32, device=DEV)
    got = extend_attention(q.to(DEV), *dev, qo, 5, sm, k_scale=KS, v_scale=VS).cpu()
    for b, (start, end) in enumerate([(0, 4), (4, 9)]):
        q_pos = torch.arange(lens[b] - (end - start), lens[b])
        torch.testing.assert_close(got[start:end], want(q[start:end], b, q_pos), rtol=0, atol=1e-5)


def rotated(qkv: torch.Tensor, positions: torch.Tensor, rope, hq: int, hkv: int, d: int):
    """(q, k, v) of qkv [tokens, (hq + 2 hkv) * d], q and k rotated, as the layers compute."""
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    n = qkv.size(0)
    q, k = rope.reference(positions.long(), q.reshape(n, hq, d), k.reshape(n, hkv, d))
    return q, k, v.reshape(n, hkv, d)


def test_rope_store_writes_x_over_scale() -> None:
    gen = torch.Generator().manual_seed(4)
    hq, hkv, d, tokens = 4, 2, 16, 5
    qkv = (torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen) * 150).to(DEV)
    positions = torch.randint(0, 100, (tokens,), generator=gen).int().to(DEV)
    out_loc = torch.tensor([3, 9, 0, 12, 7], dtype=torch.int32, device=DEV)
    rope = RotaryEmbedding(d, 10000.0, 128, DEV)
    k8, v8 = (torch.zeros(16, hkv, d, dtype=FP8, device=DEV) for _ in range(2))
    qk_rope_store(qkv, positions, rope.cos_sin, None, None, 1e-6, k8, v8, out_loc, hq, hkv, d,
                  KS, VS)  # fmt: skip
    _, k, v = rotated(qkv, positions, rope, hq, hkv, d)
    assert (k.abs() / KS).max() > FP8_MAX  # some saturate
    assert same_bytes(k8[out_loc.long()], stored(k, KS))
    assert same_bytes(v8[out_loc.long()], stored(v, VS))


def test_fused_decode_stores_and_reads_with_the_scales() -> None:
    """The one-kernel decode: the new key and value stored as x / scale, the output that of
    torch over every stored key and value times its scale."""
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d, bs, width = 4, 2, 16, 2, 160
    table = torch.randperm(bs * width, generator=gen).view(bs, width).int()
    seq_lens = torch.tensor([width, 40], dtype=torch.int32)  # the first: several splits
    rows, positions = torch.arange(bs, dtype=torch.int32), seq_lens - 1
    out_loc = table[torch.arange(bs), positions.long()]
    qkv = torch.randn(bs, (hq + 2 * hkv) * d, generator=gen) * 4
    rope = RotaryEmbedding(d, 10000.0, width, torch.device("cpu"))
    k8, v8 = (stored(torch.randn(bs * width, hkv, d, generator=gen) * 4, s) for s in (KS, VS))
    kc, vc = k8.clone().to(DEV), v8.clone().to(DEV)
    out = decode_attention_qkv(
        qkv.to(DEV), positions.to(DEV), rope.cos_sin.to(DEV), None, None, 1e-6, kc, vc,
        *(t.to(DEV) for t in (out_loc, table, rows, seq_lens)), d**-0.5, hq, hkv, d,
        k_scale=KS, v_scale=VS,
    ).cpu()  # fmt: skip
    q, k, v = rotated(qkv, positions, rope, hq, hkv, d)
    k8[out_loc.long()], v8[out_loc.long()] = stored(k, KS), stored(v, VS)
    assert same_bytes(kc, k8) and same_bytes(vc, v8)
    for b in range(bs):
        ids = table[b, : seq_lens[b]].long()
        want = attention(q[b : b + 1], k8[ids].float() * KS, v8[ids].float() * VS,
                         positions[b : b + 1], d**-0.5)  # fmt: skip
        torch.testing.assert_close(out[b : b + 1], want, rtol=2e-5, atol=2e-5)  # fp32 sums


# ---- a checkpoint's scales ------------------------------------------------------------


def scaled_checkpoint(into: Path, names: str = "compressed-tensors", **tensors) -> Path:
    """tiny-qwen3 with KV-cache scales: its files linked into `into`, a config.json that
    says so (llm-compressor's KV-only form) and a safetensors file of scales; `tensors`
    replace or add scale tensors by name."""
    src = need(TINY["qwen3"])
    for f in src.iterdir():
        if f.name != "config.json":
            (into / f.name).symlink_to(f.resolve())
    config = json.loads((src / "config.json").read_text())
    if names == "compressed-tensors":
        scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
        method = {"quant_method": "compressed-tensors", "config_groups": {}}
        config["quantization_config"] = {**method, "kv_cache_scheme": scheme}
    (into / "config.json").write_text(json.dumps(config))
    k, v = ("k", "v") if names == "compressed-tensors" else ("k_proj.k", "v_proj.v")
    scales = {}
    for i, (ks, vs) in enumerate(zip(K_SCALES, V_SCALES)):
        scales[f"model.layers.{i}.self_attn.{k}_scale"] = torch.tensor([ks])
        scales[f"model.layers.{i}.self_attn.{v}_scale"] = torch.tensor(vs)  # 0-d: also one
    scales.update(tensors)
    scales = {name: t for name, t in scales.items() if t is not None}  # None: left out
    save_file(scales, str(into / "kv_scales.safetensors"))
    return into


def loaded(path: Path) -> torch.nn.Module:
    with torch.device(DEV):
        model = create_model(ModelConfig.from_path(path))
    load_weights(model, path)
    return model


def teacher_forced(path: Path, **kw) -> tuple[torch.Tensor, list[float], list[float]]:
    """Logits of a prefill and two decode steps, every position, with engine settings `kw`;
    and the (k, v) scales the engine's KV cache took. On the GPU where there is one (the
    CPU's Triton backend needs the interpreter, which a GPU host does not turn on)."""
    engine = make_engine(path, device=DEV.type, **kw)
    try:
        n = len(PROMPT) + len(DECODED)
        req = Req(torch.tensor(PROMPT, dtype=torch.int32), 0, 0, n, 0, SamplingParams())
        engine.page_table[0, :n] = page_slots(list(range(1, n + 1)), 1)
        engine.token_pool[0, :n] = torch.tensor(PROMPT + DECODED, dtype=torch.int32)
        out = [all_logits(engine, [req], "prefill")]
        for token in DECODED:
            req.append_host(token)
            out.append(all_logits(engine, [req], "decode"))
        return torch.cat(out), engine.kv_cache.k_scale, engine.kv_cache.v_scale
    finally:
        engine.shutdown()


@pytest.mark.parametrize("names", ["compressed-tensors", "modelopt"])
def test_checkpoint_scales_land_in_an_fp8_cache(tmp_path, names, monkeypatch, caplog) -> None:
    """Both names load; the torch backend, our kernels, and the kernels a GPU runs in bf16
    (rope_store and the one-kernel decode, forced on here) agree on the scaled cache, whose
    logits stay within KV_TOL of the fp32 cache's (the kernels above say how exactly). A
    cache in the model's dtype ignores the scales, and says so."""
    from minisgl.layers import kernel_plan

    folder = scaled_checkpoint(tmp_path, names)
    original, *_ = teacher_forced(need(TINY["qwen3"]))
    got, k, v = teacher_forced(folder, kv_cache_dtype="fp8", attention_backend="torch")
    assert (k, v) == AS_STORED
    assert (got - original).abs().max() <= KV_TOL * original.abs().max()
    triton, *_ = teacher_forced(folder, kv_cache_dtype="fp8", attention_backend="triton")
    # On a GPU the triton backend already stores keys with rope_store: the bound below
    one_step = 0.01 * original.abs().max().item()
    torch.testing.assert_close(triton, got, rtol=0, atol=one_step if DEV.type == "cuda" else 1e-4)
    monkeypatch.setattr(kernel_plan, "rope_store_kernel", lambda fused: qk_rope_store)
    fused, *_ = teacher_forced(folder, kv_cache_dtype="fp8", attention_backend="triton")
    # Their keys differ from the layers' by an fp32 rounding, which can move one that lies
    # at a midpoint of e4m3 (x / scale = 68.00001 here) to the other side: one step.
    assert (fused - got).abs().max() <= one_step
    monkeypatch.undo()
    with caplog.at_level(logging.INFO, logger="minisgl.quant.kv_scales"):
        plain, k, v = teacher_forced(folder)
    assert torch.equal(plain, original) and k == v == [1.0, 1.0]
    assert "KV-cache scales are not used" in caplog.text


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({"model.layers.1.self_attn.k_scale": torch.tensor([float("nan")])}, "is nan"),
        ({"model.layers.1.self_attn.k_scale": torch.tensor([float("inf")])}, "is inf"),
        ({"model.layers.0.self_attn.v_scale": torch.tensor([0.0])}, "must be finite and > 0"),
        ({"model.layers.0.self_attn.v_scale": torch.tensor([-0.01])}, "must be finite and > 0"),
        ({"model.layers.0.self_attn.k_scale": torch.full((2,), 0.1)}, "per-head scales"),
        ({"model.layers.1.self_attn.v_scale": None}, "no v_scale of layer 1"),
        ({"model.layers.7.self_attn.k_scale": torch.tensor([0.1])}, "the model has 2 layers"),
        ({"model.layers.0.self_attn.k_proj.k_scale": torch.tensor([0.1])}, "given twice"),
    ],
)
def test_bad_scales_are_refused_at_load(tmp_path, tensors, message) -> None:
    with pytest.raises(ValueError, match=message):
        loaded(scaled_checkpoint(tmp_path, **tensors))


def test_a_kv_scheme_we_do_not_store_is_refused(tmp_path) -> None:
    folder = scaled_checkpoint(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"]["strategy"] = "attn_head"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="kv_cache_scheme .* is not supported"):
        ModelConfig.from_path(folder)


def test_every_rank_takes_the_same_scales(tmp_path) -> None:
    """One scale per layer, not per head: a rank of two (half the KV heads) loads them all."""
    folder = scaled_checkpoint(tmp_path)
    try:
        for rank in range(2):
            set_tp_info(rank, 2)
            scales = loaded(folder).kv_scales
            assert ([scales.k[i] for i in range(2)], [scales.v[i] for i in range(2)]) == AS_STORED
    finally:
        set_tp_info(0, 1)


def test_kv_accuracy_tool_reports() -> None:
    """tools/bench_fp8_kv.py on a tiny model: the three caches, teacher-forced and greedy."""
    done = run_tool("bench_fp8_kv.py", "--model", str(need(TINY["llama"])), "--device", "cpu",
                    "--tokens", "24", "--prompts", "1", "--max-tokens", "3")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for row in ("float32 (full) | - | - | 24/24 |", "scale 1.0 |", "calibrated |"):
        assert row in done.stdout, done.stdout
    assert done.stdout.count("| fp8_e4m3, ") == 2
    assert "prompts identical to the end" in done.stdout
