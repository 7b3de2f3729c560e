"""Qwen3-Next: Qwen3.5-MoE's hybrid decoder with its linear layers' projections fused.

A tiny random Qwen3-Next (3 linear layers + 1 attention layer, 4 experts top-2 with a
shared expert, seed 0, fp32) is compared with transformers under teacher forcing, once with
the config.json transformers writes and once with `layer_types` taken out (as the published
config leaves it): a prefill in two chunks, then decode steps. The published config of
Qwen3-Next-80B-A3B parses and sizes the engine; what a hybrid cannot do fails by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import make_engine
from test_qwen3_5 import _perturb, teacher_forced, token_ids

from minisgl.engine.config import EngineConfig, check_model_files
from minisgl.engine.startup import EngineShape, pages_from_budget
from minisgl.kvcache.mha_pool import MHAKVCache
from minisgl.kvcache.state_pool import RecurrentStatePool, state_pool_bytes
from minisgl.models.config import ModelConfig
from minisgl.models.families import FULL, LINEAR, attention_layers
from minisgl.models.llama import LlamaMLP
from minisgl.models.qwen3_5 import SharedExpertMoE

TOL = 1e-4
VOCAB = 256
CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=72, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
    linear_conv_kernel_dim=4, max_position_embeddings=128, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                     "partial_rotary_factor": 0.25},
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
    shared_expert_intermediate_size=40, norm_topk_prob=True, mlp_only_layers=[1],
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    root = tmp_path_factory.mktemp("qwen3_next")
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**CONFIG))
    _perturb(model.float())
    model.save_pretrained(root / "hf")
    (root / "interval").mkdir()  # no layer_types: full_attention_interval says them
    shutil.copy(root / "hf" / "model.safetensors", root / "interval" / "model.safetensors")
    raw = json.loads((root / "hf" / "config.json").read_text())
    assert raw["layer_types"] == [LINEAR] * 3 + [FULL]
    raw.pop("layer_types")
    raw["full_attention_interval"] = 4
    (root / "interval" / "config.json").write_text(json.dumps(raw))
    return {"hf": root / "hf", "interval": root / "interval"}


def hf_reference(path: Path, ids: list[int]) -> torch.Tensor:
    from transformers import Qwen3NextForCausalLM

    model = Qwen3NextForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_checkpoint_fuses_the_linear_projections(folders) -> None:
    from safetensors import safe_open

    with safe_open(str(folders["hf"] / "model.safetensors"), framework="pt") as f:
        prefix = "model.layers.0.linear_attn."
        assert f.get_tensor(prefix + "in_proj_qkvz.weight").shape == (2 * 32 + 2 * 96, 64)
        assert f.get_tensor(prefix + "in_proj_ba.weight").shape == (8, 64)


@pytest.mark.parametrize("layout", ["hf", "interval"])
def test_logits_equal_transformers(folders, layout: str) -> None:
    ids = token_ids(0, 24)
    engine = make_engine(folders[layout], page_size=4, max_running_req=4)
    layers = engine.model.model.layers
    assert [type(layer.mlp) for layer in layers] == [SharedExpertMoE, LlamaMLP] + [
        SharedExpertMoE
    ] * 2  # layer 1 is in mlp_only_layers
    assert not hasattr(layers[0].linear_attn, "in_proj_qkvz")  # split after loading
    assert engine.kv_cache._k.shape[0] == 1 and engine.state_pool.ssm.shape[0] == 3
    got = teacher_forced(engine, ids)
    want = hf_reference(folders["hf"], ids)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= TOL


def test_what_a_hybrid_cannot_do_fails_by_name(folders) -> None:
    """Recognised as a hybrid without layer_types in its config.json."""
    path = folders["interval"]
    config = EngineConfig(str(path), speculative="draft", draft_model=str(path))
    with pytest.raises(ValueError, match=r"\(Qwen3NextForCausalLM\) has linear-attention"):
        check_model_files(config)  # a hybrid draft model: its state is not rolled back


# ---- the published config of Qwen3-Next-80B-A3B (values from ../shared/MODELS.md) ----------

PUBLISHED_80B: dict[str, Any] = dict(
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=151936,
    hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    full_attention_interval=4, num_experts=512, num_experts_per_tok=10,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], rope_theta=10000000.0,
    partial_rotary_factor=0.25, max_position_embeddings=262144, rms_norm_eps=1e-6,
    hidden_act="silu", tie_word_embeddings=False, torch_dtype="bfloat16",
)  # fmt: skip


def test_published_80b_a3b_parses_and_sizes(tmp_path: Path) -> None:
    """KV for the 12 attention layers only (2 KV heads of 256, bf16: 24 KB a token); per
    request, 36 linear layers' states: 32 x 128 x 128 x 4 bytes each (72 MB) plus conv."""
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED_80B))
    mc = ModelConfig.from_path(tmp_path)
    assert mc.architecture == "Qwen3NextForCausalLM" and mc.moe is not None
    assert (mc.moe.num_experts, mc.moe.top_k, mc.moe.shared_size) == (512, 10, 512)
    assert all(mc.moe.is_moe_layer(i) for i in range(48)) and mc.moe.norm_topk_prob
    assert attention_layers(mc) == list(range(3, 48, 4)) and mc.linear is not None
    assert mc.rope is not None and mc.rope.rotary_dim == 64 and mc.rope.theta == 1e7
    kv = MHAKVCache.bytes_per_page(12, 1, mc.num_kv_heads, 256, torch.bfloat16)
    assert kv == 24 * 1024
    per_req = RecurrentStatePool.bytes_per_slot(36, mc.linear, torch.bfloat16)
    assert per_req == 36 * 32 * 128 * 128 * 4 + 36 * mc.linear.conv_dim * 3 * 2
    assert 36 * 32 * 128 * 128 * 4 == 72 * 2**20
    config = EngineConfig(str(tmp_path), device="cpu", max_running_req=4, state_snapshots=1)
    shape = EngineShape(config, mc, torch.device("cpu"), torch.bfloat16, torch.bfloat16,
                        4096, mc.num_heads, mc.num_kv_heads, 0)  # fmt: skip
    assert state_pool_bytes(shape) == 6 * per_req  # 4 rows, the dummy request's, a snapshot
    pages = pages_from_budget(shape)
    assert pages * kv <= 512 * 2**20 - 6 * per_req < (pages + 1) * kv
