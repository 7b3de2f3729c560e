"""tools/make_random_model.py: a real model's shape, fewer layers, loadable by our engine.

Qwen3-30B-A3B's layers are 1.2B parameters each, too many to write and load in a CPU test;
so the check is on shapes: the folder's config reads as the real per-layer shape, and every
tensor the tool would write lands, by the loader's own rules (`models/weight.place`), in a
parameter of our model of the right shape, with none of ours left out.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch
from helpers import ROOT

from minisgl.models.config import ModelConfig
from minisgl.models.register import create_model
from minisgl.models.weight import place

sys.path.insert(0, str(ROOT / "tools"))
import make_random_model  # noqa: E402


def test_qwen3_30b_a3b_with_fewer_layers_fits_our_model(tmp_path) -> None:
    config, hf = make_random_model.meta_model("qwen3-30b-a3b", 2, torch.bfloat16)
    config.save_pretrained(tmp_path)
    mc = ModelConfig.from_path(tmp_path)
    assert mc.architecture == "Qwen3MoeForCausalLM" and mc.num_layers == 2
    assert (mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim) == (2048, 32, 4, 128)
    assert mc.moe is not None and (mc.moe.num_experts, mc.moe.top_k) == (128, 8)
    assert mc.moe.intermediate_size == 768 and mc.vocab_size == 151936
    assert all(mc.moe.is_moe_layer(i) for i in range(2))

    with torch.device("meta"):
        ours = dict(create_model(mc).named_parameters())
    pieces: dict[str, list[torch.Size]] = defaultdict(list)
    for name, tensor in hf.state_dict().items():
        target, _, _ = place(name)
        assert target in ours, f"{name} has no place in our model"
        pieces[target].append(tensor.shape)
    assert set(pieces) == set(ours)
    for target, shapes in pieces.items():
        want = ours[target].shape
        if len(shapes) == 1:  # stored as we store it
            assert shapes[0] == want, target
        else:  # q/k/v or gate/up: merged along the first dimension
            assert sum(s[0] for s in shapes) == want[0] and {s[1:] for s in shapes} == {want[1:]}
    assert ours["model.layers.1.mlp.experts.gate_up_proj"].shape == (128, 2 * 768, 2048)
    # bf16: 48 layers are 61 GB, which a 64 GB disk cannot hold next to anything; 12 fit
    config, hf = make_random_model.meta_model("qwen3-30b-a3b", None, torch.bfloat16)
    assert 60e9 < 2 * make_random_model.weight_count(hf, config) < 62e9
