"""What a hybrid model (linear-attention layers with a recurrent state beside attention layers
with KV pages) cannot do yet, refused or turned off by name at start-up; and its setting.

- Speculative decoding: a verify step advances the state over every draft, and only some
  are accepted. The linear layers keep what the verify computed and the speculator rolls
  each request's slot back to its accepted length (`RecurrentStatePool.keep_accepted`),
  conv state included. On the torch path that roll back holds the forward's own tensors,
  so verify graphs are off there (`verify_graph_blocker`); our kernels keep them in the
  pool's buffers, and verify graphs run. A hybrid draft model is refused: its own state
  would need the same after every verify.
- Tensor parallelism cuts the linear layers by key heads (each rank the value heads that
  read its keys): a tp_size that does not divide linear_num_key_heads, or the shared
  expert's width, is refused here, by name, rather than when a rank builds its layers.
- A radix-cache hit skips the prefix's forward, so its recurrent state would never be
  computed: the prefix cache of a hybrid keeps state snapshots (`state_snapshots` of them,
  scheduler/hybrid_cache.py) and hits only where one was saved.
- Graphs: decode graphs run, their state slots in the graphs' static buffers (engine/graph.py).
  Prefill graphs (`graph_blocker`) run only on our Triton kernels (MINISGL_GATED_DELTA,
  by default on CUDA), which read each request's slot and token offsets from those
  buffers: the torch path pads a prefill's requests to the longest, a shape it reads on the
  host, so a graph would replay the lengths it was captured with.

No torch here: the command line checks the options in the API server's process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minisgl.env import ENV

if TYPE_CHECKING:
    from minisgl.models.config import ModelConfig

# Hybrids whose config.json may not write layer_types out (they follow full_attention_interval).
_HYBRID_ARCHS = ("Qwen3NextForCausalLM",)


def _hybrid(folder: Any) -> tuple[str, dict] | None:
    """(architecture, text config) of the model in `folder` if it has linear-attention
    layers; None if not, or if it has no config.json (other checks say so)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    text = raw.get("text_config") or raw
    arch = (raw.get("architectures") or ["this model"])[0]
    if "linear_attention" not in (text.get("layer_types") or ()) and arch not in _HYBRID_ARCHS:
        return None
    return arch, text


@dataclass(kw_only=True)
class HybridConfig:
    # Recurrent states the prefix cache may save (kvcache/state_pool.py), each as big as a
    # running request's; None: a quarter of the memory budget the running states leave (one
    # per running request with num_page_override, which fixes the pool; none with the naive
    # cache).
    state_snapshots: int | None = None


def check_hybrid(config: Any) -> None:
    """Raise ValueError for an option a hybrid model cannot honour (config: an EngineConfig):
    a hybrid draft model, ranks its heads do not divide among, or a negative number of
    snapshots; run by `check_model_files`, before anything loads or a process starts."""
    if config.state_snapshots is not None and config.state_snapshots < 0:
        raise ValueError(f"state_snapshots must be >= 0, got {config.state_snapshots}")
    if config.speculative == "draft" and (draft := _hybrid(config.draft_model)):
        raise ValueError(
            f"draft model {config.draft_model} ({draft[0]}) has linear-attention layers: a "
            "draft model's state would have to be rolled back after every verify; pick a "
            "draft model with attention layers only"
        )
    hybrid = _hybrid(config.model_path)
    if hybrid is None:
        return
    arch, text = hybrid
    sizes = {k: text.get(k) for k in ("linear_num_key_heads", "shared_expert_intermediate_size")}
    problems = [
        f"{k} {v} is not divisible by {config.tp_size}"
        for k, v in sizes.items()
        if v and v % config.tp_size
    ]
    if problems:
        raise ValueError(f"cannot split {arch} over {config.tp_size} ranks: {'; '.join(problems)}")


def _our_kernels(device_type: str) -> bool:
    choice = ENV.GATED_DELTA.value
    return choice == "triton" or (choice == "auto" and device_type == "cuda")


def graph_blocker(model_config: ModelConfig, device_type: str) -> str | None:
    """Why a model's prefill graphs are off (None: they may run): a hybrid's linear layers
    on the torch path pad a prefill's requests by lengths read on the host. Our kernels
    (the default on CUDA) read them on the device, from the graphs' buffers."""
    if model_config.linear is None or _our_kernels(device_type):
        return None
    return (
        "the linear-attention layers' torch path pads a prefill's requests by their lengths "
        "on the host, so a graph would replay the lengths it was captured with "
        "(MINISGL_GATED_DELTA=triton reads them on the device)"
    )


def verify_graph_blocker(model_config: ModelConfig, device_type: str) -> str | None:
    """Why verify graphs are off (None: they may run): on the torch path each forward of a
    hybrid's verify leaves its roll back with the state pool, holding that forward's own
    tensors, which a graph's replay would not renew. Our kernels' roll back reads fixed
    buffers that the verify writes, replayed or not (kvcache/state_pool.py `verify_views`)."""
    if model_config.linear is None or _our_kernels(device_type):
        return None
    return (
        "the linear layers' torch path leaves each verify's roll back with the state pool, "
        "holding that forward's tensors (MINISGL_GATED_DELTA=triton keeps them in buffers)"
    )
