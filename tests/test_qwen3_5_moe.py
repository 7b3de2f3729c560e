"""Qwen3.5-MoE: Qwen3.5's hybrid layers with routed experts beside a gated shared expert.

A tiny random Qwen3.5-MoE (3 linear layers + 1 attention layer, 4 experts top-2, seed 0,
fp32), saved as transformers saves it (one tensor per expert), rewritten in the published
layout (each projection's experts fused in one tensor) and as the text-only CausalLM, is
compared with transformers under teacher forcing: a prefill in two chunks, then decode
steps. Batched and chunked runs give each request the tokens it gets alone; the published
config of Qwen3.5-35B-A3B parses and sizes the engine; what a hybrid cannot do fails by
name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import TINY, make_engine, need
from test_qwen3_5 import PUBLISHED, SERVE, TEXT, VISION, _perturb, teacher_forced, token_ids

from minisgl.core import SamplingParams
from minisgl.engine.config import EngineConfig, check_model_files
from minisgl.engine.startup import EngineShape, pages_from_budget
from minisgl.kvcache.mha_pool import MHAKVCache
from minisgl.kvcache.state_pool import RecurrentStatePool, state_pool_bytes
from minisgl.layers.moe import MoEBlock
from minisgl.llm import LLM
from minisgl.models.config import ModelConfig
from minisgl.models.families import attention_layers
from minisgl.models.qwen3_5 import SharedExpertMoE

TOL = 1e-4
MOE: dict[str, Any] = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
    shared_expert_intermediate_size=40,
)  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import (
        Qwen3_5MoeConfig,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3_5MoeTextConfig,
    )

    root = tmp_path_factory.mktemp("qwen3_5_moe")
    text = {k: v for k, v in TEXT.items() if k != "intermediate_size"}
    torch.manual_seed(0)
    config = Qwen3_5MoeConfig(text_config={**text, **MOE}, vision_config=VISION)
    model = Qwen3_5MoeForConditionalGeneration(config)
    _perturb(model.float())
    model.save_pretrained(root / "mm")
    fuse_experts(root / "mm", root / "fused")
    torch.manual_seed(0)
    text_model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**text, **MOE))
    _perturb(text_model.float())
    text_model.save_pretrained(root / "text")
    tok = need(TINY["llama"])  # a tokenizer for the offline API (the prompts are token ids)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tok / f).is_file():
            shutil.copy(tok / f, root / "fused" / f)
    return {"mm": root / "mm", "fused": root / "fused", "text": root / "text"}


@pytest.fixture(scope="module")
def folder(folders) -> Path:
    return folders["fused"]


def fuse_experts(src: Path, dst: Path) -> None:
    """The published layout: experts.{gate_up_proj [E, 2I, H], down_proj [E, H, I]}."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    for prefix in sorted({k.split(".experts.")[0] for k in tensors if ".experts." in k}):
        n = len({k for k in tensors if k.startswith(prefix + ".experts.")}) // 3

        def get(e: int, proj: str, prefix: str = prefix) -> torch.Tensor:
            return tensors[f"{prefix}.experts.{e}.{proj}.weight"]

        gate_up = [torch.cat([get(e, "gate_proj"), get(e, "up_proj")]) for e in range(n)]
        out[f"{prefix}.experts.gate_up_proj"] = torch.stack(gate_up)
        out[f"{prefix}.experts.down_proj"] = torch.stack([get(e, "down_proj") for e in range(n)])
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})


