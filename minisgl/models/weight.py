"""Loading a Hugging Face safetensors checkpoint into a minisgl model.

Our models keep Hugging Face's parameter names except where we merge tensors to save
matmuls: q/k/v -> qkv_proj, gate/up -> gate_up_proj, and per-expert MLP weights ->
one stacked tensor per projection. Anything left over, or missing, is an error that
names the tensors: a silently half-loaded model produces fluent nonsense.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from minisgl.layers.parallel import read_rank_slice  # [ch21]
from minisgl.models.families import text_model_name  # [ch29]
from minisgl.quant.kv_scales import KVScales  # [ch28]
from minisgl.quant.load import Fp8Loader  # [ch28]

logger = logging.getLogger(__name__)

# Pieces that are concatenated (along dim 0) into one of our tensors, in this order.
_MERGES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_MERGE_RE = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
# Checkpoints that store one MLP per expert: ...experts.3.gate_proj.weight
_EXPERT_RE = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")

# Where a checkpoint tensor goes: (our parameter, expert or None, part or None). The part
# is its place among the pieces merged into the parameter; None when it is all of them.
Place = tuple[str, int | None, int | None]


def place(name: str) -> Place:
    if m := _EXPERT_RE.match(name):
        if m[3] == "down_proj":
            return f"{m[1]}.down_proj", int(m[2]), None
        return f"{m[1]}.gate_up_proj", int(m[2]), _MERGES[m[3]][1]
    if m := _MERGE_RE.match(name):
        target, part = _MERGES[m[2]]
        return f"{m[1]}.{target}.{m[3]}", None, part
    for norm in (".q_norm.", ".k_norm."):
        name = name.replace(f".self_attn{norm}", f".self_attn.attn{norm}")
    return name, None, None


def load_weights(model: nn.Module, model_path: str | Path) -> None:
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_path}")
    fp8 = Fp8Loader.open(model, model_path, files, place)  # [ch28]
    kv_scales = KVScales(len(model.model.layers))  # an FP8 KV cache's scales  # [ch28]
    params = dict(model.named_parameters())  # tied weights appear once, under their first name
    tied_head = "lm_head.weight" not in params
    found: dict[str, dict[tuple[int | None, int | None], torch.Tensor]] = defaultdict(dict)
    unexpected = []
    skipped = []  # not the text model's: a vision tower, an MTP head  # [ch29]
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if fp8 is not None and fp8.take(f, name):  # [ch28]
                    continue  # [ch28]
                ours = name  # what our model calls it
                # >>> ch29 a multimodal checkpoint's text model under a prefix; what is not loaded
                if (ours := text_model_name(name, model)) is None:
                    skipped.append(name)
                    continue
                # <<< ch29
                if kv_scales.take(f, ours):  # [ch28]
                    continue  # [ch28]
                target, expert, part = place(ours)
                if target in params:
                    found[target][expert, part] = _read(f, name, params[target], expert, part)
                elif not (tied_head and ours == "lm_head.weight"):
                    unexpected.append(name)  # a tied checkpoint may still carry a copy: fine
    if skipped:  # [ch29]
        parts = sorted({".".join(n.split(".")[:2]) for n in skipped})  # [ch29]
        logger.info("not loaded: %d tensors under %s", len(skipped), ", ".join(parts))  # [ch29]
    missing = sorted(set(params) - set(found))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {model_path} does not match the model: "
            f"missing {_show(missing)}; unexpected {_show(sorted(unexpected))}"
        )
    kv_scales.done(model)  # [ch28]
    with torch.no_grad():
        for name, param in params.items():
            if fp8 is not None:  # [ch28]
                fp8.prepare(name, found[name], param)  # [ch28]
            tensor = _assemble(name, found[name])
            if tensor.shape != param.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects "
                    f"{tuple(param.shape)}"
                )
            param.copy_(tensor)
    # >>> ch29 layers that keep a checkpoint tensor in a form of their own (Gemma's norms)
    for module in model.modules():
        if hasattr(module, "after_load"):
            module.after_load()
    # <<< ch29


def _read(
    f: Any, name: str, param: nn.Parameter, expert: int | None, part: int | None
) -> torch.Tensor:
    # >>> ch21 a rank reads only its slices of a split tensor
    if (tensor := read_rank_slice(f, name, param, expert, part)) is not None:
        return tensor
    # <<< ch21
    return f.get_tensor(name)


def _assemble(name: str, pieces: dict[tuple[int | None, int | None], torch.Tensor]) -> torch.Tensor:
    """One parameter from the checkpoint tensors placed in it: merged, stacked, or as is."""
    if (None, None) in pieces:  # stored the way we store it
        return pieces[None, None]
    num_parts = 3 if ".qkv_proj." in name else 2 if "gate_up_proj" in name else 1
    parts = range(num_parts) if num_parts > 1 else (None,)
    experts = sorted({e for e, _ in pieces if e is not None})
    if not experts:
        if set(pieces) != {(None, p) for p in parts}:
            have = sorted(p for _, p in pieces)
            raise ValueError(f"checkpoint has only some of the pieces of {name}: {have}")
        return _cat(name, [pieces[None, p] for p in parts])
    prefix = name.rsplit(".", 1)[0]
    if experts != list(range(len(experts))):
        raise ValueError(f"{prefix}: expert ids {experts} are not 0..n-1")
    stacked = []
    for e in experts:
        for p in parts:
            if (e, p) not in pieces:
                proj = "down_proj" if p is None else ("gate_proj", "up_proj")[p]
                raise ValueError(f"checkpoint is missing {prefix}.{e}.{proj}.weight")
        stacked.append(_cat(f"{prefix}.{e}", [pieces[e, p] for p in parts]))
    return torch.stack(stacked)


def _cat(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    if len({tuple(p.shape[1:]) for p in parts}) > 1:
        shapes = [tuple(p.shape) for p in parts]
        raise ValueError(f"{name}: the checkpoint pieces merged into it disagree in shape {shapes}")
    return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]


def _show(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
