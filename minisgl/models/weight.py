"""Loading a Hugging Face safetensors checkpoint into a minisgl model.

Our models keep Hugging Face's parameter names except where we merge tensors to save
matmuls: q/k/v -> qkv_proj, gate/up -> gate_up_proj, and per-expert MLP weights ->
one stacked tensor per projection. Anything left over, or missing, is an error that
names the tensors: a silently half-loaded model produces fluent nonsense.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

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


def read_checkpoint(model_path: str | Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_path}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                tensors[name] = f.get_tensor(name)
    return tensors


def convert_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map checkpoint tensors to our names, merging the pieces we store together."""
    out: dict[str, torch.Tensor] = {}
    pieces: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    for name, tensor in tensors.items():
        if m := _EXPERT_RE.match(name):
            experts[m[1]][int(m[2])][m[3]] = tensor
        elif m := _MERGE_RE.match(name):
            target, index = _MERGES[m[2]]
            pieces[f"{m[1]}.{target}.{m[3]}"][index] = tensor
        else:
            out[
                name.replace(".self_attn.q_norm.", ".self_attn.attn.q_norm.").replace(
                    ".self_attn.k_norm.", ".self_attn.attn.k_norm."
                )
            ] = tensor
    for name, parts in pieces.items():
        want = 3 if ".qkv_proj." in name else 2
        if len(parts) != want:
            raise ValueError(f"checkpoint has only some of the pieces of {name}: {sorted(parts)}")
        out[name] = _cat(name, [parts[i] for i in range(want)])
    for prefix, by_expert in experts.items():
        ids = range(len(by_expert))
        if sorted(by_expert) != list(ids):
            raise ValueError(f"{prefix}: expert ids {sorted(by_expert)} are not 0..n-1")
        for e in ids:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                if proj not in by_expert[e]:
                    raise ValueError(f"checkpoint is missing {prefix}.{e}.{proj}.weight")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[e]["gate_proj"], by_expert[e]["up_proj"]]) for e in ids]
        )
        out[f"{prefix}.down_proj"] = torch.stack([by_expert[e]["down_proj"] for e in ids])
    return out


def load_weights(model: nn.Module, model_path: str | Path) -> None:
    tensors = convert_names(read_checkpoint(model_path))
    params = dict(model.named_parameters())  # tied weights appear once, under their first name
    tied_head = "lm_head.weight" not in params
    if tied_head:
        tensors.pop("lm_head.weight", None)  # some tied checkpoints still carry a copy
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {model_path} does not match the model: "
            f"missing {_show(missing)}; unexpected {_show(unexpected)}"
        )
    with torch.no_grad():
        for name, param in params.items():
            tensor = tensors[name]
            if tensor.shape != param.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects "
                    f"{tuple(param.shape)}"
                )
            param.copy_(tensor)


def _cat(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    if len({tuple(p.shape[1:]) for p in parts}) > 1:
        shapes = [tuple(p.shape) for p in parts]
        raise ValueError(f"{name}: the checkpoint pieces merged into it disagree in shape {shapes}")
    return torch.cat(parts, dim=0)


def _show(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
