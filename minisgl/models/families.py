"""What the newer model families add to config.json, read into ModelConfig's terms.

- Every layer may be *sliding* (it attends to the last `sliding_window` positions only) or
  *full*. HF 5 lists them in `layer_types`; older configs imply them: all layers for Mistral
  and Phi-3, layers from `max_window_layers` on for Qwen2 (when `use_sliding_window`), five
  local layers then one global for Gemma 3 (`sliding_window_pattern`).
- RoPE comes in variants (`rope_scaling` in older configs, `rope_parameters` in HF 5), and
  Gemma 3 gives its sliding layers a RoPE of their own (`rope_local_base_freq`, or
  `rope_parameters` keyed by layer type).
- A Gemma 3 checkpoint states only what differs from Gemma 3's defaults, and a multimodal
  one (`Gemma3ForConditionalGeneration`, as Qwen3.5's) keeps its text model's config in
  `text_config` and its weights under a prefix, next to a vision tower that a text server skips.
- A layer may keep no keys at all: Qwen3.5's "linear_attention" layers (Gated DeltaNet) keep a
  fixed-size recurrent state per request instead (`LinearAttention` has its shapes), and
  only the `full_attention` layers have KV pages (`attention_layers`).
- Gemma 4 gives its full layers a KV geometry of their own (`kv_shape`) and lets its last
  `num_kv_shared_layers` layers read an earlier layer's keys instead of storing any
  (`kv_source`); what else its config adds is `Gemma4Text`. Which layer keeps what, and
  where in the KV pool, is `kv_pool_layers` here and kvcache/layout.py for the pool.

Options we cannot honour fail here, at start-up, by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from minisgl.layers.rope_scaling import RopeScaling, parse_rope

if TYPE_CHECKING:
    from minisgl.models.config import ModelConfig

SLIDING, FULL, LINEAR = "sliding_attention", "full_attention", "linear_attention"
_GEMMA3 = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
_GEMMA4 = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")
# Their text model's config in `text_config`.  # [ch31]
_QWEN3_5_MM = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")  # [ch31]
# Gemma3TextConfig's defaults: what a Gemma 3 config.json leaves out.
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
}
# Routers that renormalise their top-k weights, whatever config.json says.  # [ch31]
_ALWAYS_NORMALISED = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")  # [ch31]
_QWEN3_NEXT = "Qwen3NextForCausalLM"  # a hybrid whose config may leave layer_types out  # [ch31]
# Where a multimodal checkpoint keeps its text model's tensors, and what else it holds.
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.", ""))
_NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
             "model.multi_modal_projector.", "model.visual.", "mtp.", "model.embed_vision.",
             "model.audio_tower.", "model.embed_audio.")  # fmt: skip
# Gemma4TextConfig's defaults: what a Gemma 4 config.json may leave out.
GEMMA4_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_144, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 30, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False,
    "sliding_window": 512,
    "global_head_dim": 512, "attention_k_eq_v": False, "num_kv_shared_layers": 0,
    "vocab_size_per_layer_input": 262_144, "hidden_size_per_layer_input": 256,
    "use_double_wide_mlp": False, "enable_moe_block": False,
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                        "full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                           "partial_rotary_factor": 0.25}},
}  # fmt: skip


@dataclass(frozen=True)
class LinearAttention:
    """The shapes of a model's Gated DeltaNet layers (Qwen3.5's "linear_attention" layers)."""

    num_key_heads: int
    num_value_heads: int  # a multiple of num_key_heads: each q/k head serves several
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int  # the causal depthwise conv's width over q, k and v

    @property
    def conv_dim(self) -> int:
        """Channels the conv runs over: q, k and v side by side."""
        return (
            2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim
        )

    def rank_share(self, tp_size: int) -> LinearAttention:
        """One rank's share when the heads are cut over `tp_size` ranks: its key heads and the
        value heads that read them (the ratio kept), so its conv channels, state and
        projections are those of a layer with fewer heads."""
        if self.num_key_heads % tp_size:
            raise ValueError(
                f"linear_num_key_heads {self.num_key_heads} is not divisible by {tp_size}: "
                "the linear-attention heads cannot be cut over that many ranks"
            )
        return replace(
            self,
            num_key_heads=self.num_key_heads // tp_size,
            num_value_heads=self.num_value_heads // tp_size,
        )

    @classmethod
    def of(cls, raw: dict[str, Any]) -> LinearAttention:
        return cls(raw["linear_num_key_heads"], raw["linear_num_value_heads"],
                   raw["linear_key_head_dim"], raw["linear_value_head_dim"],
                   raw.get("linear_conv_kernel_dim", 4))  # fmt: skip


@dataclass(frozen=True)
class Gemma4Text:
    """What Gemma 4's text config adds to a Gemma 3-like decoder."""

    global_head_dim: int  # the full layers' head_dim (sliding layers: `head_dim`)
    global_kv_heads: int  # and their KV heads
    k_eq_v: bool  # full layers have no v_proj: the values come from the keys' projection
    kv_shared_layers: int  # the last this many layers store no KV: they read an earlier one's
    per_layer_dim: int  # the per-layer embedding's width per layer (0: none)
    per_layer_vocab: int  # and its vocabulary
    double_wide_mlp: bool  # a KV-shared layer's MLP is twice as wide

    @classmethod
    def of(cls, raw: dict[str, Any]) -> Gemma4Text:
        return cls(raw["global_head_dim"], raw["num_global_key_value_heads"],
                   bool(raw["attention_k_eq_v"]), raw["num_kv_shared_layers"] or 0,
                   raw["hidden_size_per_layer_input"] or 0, raw["vocab_size_per_layer_input"],
                   bool(raw["use_double_wide_mlp"]))  # fmt: skip


