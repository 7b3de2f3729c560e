"""Chapter 5: loading safetensors checkpoints into our models, checked against transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import TINY, hf_logits, hf_model, need
from safetensors.torch import load_file, save_file

from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.core import Batch, Context, Req, SamplingParams, set_global_ctx
from minisgl.kvcache.allocator import page_slots
from minisgl.kvcache.mha_pool import MHAKVCache
from minisgl.models.config import ModelConfig
from minisgl.models.register import create_model
from minisgl.models.weight import load_weights

NAMES = list(TINY)


def build(path: Path) -> torch.nn.Module:
    with torch.device("cpu"):
        return create_model(ModelConfig.from_path(path))


def loaded(path: Path) -> torch.nn.Module:
    model = build(need(path))
    load_weights(model, path)
    return model


def merged_hf_state(path: Path) -> dict[str, torch.Tensor]:
    """HF's own state dict (as transformers loads it), merged the way our model stores it."""
    sd = dict(hf_model(need(path)).state_dict())
    out: dict[str, torch.Tensor] = {}
    for name in list(sd):
        if name not in sd:
            continue
        if ".q_proj." in name:
            kind = name.rsplit(".", 1)[1]
            base = name.rsplit(".q_proj.", 1)[0]
            parts = [sd.pop(f"{base}.{p}_proj.{kind}") for p in "qkv"]
            out[f"{base}.qkv_proj.{kind}"] = torch.cat(parts)
        elif ".gate_proj." in name:
            base = name.rsplit(".gate_proj.", 1)[0]
            gate, up = sd.pop(f"{base}.gate_proj.weight"), sd.pop(f"{base}.up_proj.weight")
            out[f"{base}.gate_up_proj.weight"] = torch.cat([gate, up])
        elif ".q_norm." in name or ".k_norm." in name:
            out[name.replace(".self_attn.", ".self_attn.attn.")] = sd.pop(name)
        else:
            out[name] = sd.pop(name)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_load_equals_hf_state_dict(name: str) -> None:
    path = TINY[name]
    model = loaded(path)
    ours = dict(model.named_parameters())
    ref = merged_hf_state(path)
    cfg = ModelConfig.from_path(path)
    if cfg.tie_word_embeddings:
        ref.pop("lm_head.weight", None)  # HF lists the tied copy; we hold it once
    assert sorted(ours) == sorted(ref)
    for key, tensor in ref.items():
        assert ours[key].shape == tensor.shape, key
        assert torch.equal(ours[key], tensor), f"{key} differs from transformers"


@pytest.mark.parametrize("name", NAMES)
def test_tied_lm_head(name: str) -> None:
    path = TINY[name]
    model = loaded(path)
    cfg = ModelConfig.from_path(path)
    hf = hf_model(path)
    assert cfg.tie_word_embeddings == (
        hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    )
    shared = model.lm_head.weight is model.model.embed_tokens.weight
    assert shared == cfg.tie_word_embeddings
    torch.testing.assert_close(model.lm_head.weight, hf.lm_head.weight, rtol=0, atol=0)


def test_per_expert_checkpoint_is_stacked() -> None:
    path = TINY["qwen3-moe"]
    model = loaded(path)
    raw = load_file(str(path / "model.safetensors"))
    cfg = ModelConfig.from_path(path)
    assert cfg.moe is not None
    experts = model.model.layers[1].mlp.experts
    assert experts.gate_up_proj.shape == (
        cfg.moe.num_experts,
        2 * cfg.moe.intermediate_size,
        cfg.hidden_size,
    )
    for e in range(cfg.moe.num_experts):
        prefix = f"model.layers.1.mlp.experts.{e}"
        gate_up = torch.cat([raw[f"{prefix}.gate_proj.weight"], raw[f"{prefix}.up_proj.weight"]])
        assert torch.equal(experts.gate_up_proj[e], gate_up), f"expert {e} gate_up"
        assert torch.equal(experts.down_proj[e], raw[f"{prefix}.down_proj.weight"])


def _copy_with(tmp: Path, src: Path, tensors: dict[str, torch.Tensor]) -> Path:
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, tmp / f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
    return tmp


def test_fused_expert_format_loads_identically(tmp_path: Path) -> None:
    src = need(TINY["qwen3-moe"])
    # transformers 5 holds experts fused: gate_up_proj [E, 2I, H], down_proj [E, H, I].
    fused = dict(hf_model(src).state_dict())
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused)
    path = _copy_with(tmp_path, src, fused)
    ours_fused = dict(loaded(path).named_parameters())
    ours_split = dict(loaded(src).named_parameters())
    assert sorted(ours_fused) == sorted(ours_split)
    for key, tensor in ours_split.items():
        assert torch.equal(ours_fused[key], tensor), key


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    src = need(TINY["llama"])
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(ValueError, match=r"missing model\.layers\.1\.mlp\.down_proj\.weight"):
        load_weights(build(src), _copy_with(tmp_path, src, tensors))


def test_missing_merge_piece_is_named(tmp_path: Path) -> None:
    src = need(TINY["qwen2"])
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.0.self_attn.k_proj.bias"]
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.bias"):
        load_weights(build(src), _copy_with(tmp_path, src, tensors))


