"""Chapter 31: state that is not a cache - a hybrid model's recurrent states.

First the memory split of the published Qwen3.5-0.8B and 9B configs, as the engine sizes it:
a fixed state per request for the linear layers against K/V per token for the attention
layers. Then a tiny random Qwen3.5 (and, to compare, a tiny Qwen3 whose every layer attends)
serves a multi-turn chat on the CPU: per turn, the prompt tokens the prefix cache served,
with state snapshots, with the naive cache and for the attention-only model; the state
slots and snapshots the live page shows; and the answers with snapshots against the naive
cache's.

Run from the repo root: python examples/ch31_state.py
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from minisgl.core import SamplingParams
from minisgl.kvcache.mha_pool import MHAKVCache
from minisgl.kvcache.state_pool import RecurrentStatePool
from minisgl.llm import LLM
from minisgl.models.config import ModelConfig
from minisgl.models.families import attention_layers
from minisgl.scheduler.hybrid_cache import state_counters

# ---- the case: tiny models and a chat (tools/figures.py draws the chapter's picture from it)
VOCAB = 512
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
)  # fmt: skip
LINEAR: dict[str, Any] = dict(
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=32, linear_conv_kernel_dim=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                     "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                     "mrope_interleaved": True},
)  # fmt: skip
CHAT = dict(conversations=3, turns=4, system=32, message=8, answer=6)
KW = dict(device="cpu", dtype="float32", max_running_req=4, page_size=1)
TOKENIZER = Path("models/tiny-llama")


def published(hidden: int, layers: int, kv_heads: int, value_heads: int) -> dict[str, Any]:
    """The text config of a published Qwen3.5 (the fields that size its memory)."""
    return dict(
        architectures=["Qwen3_5ForCausalLM"], vocab_size=248320, hidden_size=hidden,
        intermediate_size=4 * hidden, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=kv_heads, head_dim=256, max_position_embeddings=262144,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
        linear_num_key_heads=16, linear_num_value_heads=value_heads, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4,
    )  # fmt: skip


def build_models(out: Path) -> dict[str, Path]:
    """A tiny Qwen3 and a tiny Qwen3.5 (text), random from seed 0, with a tokenizer each."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    models = {
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(**COMMON)),
        "qwen3_5": (Qwen3_5ForCausalLM, Qwen3_5TextConfig(**COMMON, **LINEAR)),
    }
    paths = {}
    for name, (cls, config) in models.items():
        torch.manual_seed(0)
        model = cls(config).float()
        with torch.no_grad():  # every weight random (norms start as zeros or ones)
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        model.save_pretrained(out / name)
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (TOKENIZER / f).is_file():
                shutil.copy(TOKENIZER / f, out / name / f)
        paths[name] = out / name
    return paths


def ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


class Watch:
    """Reads the live page's state counters before every forward: the most slots in use."""

    def __init__(self, llm: LLM) -> None:
        self.s, self.most = llm.scheduler, 0

    def counters(self) -> dict[str, int]:
        return state_counters(len(self.s.reqs), self.s.cache, self.s.engine.state_pool)

    def forward_begins(self, batch: Any) -> None:
        self.most = max(self.most, self.counters()["state_slots_in_use"])

    def forward_launched(self, batch: Any) -> None:
        pass


def chat(path: Path, **config: Any) -> list[dict[str, Any]]:
    """The conversations, side by side, turn by turn: per turn the prompt tokens, those the
    cache served, the answers, and (for a hybrid) the state counters."""
    llm = LLM(str(path), **KW, **config)
    watch = Watch(llm)
    if llm.engine.state_pool is not None:
        llm.scheduler.listeners.append(watch)
    params = SamplingParams(max_tokens=CHAT["answer"], ignore_eos=True)
    system = ids(0, CHAT["system"])
    prompts = [system + ids(1000 + c, CHAT["message"]) for c in range(CHAT["conversations"])]
    turns = []
    for turn in range(CHAT["turns"]):
        watch.most = 0
        out = llm.generate(prompts, params, use_tqdm=False)
        turns.append(
            dict(
                prompt=sum(len(p) for p in prompts),
                cached=sum(o["cached_tokens"] for o in out),
                answers=[o["token_ids"] for o in out],
                slots_most=watch.most,
                counters=watch.counters() if llm.engine.state_pool is not None else {},
            )
        )
        prompts = [p + o["token_ids"] + ids(2000 + 100 * turn + c, CHAT["message"])
                   for c, (p, o) in enumerate(zip(prompts, out))]  # fmt: skip
    llm.scheduler.check_integrity()
    llm.shutdown()
    return turns


def runs(out: Path) -> dict[str, list[dict[str, Any]]]:
    paths = build_models(out)
    return {
        "hybrid, snapshots": chat(paths["qwen3_5"]),
        "hybrid, naive cache": chat(paths["qwen3_5"], cache_type="naive"),
        "attention only": chat(paths["qwen3"]),
    }


def main() -> None:
    # ---- 1. the memory split of the published configs, as the engine computes it -----------
    print("published Qwen3.5, bf16: K/V a token for the attention layers, a state a request")
    print("  model  layers  attention  K/V a token  state a request  = K/V of tokens")
    for name, raw in {"0.8B": published(1024, 24, 2, 16), "9B": published(4096, 32, 4, 32)}.items():
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(raw))
            mc = ModelConfig.from_path(Path(tmp))
        attn = attention_layers(mc)
        assert mc.linear is not None
        kv = MHAKVCache.bytes_per_page(len(attn), 1, mc.num_kv_heads, mc.head_dim, torch.bfloat16)
        state = RecurrentStatePool.bytes_per_slot(mc.num_layers - len(attn), mc.linear,
                                                  torch.bfloat16)  # fmt: skip
        print(f"  {name:5} {mc.num_layers:7} {len(attn):10} {kv // 1024:9} KB "
              f"{state / 2**20:12.1f} MB  {state // kv:10,}")  # fmt: skip

    # ---- 2. a multi-turn chat on a tiny hybrid: what the prefix cache serves ---------------
    with tempfile.TemporaryDirectory() as tmp:
        results = runs(Path(tmp))
    c = CHAT
    print(f"\na chat: {c['conversations']} conversations x {c['turns']} turns side by side, a "
          f"{c['system']}-token system prompt, {c['message']}-token messages, {c['answer']}-token "
          f"answers; tiny random models, fp32, CPU")  # fmt: skip
    print("prompt tokens served from the cache / prompt tokens, per turn")
    print(f"  {'turn':5}" + "".join(f"{name:>22}" for name in results))
    for t in range(c["turns"]):
        cells = [f"{r[t]['cached']:>4} / {r[t]['prompt']:<4}" for r in results.values()]
        print(f"  {t + 1:<5}" + "".join(f"{x:>22}" for x in cells))
    print("the hybrid's states, as the live page shows them after each turn")
    for t, turn in enumerate(results["hybrid, snapshots"]):
        k = turn["counters"]
        print(f"  turn {t + 1}: at most {turn['slots_most']} of {k['state_slots']} slots in use; "
              f"{k['state_snapshots_held']} of {k['state_snapshots']} snapshots held")  # fmt: skip
    same = [t["answers"] for t in results["hybrid, snapshots"]] == [
        t["answers"] for t in results["hybrid, naive cache"]
    ]
    print(f"answers with snapshots equal the naive cache's: {same}")


if __name__ == "__main__":
    main()
