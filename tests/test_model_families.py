"""More model families against Hugging Face: RoPE variants, sliding windows, Gemma 3, Phi-3.

Each tiny model is built here from a fixed seed (fp32, random weights) and compared with
transformers under teacher forcing: a prefill in two chunks (the second over the cached
first, as the radix cache and chunked prefill run it), then decode steps, with pages of 1
and 16 tokens; the prompts are longer than the sliding windows and than longrope's
pretrained context. The published config.json of real checkpoints (written here from their
published values) must parse and size the engine as their model cards say.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from flashinfer_stub import fake_fi, use_fi  # noqa: F401 (a fixture)
from helpers import TINY, Driver, all_logits, make_engine, need

from minisgl.core import SamplingParams
from minisgl.kvcache.mha_pool import MHAKVCache
from minisgl.llm import LLM
from minisgl.models.config import ModelConfig
from minisgl.models.families import context_length, layer_rope, sliding
from minisgl.models.register import create_model

TOL = 1e-4
SEQ = 40  # tokens per teacher-forced sequence: more than any window or pretrained context
WINDOW = 8
BASE: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip


def rope(kind: str, **params: Any) -> dict[str, Any]:
    return {"rope_parameters": {"rope_type": kind, "rope_theta": 10000.0, **params}}


def phi3(**kw: Any) -> Any:
    from transformers import Phi3Config

    rot = 12  # head_dim 16, partial_rotary_factor 0.75: 6 frequencies
    return Phi3Config(
        **{**BASE, "max_position_embeddings": 128},
        original_max_position_embeddings=32,
        partial_rotary_factor=0.75,
        **rope(
            "longrope",
            partial_rotary_factor=0.75,
            original_max_position_embeddings=32,
            short_factor=[1.0 + 0.1 * i for i in range(rot // 2)],
            long_factor=[2.0 + 0.5 * i for i in range(rot // 2)],
        ),  # fmt: skip
        architectures=["Phi3ForCausalLM"],
        **kw,
    )


def gemma3_text(**kw: Any) -> dict[str, Any]:
    return dict(
        **BASE, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1e6}},
        **kw,
    )  # fmt: skip


def configs() -> dict[str, Any]:
    from transformers import (
        Gemma3Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        SiglipVisionConfig,
    )

    llama = dict(BASE, architectures=["LlamaForCausalLM"], tie_word_embeddings=True)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    return {
        "llama3": LlamaConfig(**llama, **rope("llama3", factor=8.0, low_freq_factor=1.0,
                              high_freq_factor=4.0, original_max_position_embeddings=16)),
        "linear": LlamaConfig(**llama, **rope("linear", factor=2.0)),
        # dynamic NTK's base is the one for the engine's context, max_position * factor = SEQ
        "dynamic": LlamaConfig(**{**llama, "max_position_embeddings": SEQ // 2},
                               **rope("dynamic", factor=2.0)),
        "yarn": Qwen2Config(**BASE, **rope("yarn", factor=4.0, original_max_position_embeddings=16),
                            architectures=["Qwen2ForCausalLM"]),
        "phi3": phi3(),
        "mistral": MistralConfig(**BASE, sliding_window=WINDOW,
                                 architectures=["MistralForCausalLM"]),
        # layer 0 global, layer 1 sliding (from max_window_layers on)
        "qwen2-window": Qwen2Config(**BASE, use_sliding_window=True, sliding_window=WINDOW,
                                    max_window_layers=1, architectures=["Qwen2ForCausalLM"]),
        "gemma3": Gemma3TextConfig(**gemma3_text(final_logit_softcapping=30.0),
                                   architectures=["Gemma3ForCausalLM"]),
        # (transformers' multimodal class soft-caps no logits; Gemma 3's configs cap none)
        "gemma3-mm": Gemma3Config(text_config=Gemma3TextConfig(**gemma3_text()),
                                  vision_config=vision, mm_tokens_per_image=4,
                                  architectures=["Gemma3ForConditionalGeneration"]),
    }  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each tiny model saved once (seed 0), with the tiny Llama's tokenizer."""
    from transformers import AutoModelForCausalLM, Gemma3ForConditionalGeneration

    root, tok = tmp_path_factory.mktemp("families"), need(TINY["llama"])
    out = {}
    for name, cfg in configs().items():
        torch.manual_seed(0)
        if name == "gemma3-mm":
            model = Gemma3ForConditionalGeneration(cfg)
        else:
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.save_pretrained(root / name)
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tok / f).is_file():
                shutil.copy(tok / f, root / name / f)
        out[name] = root / name
    return out


