"""RoPE variants: the frequencies (and scale) that long-context checkpoints ask for.

Plain RoPE turns channel pair i of a head by `position * theta ** (-2i / d)`. A model trained
on 8K positions and stretched to 128K changes those frequencies, each variant its own way:

- `linear`: every frequency divided by `factor` (positions squeezed into the trained range);
- `dynamic` (NTK): theta itself grows with the length, so low frequencies stretch most;
- `llama3`: frequencies with a wavelength longer than the trained context are divided by
  `factor`, short ones kept, those between blended smoothly;
- `yarn`: the same ramp between kept and divided frequencies, measured in rotations over the
  trained context (`beta_fast`, `beta_slow`), plus an *attention factor* that scales cos and
  sin, and with them every attention score, by about `0.1 ln(factor) + 1`;
- `longrope` (Phi-3, Phi-4-mini): a factor per frequency, one list for short contexts and
  one for long ones, and an attention factor from the stretch.

`partial_rotary_factor` rotates only the first channels of a head; the rest pass unrotated.
`proportional` (Gemma 4's global layers) turns a share of the channel *pairs* of the whole
head instead: the frequencies are those of the full head, the first `factor x pairs` of
them kept and the rest zero, so pair i still joins channels i and i + head_dim / 2.

All of them change only the per-position table of cos and sin that the layers (and the fused
rotary kernel) gather rows from, so nothing downstream knows which variant it runs.
Where Hugging Face recomputes frequencies by the length of the sequence at hand (dynamic,
longrope), the table is computed once for the engine's context: every position of every
request is turned by the same frequencies, so a cached key never disagrees with a query, a
batch does not change a request's result, and the radix cache can share any prefix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "proportional")
ROPE_ALIASES = {"su": "longrope"}  # the name early Phi-3 configs used


@dataclass(frozen=True)
class RopeScaling:
    """One layer's RoPE as its config describes it, and the table length it is built for."""

    rope_type: str
    theta: float
    rotary_dim: int  # the first rotary_dim channels of a head rotate; the rest pass
    max_position: int  # the model's max_position_embeddings
    factor: float = 1.0
    original_max_position: int = 0  # the context the model was pretrained on
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float = 0.0  # yarn (DeepSeek): attention factor numerator's weight
    mscale_all_dim: float = 0.0  # yarn (DeepSeek): its denominator's
    truncate: bool = True  # yarn: round the ramp's ends to whole channels
    attention_factor: float | None = None  # yarn, longrope: None means derived from factor
    short_factor: tuple[float, ...] = ()  # longrope
    long_factor: tuple[float, ...] = ()  # longrope
    context: int = 0  # positions in the table: the engine's context length
    turned: float = 1.0  # proportional: the share of the head's channel pairs that turn

    def for_context(self, context: int) -> RopeScaling:
        """The same RoPE with its table built for `context` positions."""
        return replace(self, context=context)

    @property
    def context_length(self) -> int:
        """How many positions the model serves: yarn and dynamic NTK stretch the trained
        context by their factor; the others state the stretched length in the config."""
        if self.rope_type == "yarn" and self.original_max_position:
            return max(self.max_position, int(self.original_max_position * self.factor))
        if self.rope_type == "dynamic":
            return int(self.max_position * self.factor)
        return self.max_position