def text_model_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The config of the text model to build: Gemma 3's defaults under what the checkpoint
    states, its `text_config` lifted out of a multimodal one."""
    archs = raw.get("architectures") or []
    # >>> ch31 a hybrid's (Qwen3.5, Qwen3-Next) text config
    if archs and archs[0] in _ALWAYS_NORMALISED:
        raw = {**raw, "norm_topk_prob": True}
        if raw.get("text_config"):  # a multimodal config: where its text model's fields are
            raw["text_config"] = {**raw["text_config"], "norm_topk_prob": True}
    if archs and archs[0] in _QWEN3_5_MM:
        text = {k: v for k, v in (raw.get("text_config") or {}).items() if v is not None}
        tied = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        dtype = text.get("dtype") or raw.get("dtype") or raw.get("torch_dtype")
        return {**text, "architectures": archs, "tie_word_embeddings": tied, "torch_dtype": dtype}
    if archs and archs[0] == _QWEN3_NEXT:
        return qwen3_next_defaults(raw)
    # <<< ch31
    if archs and archs[0] in _GEMMA4:
        return gemma4_text_config(raw)
    if not archs or archs[0] not in _GEMMA3:
        return raw
    multimodal = archs[0] == "Gemma3ForConditionalGeneration"
    text = (raw.get("text_config") or {}) if multimodal else raw
    merged = {**GEMMA3_TEXT_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
    merged["architectures"] = archs
    merged.setdefault("torch_dtype", raw.get("torch_dtype") or raw.get("dtype"))
    merged.setdefault("quantization_config", raw.get("quantization_config"))
    merged["hidden_act"] = merged.pop("hidden_activation")
    for option in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if merged.get(option):
            raise ValueError(f"{archs[0]} with {option}={merged[option]!r} is not supported")
    return merged


def gemma4_text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 4 config's text model in the terms ModelConfig reads: Gemma4TextConfig's
    defaults under what it states, its MoE block's names as Qwen's, and the full layers'
    geometry whether it is written as `global_head_dim` / `num_global_key_value_heads`
    (the published configs) or as a `per_layer_config` (transformers 5 writes it)."""
    archs = raw["architectures"]
    text = (raw.get("text_config") or {}) if archs[0] == _GEMMA4[1] else raw
    merged = {**GEMMA4_TEXT_DEFAULTS, **text}  # None is a value here (no PLE, no soft-cap)
    for key in ("rope_parameters", "global_head_dim", "hidden_activation"):
        merged[key] = merged[key] or GEMMA4_TEXT_DEFAULTS[key]
    merged["architectures"] = archs
    merged.setdefault("torch_dtype", raw.get("torch_dtype") or raw.get("dtype"))
    merged.setdefault("quantization_config", raw.get("quantization_config"))
    merged["hidden_act"] = merged.pop("hidden_activation")
    if merged.get("use_bidirectional_attention"):
        raise ValueError(f"{archs[0]} with use_bidirectional_attention is not supported")
    n = merged["num_hidden_layers"]
    types = list(merged.get("layer_types") or (SLIDING if (i + 1) % 6 else FULL for i in range(n)))
    types[-1] = FULL  # as transformers does: the last layer always attends to everything
    merged["layer_types"] = types
    if merged["enable_moe_block"]:  # routed experts beside every layer's dense MLP
        merged.update(num_experts_per_tok=merged["top_k_experts"], norm_topk_prob=True)
    else:
        merged.pop("num_experts", None)
    head_dim, kv_heads = merged["head_dim"], merged["num_key_value_heads"]
    full = [str(i) for i, t in enumerate(types) if t == FULL]
    if (per_layer := merged.get("per_layer_config")) is not None:
        overrides = {str(int(k)): v for k, v in per_layer.items()}  # "05" or 5: layer 5
        if set(overrides) - set(full) or len({json.dumps(overrides.get(i), sort_keys=True)
                                              for i in full}) > 1:  # fmt: skip
            raise ValueError(
                f"per_layer_config {per_layer} is not one override of every full layer"
            )
        one = overrides.get(full[0]) or {}
        if set(one) - {"head_dim", "num_key_value_heads"}:
            raise ValueError(f"per_layer_config overrides {sorted(one)}: only the geometry is read")
        merged["global_head_dim"] = one.get("head_dim", head_dim)
        merged["num_global_key_value_heads"] = one.get("num_key_value_heads", kv_heads)
    elif not (merged["attention_k_eq_v"] and merged.get("num_global_key_value_heads")):
        merged["num_global_key_value_heads"] = kv_heads  # only K=V models have their own
    shared = merged["num_kv_shared_layers"] = merged["num_kv_shared_layers"] or 0
    if shared and (shared >= n or set(types[n - shared :]) - set(types[: n - shared])):
        raise ValueError(
            f"num_kv_shared_layers {shared} of {n}: every KV-shared layer needs an earlier "
            "layer of its kind to read"
        )
    return merged