def token_ids(seed: int, n: int = SEQ) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_reference(path: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, Gemma3ForConditionalGeneration

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    cls = Gemma3ForConditionalGeneration if arch.endswith("Generation") else AutoModelForCausalLM
    model = cls.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def teacher_forced(engine, ids: list[int], decode: int = 4) -> torch.Tensor:
    """Logits at every position: prefill [0, 17), then up to len - decode over the cached
    17, then one decode step per remaining token."""
    driver = Driver(engine)
    req = driver.add(ids[: len(ids) - decode], SamplingParams(max_tokens=decode + 1), row=2)
    out = []
    for end in (17, len(ids) - decode):
        req.device_len = end
        out.append(all_logits(engine, [req], "prefill"))
    for pos in range(len(ids) - decode, len(ids)):
        engine.token_pool[req.table_idx, pos] = ids[pos]  # the reference's next token
        req.append_host(ids[pos])
        out.append(all_logits(engine, [req], "decode"))
    return torch.cat(out)


MODELS = ["llama3", "linear", "dynamic", "yarn", "phi3", "mistral", "qwen2-window", "gemma3",
          "gemma3-mm"]  # fmt: skip


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", MODELS)
def test_logits_equal_transformers(folders, name: str, page_size: int) -> None:
    ids = token_ids(MODELS.index(name))
    engine = make_engine(folders[name], page_size=page_size)
    got = teacher_forced(engine, ids)
    assert (got - hf_reference(folders[name], ids)).abs().max().item() <= TOL


def test_longrope_short_factors_within_the_pretrained_context(folders) -> None:
    """An engine that serves no more than the pretrained 32 positions turns by the short
    factors, as Hugging Face does for a sequence that short; one that serves more, by the
    long ones (the test above)."""
    ids = token_ids(7, 30)
    engine = make_engine(folders["phi3"], max_seq_len_override=32)
    rope = engine.model.model.layers[0].self_attn.attn.rotary
    assert rope.rotary_dim == 12 and rope.cos_sin.shape[1] == 12
    got = teacher_forced(engine, ids)
    assert (got - hf_reference(folders["phi3"], ids)).abs().max().item() <= TOL


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_triton_kernels_with_windows(folders, name: str) -> None:
    """Our Triton kernels (in the interpreter) honour each layer's window."""
    ids = token_ids(11)
    engine = make_engine(folders[name], page_size=16, attention_backend="triton")
    assert engine.attn_backend.windows == ((WINDOW,) * 2 if name == "mistral" else (WINDOW, None))
    got = teacher_forced(engine, ids)
    assert (got - hf_reference(folders[name], ids)).abs().max().item() <= TOL


@pytest.mark.parametrize("name", ["mistral", "phi3"])
def test_fused_decode_kernel_is_not_asked_for_windows_or_partial_rotary(folders, name) -> None:
    """The one-kernel decode of the Triton backend turns whole heads over every key: a
    sliding layer (Mistral) or a partial rotary (Phi-3) goes the three-kernel way."""
    engine = make_engine(folders[name], attention_backend="triton")
    layer = engine.model.model.layers[0].self_attn.attn
    qkv = torch.zeros(1, (layer.num_heads + 2 * layer.num_kv_heads) * layer.head_dim)
    assert engine.attn_backend.decode_from_qkv(layer, qkv, None) is None


def test_flashinfer_plans_one_wrapper_per_window(folders, fake_fi) -> None:  # noqa: F811
    """FlashInfer (chapter 19's stand-in, tests/flashinfer_stub.py) plans one wrapper per window and
    runs each layer on its own: Qwen2 with a global layer, then a sliding one (in the same
    pages: FlashInfer reads one page table)."""
    ids = token_ids(12)
    engine = make_engine(folders["qwen2-window"], page_size=4, window_pages=0)
    fi = use_fi(engine, [])
    fi.set_windows([None, WINDOW])
    assert set(fi.prefill_wrappers) == set(fi.decode_wrappers) == {WINDOW, None}
    got = teacher_forced(engine, ids)
    assert (got - hf_reference(folders["qwen2-window"], ids)).abs().max().item() <= TOL


def test_served_with_radix_cache_and_graphs_as_each_alone(folders) -> None:
    """Gemma 3 through the scheduler: a shared prefix from the radix cache, chunked prefill,
    emulated decode graphs; every request gets the tokens it gets alone."""
    path = str(folders["gemma3"])
    shared = token_ids(20, 24)
    prompts = [shared + token_ids(21 + i, 3 + 5 * i) for i in range(3)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    kw = dict(device="cpu", max_running_req=4, num_page_override=64, page_size=4,
              max_prefill_length=16)  # fmt: skip
    alone = []
    for p in prompts:
        llm = LLM(path, cuda_graph_max_bs=0, **kw)
        alone.append(llm.generate([p], params, use_tqdm=False)[0]["token_ids"])
        llm.shutdown()
    llm = LLM(path, cuda_graph_max_bs=4, **kw)
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    rest = llm.generate(prompts[1:], params, use_tqdm=False)  # their prefix is cached now
    llm.shutdown()
    assert [o["token_ids"] for o in first + rest] == alone


def test_context_is_max_position_embeddings_not_the_window(folders) -> None:
    engine = make_engine(folders["mistral"], num_page_override=8)
    assert engine.max_seq_len == 64  # the window is 8


def test_unsupported_options_fail_at_start_by_name() -> None:
    raw = {**BASE, "architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": 50.0}
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        ModelConfig.from_dict(raw)
    config = ModelConfig.from_dict({**BASE, "architectures": ["Phi4MMForCausalLM"]})
    with pytest.raises(ValueError, match=r"Phi4MMForCausalLM.*Gemma3ForCausalLM"):
        create_model(config)
    with pytest.raises(ValueError, match="longrope needs 8 short and long factors"):
        bad = rope("longrope", short_factor=[1.0], long_factor=[1.0])
        ModelConfig.from_dict({**BASE, "architectures": ["Phi3ForCausalLM"], **bad})


# ---- the published configs of real checkpoints --------------------------------------------

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}  # fmt: skip
PHI4_LONG = [
    1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817,
    2.187582649, 2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687,
    4.279200023, 4.785517845, 5.351743533, 5.984965424, 6.693110555, 7.485043894,
    8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651, 14.64173252,
    16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884, 32.03,
    32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49,
    33.5, 44.16, 47.77,
]  # fmt: skip
PUBLISHED: dict[str, dict[str, Any]] = {
    "Llama-3.1-8B-Instruct": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "hidden_act": "silu",
        "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 131072,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_scaling": LLAMA3, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
    },
    "Llama-3.2-1B-Instruct": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "head_dim": 64,
        "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192,
        "max_position_embeddings": 131072, "num_attention_heads": 32, "num_hidden_layers": 16,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_scaling": {**LLAMA3, "factor": 32.0}, "rope_theta": 500000.0,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 128256,
    },
    "Qwen2.5-7B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 3584,
        "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28,
        "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
        "vocab_size": 152064,
    },
    "Mistral-7B-Instruct-v0.1": {
        "architectures": ["MistralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "vocab_size": 32000,
    },
    "Mistral-7B-Instruct-v0.3": {
        "architectures": ["MistralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "vocab_size": 32768,
    },
    "gemma-3-1b-it": {
        "architectures": ["Gemma3ForCausalLM"], "attention_bias": False,
        "attn_logit_softcapping": None, "final_logit_softcapping": None, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
        "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
        "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
        "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "vocab_size": 262144,
    },
    "Phi-4-mini-instruct": {
        "architectures": ["Phi3ForCausalLM"], "attention_bias": False, "hidden_act": "silu",
        "hidden_size": 3072, "intermediate_size": 8192, "max_position_embeddings": 131072,
        "num_attention_heads": 24, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
        "rms_norm_eps": 1e-05, "rope_scaling": {"long_factor": PHI4_LONG,
                                               "short_factor": [1.0] * 48, "type": "longrope"},
        "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "vocab_size": 200064,
    },
}  # fmt: skip
# (parameters as the model cards count them, context served, KV bytes per token in bf16,
#  the RoPE type and channels turned, the sliding layers and their window)
EXPECTED = {
    "Llama-3.1-8B-Instruct": (8_030_261_248, 131072, 131072, "llama3", 128, 0, None),
    "Llama-3.2-1B-Instruct": (1_235_814_400, 131072, 32768, "llama3", 64, 0, None),
    "Qwen2.5-7B-Instruct": (7_615_616_512, 32768, 57344, "default", 128, 0, None),
    "Mistral-7B-Instruct-v0.1": (7_241_732_096, 32768, 131072, "default", 128, 32, 4096),
    "Mistral-7B-Instruct-v0.3": (7_248_023_552, 32768, 131072, "default", 128, 0, None),
    "gemma-3-1b-it": (999_885_952, 32768, 26624, "default", 256, 22, 512),
    "Phi-4-mini-instruct": (3_836_021_760, 131072, 131072, "longrope", 96, 32, 262144),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_config_parses_and_sizes_the_engine(name: str) -> None:
    params, context, kv_bytes, rope_type, rotated, sliding_layers, window = EXPECTED[name]
    config = ModelConfig.from_dict(PUBLISHED[name])
    assert context_length(config) == context
    per_token = MHAKVCache.bytes_per_page(
        config.num_layers, 1, config.num_kv_heads, config.head_dim, torch.bfloat16
    )
    assert per_token == kv_bytes
    assert config.rope is not None and config.rope.rope_type == rope_type
    assert config.rope.rotary_dim == rotated
    assert sum(sliding(config, i) for i in range(config.num_layers)) == sliding_layers
    assert config.sliding_window == window
    with torch.device("meta"):
        model = create_model(config)
    assert sum(p.numel() for p in model.parameters()) == params


def test_qwen25_yarn_recipe_serves_128k() -> None:
    """The model card's recipe for long inputs: yarn, factor 4 over the 32K it was trained on."""
    yarn = {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}
    config = ModelConfig.from_dict({**PUBLISHED["Qwen2.5-7B-Instruct"], "rope_scaling": yarn})
    assert context_length(config) == 131072
    assert layer_rope(config, 0).context == 131072  # its table covers every position