def test_missing_expert_tensor_is_named(tmp_path: Path) -> None:
    src = need(TINY["qwen3-moe"])
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    path = _copy_with(tmp_path, src, tensors)
    try:
        load_weights(build(src), path)
    except ValueError as e:
        assert "experts" in str(e) and "3" in str(e), str(e)
    except Exception as e:  # noqa: BLE001 - the bug under test is the exception's type
        pytest.fail(
            "BUG: a per-expert checkpoint missing one expert's up_proj raises "
            f"{type(e).__name__}({e}) instead of a ValueError naming the tensor"
        )
    else:
        pytest.fail("a checkpoint missing an expert tensor loaded without error")


def test_extra_tensor_is_named(tmp_path: Path) -> None:
    src = need(TINY["qwen3"])
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.0.mlp.extra_scale"] = torch.ones(3)
    with pytest.raises(ValueError, match=r"unexpected model\.layers\.0\.mlp\.extra_scale"):
        load_weights(build(src), _copy_with(tmp_path, src, tensors))


def test_tied_checkpoint_may_carry_lm_head(tmp_path: Path) -> None:
    src = need(TINY["llama"])
    assert ModelConfig.from_path(src).tie_word_embeddings
    tensors = load_file(str(src / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    model = loaded(_copy_with(tmp_path, src, tensors))
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_shape_mismatch_is_named(tmp_path: Path) -> None:
    src = need(TINY["llama"])
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(65)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(65,\).*\(64,\)"):
        load_weights(build(src), _copy_with(tmp_path, src, tensors))


def test_shape_mismatch_in_merged_piece_is_named(tmp_path: Path) -> None:
    src = need(TINY["llama"])
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.ones(64, 65)
    path = _copy_with(tmp_path, src, tensors)
    try:
        load_weights(build(src), path)
    except ValueError as e:
        assert "model.layers.0.self_attn.q" in str(e), str(e)
    except Exception as e:  # noqa: BLE001 - the bug under test is the exception's type
        pytest.fail(
            "BUG: a q_proj of the wrong width raises "
            f"{type(e).__name__}({e}) from torch.cat instead of a ValueError naming the tensor"
        )
    else:
        pytest.fail("a q_proj of the wrong width loaded without error")


def test_unsupported_architecture_lists_supported() -> None:
    raw = json.loads((need(TINY["llama"]) / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError) as info:
        create_model(ModelConfig.from_dict(raw))
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    for path in TINY.values():
        arch = json.loads((path / "config.json").read_text())["architectures"][0]
        assert arch in message, f"supported {arch} not listed in: {message}"


def test_no_safetensors_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_weights(build(need(TINY["llama"])), tmp_path)


# ---------------------------------------------------------------- the loaded model runs


def _forward(model, ctx: Context, reqs: list[Req], phase: str, ids: list[list[int]]):
    batch = Batch(reqs, phase)  # type: ignore[arg-type]
    batch.input_ids = torch.tensor([t for seq in ids for t in seq], dtype=torch.int32)
    batch.positions = torch.cat(
        [torch.arange(r.cached_len, r.device_len, dtype=torch.int32) for r in reqs]
    )
    table = ctx.attn_backend.page_table
    batch.out_loc = torch.cat([table[r.table_idx, r.cached_len : r.device_len] for r in reqs])
    ctx.attn_backend.prepare_metadata(batch)
    with torch.no_grad(), ctx.forward_batch(batch):
        return model()


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name: str) -> None:
    # Two prompts prefilled together, then two decode steps, teacher-forced against HF.
    path = TINY[name]
    cfg = ModelConfig.from_path(path)
    model = loaded(path)
    page_size, rows, width = 4, 2, 32
    num_pages = rows * width // page_size
    pool = MHAKVCache(
        cfg.num_layers,
        num_pages,
        page_size,
        cfg.num_kv_heads,
        cfg.head_dim,
        torch.float32,
        torch.device("cpu"),
    )
    # row r owns pages r, r + rows, r + 2 * rows, ...: interleaved, never contiguous
    table = torch.stack(
        [page_slots(list(range(r, num_pages, rows)), page_size) for r in range(rows)]
    )
    backend = TorchAttnBackend(pool, table, cfg.head_dim**-0.5, cfg.num_heads)
    ctx = Context(backend)
    set_global_ctx(ctx)
    try:
        g = torch.Generator().manual_seed(0)
        seqs = [torch.randint(3, 1000, (n + 2,), generator=g).tolist() for n in (9, 14)]
        reqs = [
            Req(torch.tensor(seq[:-2]), row, 0, 4, row, SamplingParams())
            for row, seq in enumerate(seqs)
        ]
        refs = [hf_logits(path, seq) for seq in seqs]
        out = _forward(model, ctx, reqs, "prefill", [seq[:-2] for seq in seqs])
        for step in range(3):
            assert out.shape == (2, cfg.vocab_size) and out.dtype == torch.float32
            for i, r in enumerate(reqs):
                torch.testing.assert_close(
                    out[i],
                    refs[i][r.device_len - 1],
                    rtol=1e-4,
                    atol=1e-4,
                    msg=lambda m, i=i, step=step: f"{name} req {i} step {step}: {m}",
                )
            if step == 2:
                break
            for r in reqs:
                r.complete_one()
            last = [[seq[r.device_len - 1]] for seq, r in zip(seqs, reqs, strict=True)]
            out = _forward(model, ctx, reqs, "decode", last)
    finally:
        set_global_ctx(None)