def qwen3_next_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """What a Qwen3-Next config.json may leave out: its layer types (every
    `full_attention_interval`-th layer attends, the rest are linear) and its partial RoPE."""
    raw = dict(raw)
    if not raw.get("layer_types"):
        every = raw.get("full_attention_interval") or 4
        n = raw["num_hidden_layers"]
        raw["layer_types"] = [LINEAR if (i + 1) % every else FULL for i in range(n)]
    if "partial_rotary_factor" not in {**raw, **(raw.get("rope_parameters") or {})}:
        raw["partial_rotary_factor"] = 0.25
    return raw


def family_fields(raw: dict[str, Any], head_dim: int, sliding_window: int | None) -> dict:
    """ModelConfig's fields for layer types, RoPE variants and Gemma's scalings."""
    arch = (raw.get("architectures") or [""])[0]
    gemma, gemma4 = arch in _GEMMA3 + _GEMMA4, arch in _GEMMA4
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    nested = FULL in params or SLIDING in params  # HF 5: one RoPE per layer type
    full = (params.get(FULL) or {}) if nested else params
    full_dim = raw["global_head_dim"] if gemma4 else head_dim
    rope = parse_rope(full, raw, full_dim, raw.get("rope_theta", 10000.0))
    scalar = raw.get("query_pre_attn_scalar") if gemma else None
    scalar = 1.0 if gemma4 else scalar  # q and k normalised per head, the scores unscaled
    local: RopeScaling | None = None
    if gemma or nested:
        local_params = (params.get(SLIDING) or {}) if nested else {}
        local = parse_rope(local_params, raw, head_dim, raw.get("rope_local_base_freq", 10000.0))
    return {
        "rope": rope,
        "local_rope": local,
        "layer_types": (types := _layer_types(raw, sliding_window)),
        "linear": LinearAttention.of(raw) if LINEAR in types else None,
        "hidden_act": raw.get("hidden_act", "silu"),
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": raw.get("final_logit_softcapping") if gemma else None,
        "gemma4": Gemma4Text.of(raw) if gemma4 else None,
    }


