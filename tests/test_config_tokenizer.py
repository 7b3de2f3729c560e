"""Chapter 1: ModelConfig against config.json and transformers, Tokenizer against AutoTokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import SMOL, TINY, need, tokenizer

from minisgl.models.config import ModelConfig
from minisgl.tokenizer.tokenizer import Tokenizer

MODEL_DIRS = [SMOL, *TINY.values()]
MODEL_IDS = [path.name for path in MODEL_DIRS]


def _raw(path: Path) -> dict:
    return json.loads((need(path) / "config.json").read_text())


def _llama_dict(**extra) -> dict:
    """A minimal Llama config.json, as a dict, with the given keys added or overridden."""
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    raw.update(extra)
    return raw


# ---------------------------------------------------------------- ModelConfig


@pytest.mark.parametrize("path", MODEL_DIRS, ids=MODEL_IDS)
def test_config_matches_config_json(path: Path) -> None:
    raw = _raw(path)
    cfg = ModelConfig.from_path(path)
    assert cfg.architecture == raw["architectures"][0]
    assert cfg.vocab_size == raw["vocab_size"]
    assert cfg.hidden_size == raw["hidden_size"]
    assert cfg.intermediate_size == raw["intermediate_size"]
    assert cfg.num_layers == raw["num_hidden_layers"]
    assert cfg.num_heads == raw["num_attention_heads"]
    assert cfg.num_kv_heads == raw["num_key_value_heads"]
    assert cfg.rms_norm_eps == raw["rms_norm_eps"]
    assert cfg.max_position_embeddings == raw["max_position_embeddings"]
    assert cfg.tie_word_embeddings == raw["tie_word_embeddings"]
    assert cfg.dtype == raw["dtype"]
    if "head_dim" in raw:
        assert cfg.head_dim == raw["head_dim"]
    else:
        assert cfg.head_dim == raw["hidden_size"] // raw["num_attention_heads"]


@pytest.mark.parametrize("path", MODEL_DIRS, ids=MODEL_IDS)
def test_config_matches_transformers(path: Path) -> None:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(need(path))
    cfg = ModelConfig.from_path(path)
    assert cfg.num_heads == hf.num_attention_heads
    assert cfg.num_kv_heads == hf.num_key_value_heads
    hf_head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert cfg.head_dim == hf_head_dim
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"]
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.attention_bias == getattr(hf, "attention_bias", False)
    assert cfg.sliding_window == getattr(hf, "sliding_window", None)
    if getattr(hf, "num_experts", None):
        assert cfg.moe is not None
        assert cfg.moe.num_experts == hf.num_experts
        assert cfg.moe.top_k == hf.num_experts_per_tok
        assert cfg.moe.intermediate_size == hf.moe_intermediate_size
        assert cfg.moe.norm_topk_prob == hf.norm_topk_prob
        assert cfg.moe.sparse_step == hf.decoder_sparse_step
        assert cfg.moe.dense_layers == tuple(hf.mlp_only_layers)
    else:
        assert cfg.moe is None


def test_head_dim_differs_from_hidden_over_heads() -> None:
    # tiny-qwen3 is built so that head_dim != hidden_size / heads: the shortcut must not win.
    raw = _raw(TINY["qwen3"])
    cfg = ModelConfig.from_path(TINY["qwen3"])
    assert raw["hidden_size"] // raw["num_attention_heads"] != raw["head_dim"]
    assert cfg.head_dim == raw["head_dim"]


def test_kv_heads_default_to_heads() -> None:
    from transformers import LlamaConfig

    raw = _llama_dict()
    assert ModelConfig.from_dict(raw).num_kv_heads == LlamaConfig(**raw).num_key_value_heads


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_theta": 500000.0},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1234.0}},
        {"rope_theta": 77.0, "rope_parameters": {"rope_type": "default", "rope_theta": 77.0}},
        {},
    ],
    ids=["top-level", "rope_parameters", "both", "neither"],
)
def test_rope_theta_forms(rope: dict) -> None:
    from transformers import LlamaConfig

    raw = _llama_dict(**rope)
    expected = LlamaConfig(**raw).rope_parameters["rope_theta"]
    assert ModelConfig.from_dict(raw).rope_theta == expected


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_parameters": {"rope_type": "mrope", "rope_theta": 5e5, "mrope_section": [1]}},
        {"rope_scaling": {"type": "xpos", "factor": 2.0}},
        {"rope_scaling": {"rope_type": "llama4", "factor": 4.0}},
    ],
    ids=["mrope", "legacy-xpos", "llama4"],
)
def test_unsupported_rope_type_is_a_clear_error(rope: dict) -> None:
    params = next(iter(rope.values()))
    name = params.get("rope_type", params.get("type"))
    with pytest.raises(ValueError, match=name):
        ModelConfig.from_dict(_llama_dict(**rope))


@pytest.mark.parametrize("key", ["num_experts", "num_local_experts"])
def test_num_experts_alias(key: str) -> None:
    raw = _llama_dict(
        architectures=["Qwen3MoeForCausalLM"],
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        **{key: 6},
    )
    moe = ModelConfig.from_dict(raw).moe
    assert moe is not None, f"{key} was not recognised as the expert count"
    assert moe.num_experts == 6
    assert moe.top_k == 2
    assert moe.intermediate_size == 32


def test_moe_layer_selection_matches_transformers() -> None:
    # Qwen3-MoE: layer i is sparse iff i not in mlp_only_layers and (i + 1) % step == 0.
    from transformers import Qwen3MoeConfig

    kw = dict(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3])
    raw = _llama_dict(architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=6, **kw)
    moe = ModelConfig.from_dict(raw).moe
    hf = Qwen3MoeConfig(num_hidden_layers=6, **kw)
    assert moe is not None
    for layer in range(6):
        hf_sparse = layer not in hf.mlp_only_layers and (layer + 1) % hf.decoder_sparse_step == 0
        assert moe.is_moe_layer(layer) == hf_sparse, f"layer {layer}"


@pytest.mark.parametrize("use", [False, True, None], ids=["off", "on", "absent"])
def test_sliding_window(use: bool | None) -> None:
    from transformers import MistralConfig, Qwen2Config

    extra = {"sliding_window": 4096}
    if use is None:  # Mistral has no switch: the window always applies
        raw = _llama_dict(architectures=["MistralForCausalLM"], **extra)
        expected = MistralConfig(**raw).sliding_window
    else:
        raw = _llama_dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=use, **extra)
        expected = Qwen2Config(**raw).sliding_window
    assert ModelConfig.from_dict(raw).sliding_window == expected


def test_missing_architectures_is_a_clear_error() -> None:
    raw = _llama_dict()
    del raw["architectures"]
    with pytest.raises(ValueError, match="architectures"):
        ModelConfig.from_dict(raw)
    with pytest.raises(ValueError, match="architectures"):
        ModelConfig.from_dict(_llama_dict(architectures=[]))


def test_missing_config_json_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_path(tmp_path)


def test_unsupported_activation_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="gelu"):
        ModelConfig.from_dict(_llama_dict(hidden_act="gelu"))


def test_torch_dtype_spelling() -> None:
    assert ModelConfig.from_dict(_llama_dict(torch_dtype="bfloat16")).dtype == "bfloat16"


# ---------------------------------------------------------------- Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\n\n\nand   runs of   spaces",
    "Ünïcödé: café, naïve, 日本語のテキスト, emoji 🤖🚀, Ελληνικά",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))",
    '{"key": [1, 2.5, null], "other": "va\\"lue"}',
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "numbers 1234567890 and 3.14159",
    "",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(need(SMOL))


@pytest.fixture(scope="module")
def hf_tok():
    return tokenizer(need(SMOL))


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special", [True, False])
def test_encode_matches_transformers(tok: Tokenizer, hf_tok, text: str, add_special: bool) -> None:
    assert tok.encode(text, add_special_tokens=add_special) == hf_tok.encode(
        text, add_special_tokens=add_special
    )


def test_special_token_text_is_one_token(tok: Tokenizer, hf_tok) -> None:
    ids = tok.encode("<|im_start|>")
    assert ids == [hf_tok.convert_tokens_to_ids("<|im_start|>")]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(tok: Tokenizer, hf_tok, text: str, skip: bool) -> None:
    ids = hf_tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)


def test_decode_skips_special_tokens(tok: Tokenizer, hf_tok) -> None:
    ids = hf_tok.encode("<|im_start|>user\nhi<|im_end|>")
    kept, skipped = tok.decode(ids, skip_special_tokens=False), tok.decode(ids)
    assert "<|im_start|>" in kept and "<|im_end|>" in kept
    assert "<|im_start|>" not in skipped and "<|im_end|>" not in skipped


def test_round_trip(tok: Tokenizer) -> None:
    for text in TEXTS:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


CONVERSATIONS = {
    "single-user": [{"role": "user", "content": "What is 2 + 2?"}],
    "multi-turn": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about cats 🐱."},
    ],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another\nwith a newline."},
    ],
}


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_tok, name: str, gen_prompt: bool
) -> None:
    messages = CONVERSATIONS[name]
    expected = hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=gen_prompt
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=gen_prompt) == expected
    # ... and the rendered prompt tokenises the same way transformers tokenises it.
    hf_ids = hf_tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=gen_prompt, return_dict=True
    )["input_ids"]
    assert tok.encode(expected, add_special_tokens=False) == list(hf_ids)


def test_system_message_replaces_default(tok: Tokenizer) -> None:
    with_system = tok.apply_chat_template(CONVERSATIONS["system"])
    assert with_system.count("<|im_start|>system") == 1
    assert "You are terse." in with_system


@pytest.mark.parametrize("path", MODEL_DIRS, ids=MODEL_IDS)
def test_eos_token_ids(path: Path) -> None:
    tok = Tokenizer(need(path))
    gen = json.loads((path / "generation_config.json").read_text())
    assert 2 in tok.eos_token_ids
    assert gen["eos_token_id"] in tok.eos_token_ids


def test_eos_token_matches_transformers(tok: Tokenizer, hf_tok) -> None:
    # The chat end token (<|im_end|>) and the generation config's id both stop generation.
    assert tok.eos_token == hf_tok.eos_token
    assert hf_tok.eos_token_id in tok.eos_token_ids
    assert tok.vocab_size == len(hf_tok)


def test_missing_tokenizer_json_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer(tmp_path)


def test_no_chat_template_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((SMOL / "tokenizer.json").read_bytes())
    tok = Tokenizer(tmp_path)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
