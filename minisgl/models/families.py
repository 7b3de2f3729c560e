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
- A layer may keep no keys at all: Qwen3.5's `linear_attention` layers (Gated DeltaNet) keep a
  fixed-size recurrent state per request instead (`LinearAttention` has its shapes), and
  only the `full_attention` layers have KV pages (`attention_layers`).

Options we cannot honour fail here, at start-up, by name.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from minisgl.layers.rope_scaling import RopeScaling, parse_rope

if TYPE_CHECKING:
    from minisgl.models.config import ModelConfig

SLIDING, FULL, LINEAR = "sliding_attention", "full_attention", "linear_attention"
_GEMMA3 = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
# Their text model's config in `text_config`.
_QWEN3_5_MM = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
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
# Routers that renormalise their top-k weights whatever config.json says (or leaves out).
_ALWAYS_NORMALISED = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")
_QWEN3_NEXT = "Qwen3NextForCausalLM"  # a hybrid whose config may leave layer_types out
# Where a multimodal checkpoint keeps its text model's tensors, and what else it holds.
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.", ""))
_NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
             "model.multi_modal_projector.", "model.visual.", "mtp.")  # fmt: skip


@dataclass(frozen=True)
class LinearAttention:
    """The shapes of a model's Gated DeltaNet layers (Qwen3.5's `linear_attention`)."""

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


def text_model_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The config of the text model to build: Gemma 3's defaults under what the checkpoint
    states, its `text_config` lifted out of a multimodal one."""
    archs = raw.get("architectures") or []
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
    gemma = (raw.get("architectures") or [""])[0] in _GEMMA3
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    nested = FULL in params or SLIDING in params  # HF 5: one RoPE per layer type
    full = (params.get(FULL) or {}) if nested else params
    rope = parse_rope(full, raw, head_dim, raw.get("rope_theta", 10000.0))
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
        "query_pre_attn_scalar": raw.get("query_pre_attn_scalar") if gemma else None,
        "final_logit_softcapping": raw.get("final_logit_softcapping") if gemma else None,
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
    if arch in _GEMMA3:
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


def layer_rope(config: ModelConfig, layer_id: int) -> RopeScaling | None:
    """The RoPE that layer `layer_id` turns q and k by, with its table's length."""
    c = config
    rope = c.local_rope if c.local_rope and sliding(c, layer_id) else c.rope
    return rope.for_context(c.rope_context or context_length(c)) if rope else None


def text_model_name(name: str) -> str | None:
    """A checkpoint tensor's name in our text model; None for a vision tower's tensors."""
    if name.startswith(_NOT_TEXT):
        return None
    for prefix, ours in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return ours + name[len(prefix) :]
    return name
