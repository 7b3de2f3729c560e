"""Chapter 21: tensor parallelism - one model cut over two ranks, on the CPU over gloo.

Shows how the weights of one layer are cut (which slice each rank holds, and where a KV
head is shared), then runs the offline LLM with tp_size=2 next to tp_size=1 on the same
tiny model and compares their greedy tokens (the tests compare the logits too). Ranks
1.. are processes of their own, started with the spawn method, so the script's work sits
under the `if __name__ == "__main__":` guard.
"""

from pathlib import Path

import torch

from minisgl.core import SamplingParams
from minisgl.distributed import Split
from minisgl.distributed.info import set_tp_info
from minisgl.llm import LLM
from minisgl.models.config import ModelConfig

MODEL = Path("models/tiny-qwen3")


def show_splits() -> None:
    c = ModelConfig.from_path(MODEL)
    print(f"{MODEL.name}: {c.num_heads} query heads, {c.num_kv_heads} KV heads of {c.head_dim}")
    for size, kv_heads in [(2, c.num_kv_heads), (4, c.num_kv_heads)]:
        for rank in range(size):
            set_tp_info(rank, size)
            q, k, v = Split.qkv(c.num_heads, kv_heads, c.head_dim).ranges(range(3))
            mlp = Split.even(1, c.intermediate_size).ranges((0,))[0]
            print(f"  tp {size} rank {rank}: qkv rows q{q} k{k} v{v}, down_proj columns {mlp}")
    set_tp_info(0, 1)


def run(tp_size: int) -> list[list[int]]:
    llm = LLM(str(MODEL), dtype=torch.float32, device="cpu", num_page_override=128, tp_size=tp_size)
    try:
        prompts = ["Tensor parallelism cuts", "Each rank holds"]
        out = llm.generate(prompts, SamplingParams(max_tokens=6), use_tqdm=False)
        return [o["token_ids"] for o in out]
    finally:
        llm.shutdown()


def main() -> None:
    torch.set_num_threads(1)
    show_splits()
    one_tokens, two_tokens = run(1), run(2)
    print(f"tp 1 greedy tokens: {one_tokens}")
    print(f"tp 2 greedy tokens: {two_tokens}")
    print(f"same tokens: {one_tokens == two_tokens}")


if __name__ == "__main__":
    main()