def parse_rope(
    params: dict[str, Any], raw: dict[str, Any], head_dim: int, default_theta: float
) -> RopeScaling:
    """A RoPE from one `rope_parameters` / `rope_scaling` dict (possibly empty) and the
    config around it (`raw`: partial_rotary_factor, max_position_embeddings and Phi-3's
    top-level original_max_position_embeddings); `default_theta` where the dict has no
    rope_theta. Unknown types are refused by name."""
    rope_type = params.get("rope_type", params.get("type")) or "default"
    rope_type = ROPE_ALIASES.get(rope_type, rope_type)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {ROPE_TYPES}")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor")) or 1.0
    max_position = raw.get("max_position_embeddings", 2048)
    original = raw.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings"
    )
    factor = params.get("factor")
    if factor is None and rope_type in ("yarn", "longrope") and original:
        factor = max_position / original  # Phi-3, DeepSeek: the stretch is the ratio
    proportional = rope_type == "proportional"  # a table as wide as the head
    rope = RopeScaling(
        rope_type=rope_type,
        theta=float(params.get("rope_theta", default_theta)),
        rotary_dim=head_dim if proportional else int(head_dim * partial),
        max_position=max_position,
        factor=float(factor or 1.0),
        original_max_position=int(original or max_position),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=params.get("attention_factor"),
        short_factor=tuple(params.get("short_factor") or ()),
        long_factor=tuple(params.get("long_factor") or ()),
        turned=float(partial) if proportional else 1.0,
    )
    if rope.rotary_dim % 2 or not 0 < rope.rotary_dim <= head_dim:
        raise ValueError(f"partial_rotary_factor {partial} turns {rope.rotary_dim} channels")
    if rope_type == "longrope" and not (
        len(rope.short_factor) == len(rope.long_factor) == rope.rotary_dim // 2
    ):
        raise ValueError(
            f"longrope needs {rope.rotary_dim // 2} short and long factors, one per frequency"
        )
    return rope


def frequencies(rope: RopeScaling, device: torch.device) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2] in fp32, the scale of cos and sin) for a table
    of `rope.context` positions."""
    dim, theta = rope.rotary_dim, rope.theta
    if rope.rope_type == "dynamic" and rope.context > rope.max_position:
        # theta grows with the length; the table's length is the one it is computed for
        stretch = rope.factor * rope.context / rope.max_position - (rope.factor - 1)
        theta = theta * stretch ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device, torch.float) / dim
    inv_freq = 1.0 / theta**exponents
    kind = rope.rope_type
    if kind == "linear":
        return inv_freq / rope.factor, 1.0
    if kind == "llama3":
        return _llama3(rope, inv_freq), 1.0
    if kind == "yarn":
        return _yarn(rope, inv_freq, exponents), _yarn_attention_factor(rope)
    if kind == "longrope":
        return _longrope(rope, exponents), _longrope_attention_factor(rope)
    if kind == "proportional":  # the first pairs turn as in a full head's table; the rest not
        still = torch.arange(dim // 2, device=inv_freq.device) >= int(rope.turned * dim // 2)
        return inv_freq.masked_fill(still, 0.0) / rope.factor, 1.0
    return inv_freq, 1.0  # default, dynamic


def _llama3(rope: RopeScaling, inv_freq: torch.Tensor) -> torch.Tensor:
    trained = rope.original_max_position
    wavelength = 2 * math.pi / inv_freq
    long_waves = wavelength > trained / rope.low_freq_factor  # divided by the factor
    short_waves = wavelength < trained / rope.high_freq_factor  # kept
    # between them: a blend whose weight on "kept" rises with the number of turns
    smooth = (trained / wavelength - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
    out = torch.where(long_waves, inv_freq / rope.factor, blended)
    return torch.where(short_waves, inv_freq, out)


def _yarn(rope: RopeScaling, inv_freq: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    dim, trained = rope.rotary_dim, rope.original_max_position

    def channel_of(turns: float) -> float:
        """The channel whose frequency makes `turns` turns over the trained context."""
        return dim * math.log(trained / (turns * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = channel_of(rope.beta_fast), channel_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp.to(inv_freq.device)  # 1: channels that turn fast enough to keep as they are
    return inv_freq / rope.factor * (1 - keep) + inv_freq * keep


def _yarn_attention_factor(rope: RopeScaling) -> float:
    if rope.attention_factor is not None:
        return float(rope.attention_factor)

    def m(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return m(rope.factor, rope.mscale) / m(rope.factor, rope.mscale_all_dim)
    return m(rope.factor)


def _longrope(rope: RopeScaling, exponents: torch.Tensor) -> torch.Tensor:
    # Long factors once the engine serves more than the pretrained context, for all positions.
    long = rope.context > rope.original_max_position
    factors = torch.tensor(
        rope.long_factor if long else rope.short_factor, dtype=torch.float, device=exponents.device
    )
    return 1.0 / (factors * rope.theta**exponents)


def _longrope_attention_factor(rope: RopeScaling) -> float:
    if rope.attention_factor is not None:
        return float(rope.attention_factor)
    if rope.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_position))