def _layer_types(raw: dict[str, Any], sliding_window: int | None) -> tuple[str, ...]:
    n = raw["num_hidden_layers"]
    if (types := raw.get("layer_types")) and LINEAR in types:  # a hybrid: Qwen3.5
        if len(types) != n or set(types) - {LINEAR, FULL}:
            raise ValueError(f"layer_types {types} are not {n} of {LINEAR!r} / {FULL!r}")
        return tuple(types)
    if sliding_window is None:
        return (FULL,) * n
    if types := raw.get("layer_types"):
        if len(types) != n or set(types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types {types} are not {n} of {SLIDING!r} / {FULL!r}")
        return tuple(types)
    arch = (raw.get("architectures") or [""])[0]
    if arch in _GEMMA3:  # Gemma 4's are always written out (gemma4_text_config)
        pattern = raw.get("sliding_window_pattern", 6)
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(n))
    if arch == "Qwen2ForCausalLM":
        first = raw.get("max_window_layers", 28)
        return tuple(SLIDING if i >= first else FULL for i in range(n))
    return (SLIDING,) * n


def context_length(config: ModelConfig) -> int:
    """How many positions the model serves: yarn and dynamic NTK stretch the context the
    config states by their factor."""
    return config.rope.context_length if config.rope else config.max_position_embeddings


def sliding(config: ModelConfig, layer_id: int) -> bool:
    return config.sliding_window is not None and config.layer_types[layer_id] == SLIDING


def attention_layers(config: ModelConfig) -> list[int]:
    """The layers that keep keys and values (every layer but a hybrid's linear ones): the KV
    pool holds these alone, and layer i of them is the pool's layer i."""
    types = config.layer_types or (FULL,) * config.num_layers
    return [i for i, kind in enumerate(types) if kind != LINEAR]


def kv_source(config: ModelConfig, layer_id: int) -> int:
    """The layer whose keys and values layer `layer_id` attends over: its own, or for one of
    Gemma 4's last `num_kv_shared_layers` layers, those of the last layer of its kind (sliding
    or full) before them, as transformers' `kv_sharing_modes` says."""
    first_shared = config.num_layers - (config.gemma4.kv_shared_layers if config.gemma4 else 0)
    if layer_id < first_shared:
        return layer_id
    kind = config.layer_types[layer_id]
    return max(i for i in range(first_shared) if config.layer_types[i] == kind)


def kv_shape(config: ModelConfig, layer_id: int) -> tuple[int, int]:
    """(KV heads, head_dim) of layer `layer_id`, all ranks': Gemma 4's full layers have their
    own (512-dim heads, and fewer of them where keys are values)."""
    g = config.gemma4
    if g is not None and config.layer_types[layer_id] == FULL:
        return g.global_kv_heads, g.global_head_dim
    return config.num_kv_heads, config.head_dim


def kv_head_counts(config: ModelConfig) -> dict[str, int]:
    """Every count of KV heads the layers have, by its config name: tensor parallelism must
    split (or replicate) each of them, Gemma 4's full layers' as well as the others'."""
    counts = {"num_key_value_heads": config.num_kv_heads}
    if config.gemma4 is not None and FULL in config.layer_types:
        counts["num_global_key_value_heads"] = config.gemma4.global_kv_heads
    return counts


def kv_pool_layers(config: ModelConfig) -> list[int | None]:
    """Each layer's layer in the KV pool: the layers that store keys, numbered in order; a
    KV-shared layer reads its source's; a linear layer keeps none (None)."""
    storing = [i for i in attention_layers(config) if kv_source(config, i) == i]
    place = {layer: k for k, layer in enumerate(storing)}
    return [
        place[kv_source(config, i)] if i in attention_layers(config) else None
        for i in range(config.num_layers)
    ]


def layer_rope(config: ModelConfig, layer_id: int) -> RopeScaling | None:
    """The RoPE that layer `layer_id` turns q and k by, with its table's length."""
    c = config
    rope = c.local_rope if c.local_rope and sliding(c, layer_id) else c.rope
    return rope.for_context(c.rope_context or context_length(c)) if rope else None


def text_model_name(name: str, model: Any = None) -> str | None:
    """A checkpoint tensor's name in our text model; None for a tensor it does not load: a
    vision tower's, or one the model itself leaves out (its `checkpoint_name` says None)."""
    if name.startswith(_NOT_TEXT):
        return None
    for prefix, ours in _TEXT_PREFIXES:
        if name.startswith(prefix):
            name = ours + name[len(prefix) :]
            break
    rename = getattr(model, "checkpoint_name", None)
    return rename(name) if rename is not None else name