def hf_reference(path: Path, ids: list[int]) -> torch.Tensor:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    cls = (
        Qwen3_5MoeForCausalLM
        if arch == "Qwen3_5MoeForCausalLM"
        else Qwen3_5MoeForConditionalGeneration
    )
    model = cls.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_checkpoint_keeps_experts_fused(folder) -> None:
    """The saved layout is the published one: fused experts, a [1, H] shared expert gate."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())  # noqa: SIM118 - safe_open is not a dict
        prefix = "model.language_model.layers.0.mlp."
        assert f.get_tensor(prefix + "experts.gate_up_proj").shape == (4, 96, 64)
        assert f.get_tensor(prefix + "experts.down_proj").shape == (4, 64, 48)
        assert f.get_tensor(prefix + "shared_expert_gate.weight").shape == (1, 64)
    assert prefix + "shared_expert.gate_proj.weight" in names and prefix + "gate.weight" in names


@pytest.mark.parametrize("layout", ["fused", "mm", "text"])
def test_logits_equal_transformers(folders, layout: str) -> None:
    ids = token_ids(0, 24)
    engine = make_engine(folders[layout], page_size=4, max_running_req=4)
    mlps = [layer.mlp for layer in engine.model.model.layers]
    assert all(isinstance(m, SharedExpertMoE) for m in mlps)
    assert mlps[0].norm_topk_prob  # Qwen3.5-MoE always renormalises, config or not
    assert engine.kv_cache._k.shape[0] == 1 and engine.state_pool.ssm.shape[0] == 3
    got = teacher_forced(engine, ids)
    want = hf_reference(folders["mm" if layout == "fused" else layout], ids)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= TOL


PROMPTS = [token_ids(10 + i, n) for i, n in enumerate((5, 13, 22))]
PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)


def test_batched_and_chunked_as_each_alone(folder) -> None:
    alone = []
    for p in PROMPTS:
        llm = LLM(str(folder), **SERVE)
        alone.append(llm.generate([p], PARAMS, use_tqdm=False)[0]["token_ids"])
        llm.shutdown()
    llm = LLM(str(folder), max_prefill_length=7, cache_type="radix", **SERVE)
    together = [o["token_ids"] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    llm.shutdown()
    assert together == alone


def test_what_a_hybrid_cannot_do_fails_by_name(folder) -> None:
    config = EngineConfig(str(folder), speculative="draft", draft_model=str(folder))
    with pytest.raises(ValueError, match=r"\(Qwen3_5Moe\w+\) has linear-attention"):
        check_model_files(config)  # a hybrid draft model: its state is not rolled back


def test_a_moe_without_shared_expert_keeps_the_plain_block() -> None:
    from minisgl.models.qwen3_5 import make_mlp

    raw = {**TEXT, **MOE, "architectures": ["Qwen3_5MoeForCausalLM"]}
    raw["shared_expert_intermediate_size"] = 0
    mlp = make_mlp(ModelConfig.from_dict(raw), 0)
    assert type(mlp) is MoEBlock and mlp.norm_topk_prob


# ---- the published config of Qwen3.5-35B-A3B (values from ../shared/MODELS.md) ------------


def published_35b() -> dict[str, Any]:
    raw = json.loads(json.dumps(PUBLISHED["9B"]))  # the dense 9B's text fields, then the MoE's
    text = raw["text_config"]
    text.pop("intermediate_size")
    text.update(
        model_type="qwen3_5_moe_text",
        hidden_size=2048,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=2,
        linear_num_value_heads=32,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        tie_word_embeddings=False,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
    )
    text["layer_types"] = text["layer_types"] * 10
    raw.update(architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe")
    return raw


def test_published_35b_a3b_parses_and_sizes(tmp_path: Path) -> None:
    """KV for the 10 attention layers only (2 KV heads of 256, bf16: 20 KB a token); per
    request, 30 linear layers' states: 32 x 128 x 128 x 4 bytes each (60 MB) plus conv."""
    (tmp_path / "config.json").write_text(json.dumps(published_35b()))
    mc = ModelConfig.from_path(tmp_path)
    assert mc.architecture == "Qwen3_5MoeForConditionalGeneration" and mc.moe is not None
    assert (mc.moe.num_experts, mc.moe.top_k, mc.moe.intermediate_size) == (256, 8, 512)
    assert mc.moe.shared_size == 512 and mc.moe.norm_topk_prob and mc.moe.is_moe_layer(0)
    assert attention_layers(mc) == list(range(3, 40, 4)) and mc.linear is not None
    kv = MHAKVCache.bytes_per_page(10, 1, mc.num_kv_heads, 256, torch.bfloat16)
    assert kv == 20 * 1024
    per_req = RecurrentStatePool.bytes_per_slot(30, mc.linear, torch.bfloat16)
    assert per_req == 30 * 32 * 128 * 128 * 4 + 30 * mc.linear.conv_dim * 3 * 2
    assert 30 * 32 * 128 * 128 * 4 == 60 * 2**20
    config = EngineConfig(str(tmp_path), device="cpu", max_running_req=4, state_snapshots=1)
    shape = EngineShape(config, mc, torch.device("cpu"), torch.bfloat16, torch.bfloat16,
                        4096, mc.num_heads, mc.num_kv_heads, 0)  # fmt: skip
    assert state_pool_bytes(shape) == 6 * per_req  # 4 rows, the dummy request's, a snapshot
    pages = pages_from_budget(shape)
    assert pages * kv <= 512 * 2**20 - 6 * per_req < (pages + 1) * kv
